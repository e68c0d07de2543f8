// Host-side launchers of the routed-expert (MoE) kernels: raw pointers, sizes and a stream, no torch types
// (moe_bindings.cpp is the torch glue). Every launcher returns the CUDA error of its launch.
//
// One MoE layer call, for a chunk of tokens (moe_bindings.cpp loops over chunks so the workspace stays bounded):
//   1. route            topk ids -> local expert per (token, k) pair, per-expert pair lists, row-chunk table
//   2. gather transform xh13[pair][proj] = H(x[token] * suh[expert][proj]) / sqrt(128), fp16   (proj: gate, up)
//   3. grouped GEMM     gu[pair][split][proj] = H(xh13 . Ŵ[expert][proj]) / sqrt(128) * svh    (fp32)
//   4. act transform    xh2[pair] = H(act(gate) * up * suh2[expert]) / sqrt(128), fp16 (TP slice only, zeros else),
//                       gate and up summed over the K splits in split order first
//   5. grouped GEMM     slot[pair][split] = H(xh2 . Ŵ2[expert]) / sqrt(128) * svh2 * router weight   (fp32)
//   6. reduce           y[token] = sum over k, then splits, of slot[token * top_k + k] (fixed order, no atomics)
// At decode sizes the GEMMs split K over several blocks (moe_k_splits) so that the few routed experts still fill
// the GPU; the splits' partial sums go to their own fp32 slots, never through float atomics.
// Every grid is sized from shapes alone (worst case), blocks past the device-side counts exit: no host sync, so
// the whole sequence captures into a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "exl3_kernels.h"
#include "moe_planner.h"

namespace exl3 {

constexpr int kMoeMaxExperts = 1024;  // local experts per layer: the routing kernel keeps one counter per expert

// kActSwigluOai: gpt-oss's clamped SwiGLU, min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, ±limit) + 1)
enum MoeActivation : int { kActSilu = 0, kActGelu = 1, kActGeluTanh = 2, kActSwigluOai = 3 };

// The key of an (expert, projection) weight: its kernel instantiation (bit width, codebook). A layer whose weights
// share one key runs one GEMM launch per projection kind; mixed layers run one launch per key, each skipping the
// weights of other keys.
inline int moe_weight_key(int words, int codebook) { return words * 4 + codebook; }

// The GEMMs that run the kDup form (3inst/mcg codebooks, 8/16-row chunks): their input, written by the transforms with
// `dup` set, holds each activation row in duplicated fragment order, twice the bytes of the plain row (moe_gemm.cuh
// says why; it took the Qwen3-30B-A3B layer from 91 to 83 µs at 8 tokens and 196 to 178 at 64 on the H200,
// bench/notes/serving-run-06.md "Sixth run"). The plain layout stays for the others; a layer that mixes mul1 with
// 3inst/mcg experts gets both copies (MoeWorkspace xh13_dup, xh2_dup).
__host__ __device__ constexpr bool moe_xdup(int codebook, int rows) { return codebook != kCbMul1 && rows <= 16; }

// The router's choice: which expert each (token, k) pair goes to, and which experts are this rank's.
struct MoeIds {
  const void* topk_ids;  // [pairs], int32 or int64 (ids64)
  bool ids64;
  const int* expert_map;  // [global experts] -> local id or -1; null: ids are local
  int global_experts, experts;
};

struct MoeRouteArgs {
  MoeIds ids;
  int pairs, rows_per_chunk;
  int* pair_expert;   // [pairs] local expert or -1
  int* sorted_pairs;  // [pairs] pair indices grouped by expert
  int* chunk_expert;  // [chunk_bound]
  int* chunk_start;   // [chunk_bound] index into sorted_pairs
  int* chunk_count;   // [chunk_bound] rows in the chunk (1..rows_per_chunk)
  int* num_chunks;    // [1]
};
cudaError_t launch_moe_route(const MoeRouteArgs& a, cudaStream_t stream);

// Step 2: gate/up inputs. x [tokens, hidden] (row stride x_stride); pair p reads token p / top_k, optionally scaled by
// its router weight (top-1 models apply it on the input).
struct MoeGatherArgs {
  MoeIds ids;  // the gather finds each pair's local expert itself (it runs beside the routing kernel)
  const void* x;
  int x_dtype;
  long long x_stride;
  int hidden;                  // logical input columns; columns past it are zeros
  int hidden_padded;           // H
  int pairs, top_k;
  const void* suh;             // fp16 [experts][2][H]
  const float* pair_weight;    // [pairs] or null
  void* xh;                    // fp16 [pairs][2][H]
  bool dup;  // xh in duplicated fragment order ([pairs][2][2H]) for a kDup GEMM (moe_xdup)
};
cudaError_t launch_moe_gather_transform(const MoeGatherArgs& a, bool pdl, cudaStream_t stream);

// Step 4: down inputs from the gate/up outputs.
struct MoeActArgs {
  const float* gu;  // [pairs][splits][2][I]
  int splits;
  int inter_padded;             // I
  int inter_offset, inter_size;  // this rank's columns of the intermediate dim; others are zeros
  int activation;               // MoeActivation
  float limit, alpha;           // kActSwigluOai's clamp and sigmoid scale
  const float* bias;            // fp32 [experts][2][I]: gate and up biases added before the activation, or null
  int pairs;
  const int* pair_expert;
  const void* suh;  // fp16 [experts][I]
  void* xh;         // fp16 [pairs][I]
  bool dup;  // xh in duplicated fragment order ([pairs][2I]) for a kDup GEMM (moe_xdup)
};
cudaError_t launch_moe_act_transform(const MoeActArgs& a, bool pdl, cudaStream_t stream);

// Steps 3 and 5: grouped GEMM over the row-chunk table. Block (chunk, column group, projection): the chunk's rows of
// xh times the 128 output columns of its expert's weight, then the output Hadamard and svh.
struct MoeGemmArgs {
  const int16_t* trellis;  // (expert, proj) slice at trellis + (expert * projs + proj) * slice_stride
  long long slice_stride, row_stride;
  int tile_stride;
  int bits2, codebook;
  const int* keys;  // [experts * projs] moe_weight_key of each slice, or null when all share want_key
  int want_key;
  int projs;
  const void* svh;  // fp16 [experts * projs][N]
  int n_padded;       // N
  const void* xh;    // fp16; row of pair p for proj q: xh + p * xh_row_stride + q * xh_proj_stride (K wide)
  long long xh_row_stride, xh_proj_stride;
  int kb_count;  // K / 128
  int groups;    // N / 128
  const int* chunk_expert;
  const int* chunk_start;
  const int* chunk_count;
  const int* num_chunks;
  const int* sorted_pairs;
  int chunk_bound;
  bool table_early;  // the routing table was complete before the previous kernel started (see moe_gemm.cuh)
  int splits;  // K splits (grid z); split s writes its partial at y + s * y_split_stride
  // Output, fp32: y[p * y_row_stride + s * y_split_stride + q * N + col] = H(partial) * svh * pair_weight[p].
  float* y;
  long long y_row_stride, y_split_stride;
  const float* pair_weight;  // router weight per pair, or null (1: gate/up, or applied on the input)
};
// Once per layer at load: raises the shared-memory limits of every row size's kernel for this (width, codebook).
cudaError_t moe_prepare(int bits2, int codebook);
cudaError_t launch_moe_gemm(const MoeGemmArgs& a, int rows_per_chunk, bool pdl, cudaStream_t stream);

// Step 6.
struct MoeReduceArgs {
  const float* slots;  // [pairs][splits][H]
  int splits;
  int hidden_padded, hidden;
  int tokens, top_k;
  const int* pair_expert;
  const float* bias;         // fp32 [experts][bias_stride]: the down projection's bias, or null
  long long bias_stride;
  const float* pair_weight;  // the bias's router weight per pair, or null (1: the weight was applied on the input)
  void* y;  // [tokens][hidden], act dtype, row stride y_stride
  int y_dtype;
  long long y_stride;
};
cudaError_t launch_moe_reduce(const MoeReduceArgs& a, bool pdl, cudaStream_t stream);

}  // namespace exl3

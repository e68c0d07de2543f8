// Host-side launchers of the EXL3 kernels: raw pointers, sizes and a stream. No torch types (bindings.cpp is the
// only file that knows torch). Every launcher returns the CUDA error of its launch.
//
// Geometry: a linear stores W as (K_in, N) = (16*kt_total, 16*nt_total) in 16x16 tiles; a call works on the
// "active" part only: 128-row blocks [kb0, kb0 + kb_count) of the input side (the blocks the caller's input touches)
// and 128-column groups [g0, g0 + groups) of the output side (the groups the caller's output columns touch).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace exl3 {

enum Codebook : int { kCb3Inst = 0, kCbMcg = 1, kCbMul1 = 2 };  // = format.CODEBOOKS order on the Python side
enum ActDtype : int { kActF16 = 0, kActBF16 = 1 };

// The two 128-point Hadamards of a linear are orthonormal: 1/sqrt(128) each, 1/128 together. The skinny and panel
// kernels put 1/sqrt(128) on each side; the reconstruct path puts 1/16 on xh and 1/8 on W' (powers of two: exact,
// and 1/8 folds into the fp16 tensor-core operand that applies svh).
constexpr float kHadScale = 0.08838834764831845f;
constexpr float kReconInputScale = 0.0625f, kReconWeightScale = 0.125f;
static_assert(kReconInputScale * kReconWeightScale == 1.0f / 128, "the two shares make the Hadamards' 1/128");

// Workspace carving (the dense path's in bindings.cpp, the MoE path's in moe.cu): every sub-buffer starts on a
// 256-byte boundary, the alignment cudaMalloc gives, so each one is as aligned as a buffer of its own.
constexpr size_t align256(size_t n) { return (n + 255) / 256 * 256; }

struct TrellisView {
  const int16_t* data;    // tile (kt, nt) starts at data + kt * row_stride + nt * tile_stride (int16 elements)
  long long row_stride;   // int16 elements between k-tile rows
  int tile_stride;        // int16 elements between neighbouring tiles of a row (>= 16 * bits; multiple of 8)
  int bits2;              // 2 * bits: 2..16 (integer bits) or 3/5/7 (1.5/2.5/3.5, mul1 only)
  int codebook;           // exl3::Codebook
};

// x [rows, in_width] (fp16/bf16, row stride x_stride) placed at input column in_offset of a zero input, times suh,
// 128-point Hadamard per block, rounded to xh_dtype (fp16 for the skinny and panel kernels): xh [xh_rows,
// kb_count * 128] (dense), for blocks kb0.. only; rows rows .. xh_rows-1 are written as zeros (the skinny kernel
// reads whole row chunks). Optionally writes per-row partial sums of fp16 xh (rowsum_parts [rows,
// input_transform_parts(kb_count)]) and clears `zero_bytes` (multiple of 16) at `zero` (the split-K workspace of the
// next kernel).
struct InputTransformArgs {
  const void* x;
  int x_dtype;  // exl3::ActDtype
  long long x_stride;
  int rows, xh_rows, in_width, in_offset;
  const void* suh;  // fp16 [K_in]
  int kb0, kb_count;
  void* xh;
  int xh_dtype;  // exl3::ActDtype
  float scale;   // kHadScale, or kReconInputScale for the reconstruct path
  float* rowsum_parts;
  void* zero;
  size_t zero_bytes;
};
int input_transform_parts(int kb_count);
// pdl: may start while the previous kernel in the stream runs (it must not read that kernel's results) and completes
// only after it.
cudaError_t launch_input_transform(const InputTransformArgs& a, bool pdl, cudaStream_t stream);
// The same for `shards` linears of one input, one launch (gridDim.z = shard): shard s uses suh[s] and writes its xh
// at a.xh + s * xh_rows * kb_count * 128 elements and its rowsum parts at a.rowsum_parts + s * rows *
// input_transform_parts(kb_count); a.suh is ignored; a.zero is cleared once.
cudaError_t launch_input_transform_group(const InputTransformArgs& a, const void* const* suh, int shards, bool pdl,
                                         cudaStream_t stream);

// Skinny GEMM (1..16 rows per row chunk, any number of chunks) and panel GEMM (64 rows per chunk): decode tiles in
// registers and feed tensor cores; both take GemmArgs.
// y [rows, out_features] (x's dtype, row stride y_stride) = output columns [out_offset, out_offset + out_features).
// Division by a runtime constant d >= 1 for numerators n < 2^31 in three instructions (round-up method, Hacker's
// Delight 10-9): q = (umulhi(n, mul) + n) >> shift. Set up on the host with make_fast_div.
struct FastDiv {
  int d;
  unsigned mul;
  int shift;
};
inline FastDiv make_fast_div(int d) {
  int l = 0;
  while ((1LL << l) < d) ++l;
  const unsigned long long m = ((1ULL << 32) * ((1ULL << l) - static_cast<unsigned long long>(d))) / d + 1;
  return {d, static_cast<unsigned>(m), l};
}
#if defined(__CUDACC__)
#define EXL3_FASTDIV_HD __host__ __device__ __forceinline__
#else
#define EXL3_FASTDIV_HD inline
#endif
// n / d and n % d for 0 <= n < 2^31 (the high product word is one IMAD.HI on the device).
EXL3_FASTDIV_HD int fast_div(int n, const FastDiv& f) {
  const unsigned u = static_cast<unsigned>(n);
  const unsigned hi = static_cast<unsigned>((static_cast<unsigned long long>(u) * f.mul) >> 32);
  return static_cast<int>((hi + u) >> f.shift);
}
EXL3_FASTDIV_HD int fast_mod(int n, const FastDiv& f) { return n - fast_div(n, f) * f.d; }

constexpr int kGemmWarps = 8;  // warps per block of the skinny and panel GEMMs

struct GemmArgs {
  TrellisView w;
  const void* xh;  // fp16 [row_chunks * rows_per_chunk, kb_count * 128], from launch_input_transform
  const void* svh; // fp16 [N]
  const float* rowsum_parts;
  int parts;
  float* partials;  // fp32 [row_chunks * groups, max_slots, rows_per_chunk, 128]: split-K partial sums (or null)
  int max_slots;
  int* counters;    // int [row_chunks * groups] (zeroed), or null in direct mode
  void* y;
  int y_dtype;
  long long y_stride;
  int out_offset, out_features;
  int rows, kb0, kb_count, g0, groups;
  FastDiv kta_div, groups_div;  // by kb_count * 8 (active k-tiles) and by groups; set by launch_gemm
  // Diagnostics (null normally; skinny kernel only): per warp {smid, entry, first data, last item done, exit} in
  // %globaltimer ns.
  unsigned long long* trace;
};
// Grouped skinny GEMM (launch_gemm_group): 2..kMaxGroupShards linears that share the input x, K, codebook and bit
// width (attention q, k, v), each with its own trellis, suh, svh and N (a multiple of 128), in one launch whose
// stream-K work spans all their column groups. y [rows, sum N] holds the shards side by side.
constexpr int kMaxGroupShards = 4;
struct GemmShards {
  int group_end[kMaxGroupShards];         // cumulative column groups: shard s owns [group_end[s-1], group_end[s]);
                                          // entries past the last shard INT_MAX
  const int16_t* data[kMaxGroupShards];   // each shard's trellis (same tile stride, its own row stride)
  long long row_stride[kMaxGroupShards];
  const void* svh[kMaxGroupShards];       // fp16 [N_s]
  long long xh_shard;  // elements between consecutive shards' xh (launch_input_transform_group's layout)
  int rowsum_shard;    // floats between consecutive shards' rowsum_parts
};
struct GemmPlan {
  bool panel;          // the panel kernel (64-row chunks, each tile decoded once per chunk) instead of the skinny one
  int rows_per_chunk;  // 8 or 16 (skinny), 64 (panel)
  int row_chunks;
  int grid;            // blocks
  bool split_k;        // stream-K with atomics (needs acc/counters) vs one block per (row chunk, group)
  bool dup;            // codeword x duplicated activations (default) vs rounded Ŵ pairs (bench comparison)
  int max_slots;       // split-K: most blocks sharing one column group
  size_t partial_bytes, counter_bytes;
};
// Picks the kernel, variant and grid for a call: the panel kernel when `panel`, else the skinny one.
// force_split / force_dup < 0: automatic; 0/1 force (tests, bench; dup: skinny only).
GemmPlan plan_gemm(const GemmArgs& a, int force_split, int force_dup, bool panel);
cudaError_t launch_gemm(const GemmArgs& a, const GemmPlan& plan, bool pdl, cudaStream_t stream);
// Grouped skinny GEMM: a as for one linear of the total width (a.groups = sum of the shards' groups, a.kb0 = a.g0 =
// 0, a.out_offset = 0, a.out_features = a.y_stride's width), a.w giving codebook, bits2 and tile stride; the shards'
// own tensors in `shards`. Duplicated-activation codewords only (plan_gemm_group's plan.dup is always true); null
// kernel (cudaErrorInvalidValue) for the panel or plain variants and for more than 8 rows (skinny.cuh).
GemmPlan plan_gemm_group(const GemmArgs& a, int force_split);
cudaError_t launch_gemm_group(const GemmArgs& a, const GemmShards& shards, const GemmPlan& plan, bool pdl,
                              cudaStream_t stream);
bool gemm_group_fits_device(int codebook, int bits2, int rows);
// Whether the skinny (or panel) kernel for this codebook, width and row count fits the current device (its shared
// memory: the widest skinny variants need more than the 99 KB per block of sm_12x parts); `auto` falls back to
// reconstruct + cuBLAS.
bool gemm_fits_device(int codebook, int bits2, int rows, bool panel);

// The active part of the weight as a dense row-major matrix out [kb_count*128, groups*128], fp16 or bf16:
// * svh null: Ŵ (rotated basis), bit-exact with the reference (bf16: Ŵ rounded once more);
// * svh given: W' = Ŵ H diag(svh) / 8, the output side applied (what xh scaled by kReconInputScale multiplies to give
//   y); fp16 sums across tiles, tensor-core sums inside them, rounded to out_dtype;
// * suh given too: W = diag(suh) H Ŵ H diag(svh) / 128, the original basis (what x itself multiplies to give y);
//   the input side in fp32, rounded to fp16, then the output side as for W', rounded to out_dtype.
struct ReconstructArgs {
  TrellisView w;
  int kb0, kb_count, g0, groups;
  void* out;
  int out_dtype;
  const void* svh;  // fp16 [N] (whole linear), or null
  const void* suh;  // fp16 [K] (whole linear), or null; needs svh
};
// pdl (output side only): may start while the previous kernel in the stream runs (it reads nothing that kernel
// writes) and completes only after it.
cudaError_t launch_reconstruct(const ReconstructArgs& a, bool pdl, cudaStream_t stream);

// A 16-bit (unquantized) linear at decode sizes, the one a MoE layer's router is: y [rows, n] = x [rows, k] W^T,
// W [n, k] row-major, x and W both fp16 or both bf16 (`dtype`: ActDtype), y fp32 or that dtype; rows <=
// kSmallLinearMaxRows, k % 8 == 0, x rows and W 16-byte aligned. One warp per output column, all of its weight row's
// loads in flight at once, fp32 sums in a fixed order (bitwise repeatable).
constexpr int kSmallLinearMaxRows = 16;
struct SmallLinearArgs {
  const void* x;
  long long x_stride;
  const void* w;
  int dtype;
  int rows, n, k;
  void* y;  // row stride n
  bool y_fp32;
};
cudaError_t launch_small_linear(const SmallLinearArgs& a, cudaStream_t stream);

// Which kernels this library was built for (e.g. "sm_90a sm_121a") and whether the current device can run them.
const char* built_archs();
cudaError_t probe_device_support();

}  // namespace exl3

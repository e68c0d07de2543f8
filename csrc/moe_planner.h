// The routed-expert op's plan for one token chunk, as host arithmetic: rows per chunk, the row-chunk bound, the K
// splits of its two GEMMs, the workspace carving, and the bytes reserved for all of it. moe_bindings.cpp asks these
// per call and moe.h's kernels carry them out. No torch and no launches: tests/kernels/csrc/moe_planner_host.cpp
// runs them on the CPU.
#pragma once

#include <cstddef>

namespace exl3 {

// Tokens per internal step of the native_moe op (moe_bindings.cpp): bounds the workspace (moe_workspace_layout);
// longer calls run chunk by chunk. Python mirrors it as kernels/backends/native_moe_limits.py MOE_CHUNK_TOKENS.
constexpr int kMoeChunkTokens = 1024;

// Workspace layout of one token chunk (bytes, 256-aligned pieces); see moe_workspace_layout.
struct MoeWorkspace {
  size_t pair_expert, sorted_pairs, chunk_expert, chunk_start, chunk_count, num_chunks;  // int32 arrays
  size_t xh13;   // fp16 [pairs][2][H]            (step 2, read by step 3)
  size_t gu;     // fp32 [pairs][splits][2][I]    (step 3, read by step 4)
  size_t xh2;    // fp16 [pairs][I]               (step 4, read by step 5): aliases xh13, dead by then
  size_t slots;  // fp32 [pairs][splits][H]       (step 5, read by step 6): aliases xh13 after xh2
  size_t xh13_dup, xh2_dup;  // the kDup GEMMs' copies of xh13 and xh2 (2x bytes), each after its plain copy
  size_t total;
};
// pairs = tokens * top_k; chunk_bound = most row chunks any routing of `pairs` pairs over `experts` experts can make.
int moe_chunk_bound(int pairs, int experts, int rows_per_chunk);
MoeWorkspace moe_workspace_layout(int tokens, int top_k, int experts, int hidden_padded, int inter_padded,
                                  int rows_per_chunk, int splits13, int splits2);
// K splits for a GEMM whose grid has `blocks` blocks (the chunk bound's) on a GPU of `sms` multiprocessors: the most
// that keep the grid within kMoeSplitBlocksPerSm blocks per SM and every split at least kMoeSplitMinKb 128-blocks of
// K, at most kMoeMaxSplits; none past kMoeSplitMaxPairs pairs (decode sizes only, so the split slots never need more
// workspace than a full token chunk without splits). Fitted on the H100 sweep of every split pair at 1-32 tokens
// (bench/notes/serving-run-17.md "Seventeenth run": Qwen3-30B-A3B 4-bit at 3 tokens 69.7 -> 47.9 µs a layer, mean
// regret 0.8 % against the best pair, worst 4.6 %); the rule before it (two blocks per SM) left the 3-6 token calls
// unsplit on the whole K range.
constexpr int kMoeMaxSplits = 4;
constexpr int kMoeSplitMaxPairs = 256;
constexpr int kMoeSplitBlocksPerSm = 9;
constexpr int kMoeSplitMinKb = 3;
int moe_k_splits(int pairs, long long blocks, int sms, int kb_count);
// The row-chunk size for `pairs` pairs over `experts` experts; the caller routes with the size it launches with.
int moe_rows_per_chunk(int pairs, int experts);

// One chunk's launch shape: what moe_bindings.cpp routes, sizes its grids and carves its workspace with. A bench may
// force the split counts (env.h VLLM_EXL3_MOE_SPLITS13/2, read per call) up to 256 pairs.
struct MoeChunkPlan {
  int rows_per_chunk, chunk_bound;
  int splits13, splits2;  // K splits of the gate/up GEMM (K = hidden) and of the down GEMM (K = intermediate)
};
MoeChunkPlan moe_chunk_plan(int pairs, int experts, int hidden_padded, int inter_padded, int sms);

// Workspace bytes for calls of up to `tokens` tokens: the largest layout any chunk plan of them can take, forced
// split counts up to kMoeMaxSplits included.
size_t moe_reserve_bytes(int tokens, int top_k, int experts, int hidden_padded, int inter_padded);

}  // namespace exl3

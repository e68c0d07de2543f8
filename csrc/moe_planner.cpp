// The routed-expert op's chunk plan (moe_planner.h): plain host arithmetic.
#include "moe_planner.h"

#include <algorithm>

#include "env.h"
#include "exl3_decode.cuh"  // kHadBlock
#include "exl3_kernels.h"  // align256

namespace exl3 {

int moe_chunk_bound(int pairs, int experts, int rows_per_chunk) {
  // Each expert's list splits into ceil(n_e / R) chunks: at most (pairs + min(E, pairs) * (R - 1)) / R in all.
  const long long touched = std::min(experts, pairs);
  return static_cast<int>((pairs + touched * (rows_per_chunk - 1)) / rows_per_chunk);
}

MoeWorkspace moe_workspace_layout(int tokens, int top_k, int experts, int hidden_padded, int inter_padded,
                                  int rows_per_chunk, int splits13, int splits2) {
  const size_t pairs = static_cast<size_t>(tokens) * top_k;
  const size_t chunks = moe_chunk_bound(static_cast<int>(pairs), experts, rows_per_chunk);
  MoeWorkspace w{};
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align256(bytes);
    return here;
  };
  w.pair_expert = take(pairs * 4);
  w.sorted_pairs = take(pairs * 4);
  w.chunk_expert = take(chunks * 4);
  w.chunk_start = take(chunks * 4);
  w.chunk_count = take(chunks * 4);
  w.num_chunks = take(4);
  w.gu = take(pairs * splits13 * 2 * inter_padded * 4);
  // xh13 is dead once the gate/up GEMM has run: xh2 and the slots reuse its bytes (they must not overlap each
  // other: the down GEMM reads one and writes the other).
  const size_t big = at;
  const size_t xh13 = align256(pairs * 2 * hidden_padded * 2);
  const size_t xh2 = align256(pairs * inter_padded * 2), slots = align256(pairs * splits2 * hidden_padded * 4);
  w.xh13 = big;
  w.xh2 = big;
  w.slots = big + xh2;
  w.total = big + std::max(xh13, xh2 + slots);
  // The kDup GEMMs' copies in duplicated order (moe_xdup's row sizes), each after its plain copy: a layer of one
  // codebook writes one of the two, a layer mixing mul1 with 3inst/mcg both.
  if (rows_per_chunk <= 16) {
    w.xh13_dup = big + xh13;
    w.xh2_dup = big + xh2;
    w.slots = big + 3 * xh2;
    w.total = big + std::max(3 * xh13, 3 * xh2 + slots);
  }
  return w;
}

int moe_k_splits(int pairs, long long blocks, int sms, int kb_count) {
  if (pairs > kMoeSplitMaxPairs) return 1;
  // The sweep's best pairs hold up to 9 grid blocks per SM, more than are resident at once: a measured fit
  // (moe_planner.h), not a model. The grid is sized for the worst routing and its spare blocks exit at once, which may be
  // why finer splits still pay; that is not separated.
  int s = 1;
  while (s < kMoeMaxSplits && (s + 1) * kMoeSplitMinKb <= kb_count &&
         blocks * (s + 1) <= static_cast<long long>(kMoeSplitBlocksPerSm) * sms)
    ++s;
  return s;
}

int moe_rows_per_chunk(int pairs, int experts) {
  // Rows per expert on average, if the routing spreads the pairs over as many experts as it can. Small chunks
  // waste no MMA rows at decode; large ones decode each tile once for 64 rows in prefill.
  const int avg = pairs / std::max(1, std::min(experts, pairs));
  return avg <= 8 ? 8 : avg <= 32 ? 16 : 64;
}

namespace {

// A bench's split count (env.h VLLM_EXL3_MOE_SPLITS13/2) where split slots exist (moe_reserve_bytes), within the K
// range's 128-blocks; otherwise the rule's.
int forced_or(int forced, int pairs, int kb_count, int chosen) {
  if (forced <= 0 || pairs > kMoeSplitMaxPairs) return chosen;
  return std::min({forced, kMoeMaxSplits, kb_count});
}

}  // namespace

MoeChunkPlan moe_chunk_plan(int pairs, int experts, int hidden_padded, int inter_padded, int sms) {
  MoeChunkPlan p{};
  p.rows_per_chunk = moe_rows_per_chunk(pairs, experts);
  p.chunk_bound = moe_chunk_bound(pairs, experts, p.rows_per_chunk);
  // Grid blocks: one per (chunk, 128-column group, projection); gate and up are two projections of N = I (kb2
  // groups), down one of N = H (kb13 groups). K is the other dimension.
  const int kb13 = hidden_padded / kHadBlock, kb2 = inter_padded / kHadBlock;
  p.splits13 = forced_or(env::moe_splits13(), pairs, kb13,
                         moe_k_splits(pairs, 2LL * p.chunk_bound * kb2, sms, kb13));
  p.splits2 = forced_or(env::moe_splits2(), pairs, kb2,
                        moe_k_splits(pairs, 1LL * p.chunk_bound * kb13, sms, kb2));
  return p;
}

size_t moe_reserve_bytes(int tokens, int top_k, int experts, int hidden_padded, int inter_padded) {
  // Rows per chunk 8 gives the most chunks, hence the largest routing table; split slots exist only up to
  // kMoeSplitMaxPairs pairs.
  const int tc = std::min(tokens, kMoeChunkTokens);
  const int split_tokens = std::max(1, std::min(tc, kMoeSplitMaxPairs / top_k));
  const size_t whole = moe_workspace_layout(tc, top_k, experts, hidden_padded, inter_padded, 8, 1, 1).total;
  const size_t split = moe_workspace_layout(split_tokens, top_k, experts, hidden_padded, inter_padded, 8,
                                            kMoeMaxSplits, kMoeMaxSplits).total;
  return std::max(whole, split);
}

}  // namespace exl3

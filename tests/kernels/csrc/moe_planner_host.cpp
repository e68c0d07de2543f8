// Runs csrc/moe_planner.cpp on the CPU: tests/kernels/csrc/test_csrc_build.py feeds it layer shapes.
//
// stdin, one case per line: tokens top_k experts hidden_padded inter_padded sms
// stdout, one line per case, for the call's first token chunk (at most kMoeChunkTokens tokens, as moe_bindings.cpp
// cuts it): rows_per_chunk chunk_bound splits13 splits2, then the workspace bytes of that plan's layout, of the same
// chunk with the most splits a bench may force (or 0 past kMoeSplitMaxPairs pairs), and the bytes
// moe_reserve_bytes reserves for calls of that many tokens
#include <cstdio>

#include "moe_planner.h"

int main() {
  int tokens, top_k, experts, hp, ip, sms;
  while (std::scanf("%d %d %d %d %d %d", &tokens, &top_k, &experts, &hp, &ip, &sms) == 6) {
    const int tc = tokens < exl3::kMoeChunkTokens ? tokens : exl3::kMoeChunkTokens;
    const int pairs = tc * top_k;
    const exl3::MoeChunkPlan p = exl3::moe_chunk_plan(pairs, experts, hp, ip, sms);
    const size_t planned =
        exl3::moe_workspace_layout(tc, top_k, experts, hp, ip, p.rows_per_chunk, p.splits13, p.splits2).total;
    const size_t forced = pairs > exl3::kMoeSplitMaxPairs
                              ? 0
                              : exl3::moe_workspace_layout(tc, top_k, experts, hp, ip, p.rows_per_chunk,
                                                           exl3::kMoeMaxSplits, exl3::kMoeMaxSplits)
                                    .total;
    std::printf("%d %d %d %d %zu %zu %zu\n", p.rows_per_chunk, p.chunk_bound, p.splits13, p.splits2, planned, forced,
                exl3::moe_reserve_bytes(tokens, top_k, experts, hp, ip));
  }
  return 0;
}

// Every environment variable the kernels read, read here and nowhere else (each one is a row of
// plugin/vllm_exl3/base/settings.py, which says what it does; docs/settings.md is generated from that table).
//
// All are read per call, not once: the benchmarks (bench/kernels.py --variants, bench/moe.py --splits) and the GPU
// tests toggle them between calls in one process. None changes a result except by choosing another kernel path;
// unset, each takes the default written here (or the planner's, for the -1 "not set" overrides).
#pragma once

#include <cstdint>
#include <cstdlib>

namespace exl3 {
namespace env {

inline int64_t get_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

// --- Path overrides (planner.cpp): rows up to which / from which a path runs; `fallback` is the planner's default.
inline int64_t skinny_max_rows(int64_t fallback) { return get_int("VLLM_EXL3_SKINNY_MAX_ROWS", fallback); }
inline int64_t panel_max_rows(int64_t fallback) { return get_int("VLLM_EXL3_PANEL_MAX_ROWS", fallback); }
inline int64_t original_min_rows(int64_t fallback) { return get_int("VLLM_EXL3_ORIGINAL_MIN_ROWS", fallback); }

// --- A/B switches: 0 turns a measured improvement off for a comparison.
inline bool pdl() { return get_int("VLLM_EXL3_PDL", 1) != 0; }  // programmatic dependent launch (dense and MoE)
inline bool skinny_dup() { return get_int("VLLM_EXL3_SKINNY_DUP", 1) != 0; }  // duplicated-activation codewords
inline bool recon_first() { return get_int("VLLM_EXL3_RECON_FIRST", 1) != 0; }  // reconstruct before transform

// --- Bench-only diagnostics (bench/kernels.py): no serving configuration sets these.
inline int skinny_grid() { return static_cast<int>(get_int("VLLM_EXL3_SKINNY_GRID", 0)); }  // 0: the planner's
// The MoE GEMMs' K splits at decode sizes (bench/moe.py --splits; moe_planner.cpp): 0 takes moe_k_splits' choice.
inline int moe_splits13() { return static_cast<int>(get_int("VLLM_EXL3_MOE_SPLITS13", 0)); }
inline int moe_splits2() { return static_cast<int>(get_int("VLLM_EXL3_MOE_SPLITS2", 0)); }

}  // namespace env
}  // namespace exl3

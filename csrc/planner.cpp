// plan_linear_path: the skinny kernel up to `skinny_rows` rows, the panel kernel up to `panel_rows`, reconstruct +
// cuBLAS above, and W in the original basis from a quarter as many rows as active output columns.
//
// Why these numbers (the measurements: bench/NOTES.md, "Path crossovers"):
// * H200, W' larger than L2 (4096x14336: 117 MB): 16 and 64 rows, the measured crossovers.
// * H200, W' in L2 (4096x4096 and smaller): the GEMM reads W' back from L2, so reconstruct + cuBLAS wins from 16-28
//   rows on and the panel kernel beats the skinny one at 16 rows: 8 and 16.
// * sm_12x (DGX Spark, 273 GB/s): reconstruct + cuBLAS writes and re-reads fp16 W' through a ~17x slower memory
//   while the panels' decode slows ~2x, so panels win far longer: 256 is a bandwidth estimate, not a measurement.
// * Original basis: pays off once the input transform's rows x K values outweigh that reconstruct's extra work over
//   the output-side one, which grows with K x N; a quarter of the active output columns is where it did on H200.
// VLLM_EXL3_SKINNY_MAX_ROWS, VLLM_EXL3_PANEL_MAX_ROWS and VLLM_EXL3_ORIGINAL_MIN_ROWS override all of these.
#include "planner.h"

#include "env.h"

namespace exl3 {
namespace {

//                           major  l2_reuse  skinny panel  skinny_l2 panel_l2
constexpr ArchLimits kArchLimits[] = {
    {12, false, 16, 256, 16, 256},  // sm_12x (DGX Spark)
    {0, true, 16, 64, 8, 16},       // everything else (measured on sm_90, H200)
};

}  // namespace

const ArchLimits& arch_limits(int arch_major) {
  for (const ArchLimits& a : kArchLimits)
    if (a.major == arch_major) return a;
  return kArchLimits[sizeof(kArchLimits) / sizeof(kArchLimits[0]) - 1];
}

Path plan_linear_path(const LinearShape& s, const std::function<bool(bool panel)>& fits) {
  const ArchLimits& a = arch_limits(s.arch_major);
  const bool in_l2 = a.l2_reuse && s.w_prime_bytes <= s.l2_bytes;
  const int64_t skinny_rows = env::skinny_max_rows(in_l2 ? a.skinny_rows_l2 : a.skinny_rows);
  const int64_t panel_rows = env::panel_max_rows(in_l2 ? a.panel_rows_l2 : a.panel_rows);
  if (s.rows <= skinny_rows && fits(false)) return kSkinny;
  if (s.rows <= panel_rows && fits(true)) return kPanel;
  if (s.rows >= env::original_min_rows(s.active_cols / 4)) return kReconOriginal;
  return kReconstruct;
}

}  // namespace exl3

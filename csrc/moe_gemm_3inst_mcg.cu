// Grouped MoE GEMM instantiations for the 3inst and mcg codebooks (integer bit widths; the codebook's multiplier
// and addend are kernel arguments).
#include "moe_gemm.cuh"

namespace exl3 {

MoeGemmKernel moe_gemm_kernel_3inst_mcg(int bits2, int rows) {
  MoeGemmKernel k{nullptr, 0};
  auto pick = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    if constexpr (kB % 2 == 0) {
      auto with_rows = [&](auto r) { k = moe_gemm_kernel_ref<kB, false, decltype(r)::value>(); };
      EXL3_MOE_DISPATCH_ROWS(rows, with_rows)
    }
  };
  EXL3_DISPATCH_BITS2(bits2, pick)
  return k;
}

}  // namespace exl3

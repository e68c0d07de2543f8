// Panel GEMM instantiations: every codebook and width (3inst/mcg share kernels: their codebook is a runtime
// multiplier/addend pair; half-integer widths are mul1 only).
#include "panel.cuh"

namespace exl3 {

GemmKernel panel_kernel_for(int codebook, int bits2) {
  GemmKernel k{nullptr, 0};
  auto pick = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    if (codebook == kCbMul1) k = panel_kernel_ref<kB, true>();
    else if constexpr (kB % 2 == 0) k = panel_kernel_ref<kB, false>();
  };
  EXL3_DISPATCH_BITS2(bits2, pick)
  return k;
}

}  // namespace exl3

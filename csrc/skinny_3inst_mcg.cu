// Skinny GEMM instantiations for the 3inst and mcg codebooks (integer bit widths; the codebook is a runtime
// multiplier/addend pair, so both share one set of kernels).
#include "skinny.cuh"

namespace exl3 {

GemmKernel skinny_kernel_3inst_mcg(int bits2, int mt, bool dup) {
  GemmKernel k{nullptr, 0};
  auto pick = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    if constexpr (kB % 2 == 0) {
      if (mt == 1) k = dup ? skinny_kernel_ref<kB, false, 1, true>() : skinny_kernel_ref<kB, false, 1, false>();
      else if (mt == 2) k = dup ? skinny_kernel_ref<kB, false, 2, true>() : skinny_kernel_ref<kB, false, 2, false>();
    }
  };
  EXL3_DISPATCH_BITS2(bits2, pick)
  return k;
}

GemmKernel skinny_group_kernel_3inst_mcg(int bits2, int mt) {
  GemmKernel k{nullptr, 0};
  auto pick = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    if constexpr (kB % 2 == 0) {
      if (mt == 1) k = skinny_group_kernel_ref<kB, false, 1, true>();
    }
  };
  EXL3_DISPATCH_BITS2(bits2, pick)
  return k;
}

}  // namespace exl3

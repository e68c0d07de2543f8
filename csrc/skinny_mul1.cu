// Skinny GEMM instantiations for the mul1 codebook (integer and half-integer bit widths).
#include "skinny.cuh"

namespace exl3 {

GemmKernel skinny_kernel_mul1(int bits2, int mt, bool dup) {
  GemmKernel k{nullptr, 0};
  auto pick = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    if (mt == 1) k = dup ? skinny_kernel_ref<kB, true, 1, true>() : skinny_kernel_ref<kB, true, 1, false>();
    else if (mt == 2) k = dup ? skinny_kernel_ref<kB, true, 2, true>() : skinny_kernel_ref<kB, true, 2, false>();
  };
  EXL3_DISPATCH_BITS2(bits2, pick)
  return k;
}

GemmKernel skinny_group_kernel_mul1(int bits2, int mt) {
  GemmKernel k{nullptr, 0};
  auto pick = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    {
      if (mt == 1) k = skinny_group_kernel_ref<kB, true, 1, true>();
    }
  };
  EXL3_DISPATCH_BITS2(bits2, pick)
  return k;
}

}  // namespace exl3

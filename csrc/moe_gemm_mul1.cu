// Grouped MoE GEMM instantiations for the mul1 codebook (integer and half-integer bit widths).
#include "moe_gemm.cuh"

namespace exl3 {

MoeGemmKernel moe_gemm_kernel_mul1(int bits2, int rows) {
  MoeGemmKernel k{nullptr, 0};
  auto pick = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    auto with_rows = [&](auto r) { k = moe_gemm_kernel_ref<kB, true, decltype(r)::value>(); };
    EXL3_MOE_DISPATCH_ROWS(rows, with_rows)
  };
  EXL3_DISPATCH_BITS2(bits2, pick)
  return k;
}

}  // namespace exl3

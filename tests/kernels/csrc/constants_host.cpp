// Prints the kernels' format constants (csrc/exl3_decode.cuh, csrc/exl3_kernels.h' codebook indices) as
// "name value" lines: tests/kernels/csrc/test_csrc_build.py compares them with format/constants.py's table.
#include <cstdio>

#include "exl3_decode.cuh"
#include "exl3_kernels.h"

#define EXL3_PRINT_INT(name) std::printf("%s %lld\n", #name, static_cast<long long>(exl3::name))
#define EXL3_PRINT_FLOAT(name) std::printf("%s %.17g\n", #name, static_cast<double>(exl3::name))

int main() {
  EXL3_PRINT_INT(kTile);
  EXL3_PRINT_INT(kHadBlock);
  EXL3_PRINT_INT(kStateBits);
  EXL3_PRINT_INT(k3InstMul);
  EXL3_PRINT_INT(k3InstAdd);
  EXL3_PRINT_INT(kMcgMul);
  EXL3_PRINT_INT(kMul1Mul);
  EXL3_PRINT_INT(kHalfPairMask);
  EXL3_PRINT_INT(kHalfPairXor);
  EXL3_PRINT_INT(kMul1Base);
  EXL3_PRINT_FLOAT(kMul1InvScale);
  EXL3_PRINT_FLOAT(kMul1Bias);
  EXL3_PRINT_INT(kCb3Inst);
  EXL3_PRINT_INT(kCbMcg);
  EXL3_PRINT_INT(kCbMul1);
  // what the decoder really uses per codebook index
  for (int cb = 0; cb < 3; ++cb)
    std::printf("codebook_mul(%d) %u\ncodebook_add(%d) %u\n", cb, exl3::codebook_mul(cb), cb, exl3::codebook_add(cb));
  return 0;
}

// Which kernel path a dense EXL3 linear takes: the policy, apart from the torch glue (bindings.cpp) that carries it
// out. Plain C++: no torch, no CUDA.
#pragma once

#include <cstdint>
#include <functional>

namespace exl3 {

// The `path` argument of vllm_exl3::native_linear. plugin/vllm_exl3/kernels/backends/native.py's NativePath is the
// one Python mirror (tests/kernels/test_native_path.py parses this enum and compares names and values).
enum Path : int64_t {
  kAuto = 0,           // plan_linear_path decides
  kSkinny = 1,         // skinny tensor-core kernel, its own split-K choice
  kReconstruct = 2,    // W' = Ŵ H diag(svh) + input transform, one cuBLAS GEMM
  kSkinnySplit = 3,    // skinny, split-K forced (bench)
  kSkinnyDirect = 4,   // skinny, no split-K (bench)
  kSkinnyPlain = 5,    // skinny with rounded Ŵ pairs instead of codewords (bench)
  kPanel = 6,          // panel kernel (64-row chunks)
  kReconOriginal = 7,  // W in the original basis, x . W straight from cuBLAS (no input transform)
};

// Per architecture: the row counts up to which `auto` takes the skinny and the panel kernel, one pair for a layer
// whose fp16 W' is larger than the L2 and one for a layer whose W' fits (only where the GEMM re-reads it from there).
struct ArchLimits {
  int major;  // compute capability major; 0: every architecture without a row of its own
  bool l2_reuse;
  int64_t skinny_rows, panel_rows;        // W' larger than L2 (or no L2 reuse)
  int64_t skinny_rows_l2, panel_rows_l2;  // W' fits in L2
};

struct LinearShape {
  int64_t rows;           // rows of x
  int64_t w_prime_bytes;  // fp16 W' of the active part (active k-blocks x active column groups)
  int64_t active_cols;    // active output columns, rounded out to whole 128-column groups
  int arch_major;
  int64_t l2_bytes;
};

const ArchLimits& arch_limits(int arch_major);

// `auto`'s choice. `fits(panel)` says whether that GEMM kernel can run on the current device for this layer's
// codebook and bit width; it is asked only about a kernel the row count would take.
Path plan_linear_path(const LinearShape& s, const std::function<bool(bool panel)>& fits);

}  // namespace exl3

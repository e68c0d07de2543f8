// What the two torch binding files (bindings.cpp: dense ops, moe_bindings.cpp: routed experts) share: the CUDA
// error check that turns a failed launch into a Python exception, the PDL switch, and the format's geometry as the
// int64_t the torch side computes in. Format constants come from exl3_decode.cuh only; this header only re-types them.
#pragma once

#include <cstdint>

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "env.h"
#include "exl3_decode.cuh"

namespace exl3 {
namespace glue {

constexpr int64_t kHad = kHadBlock;  // every stored dim is padded to it
constexpr int64_t kTile = exl3::kTile;

inline void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "vllm_exl3: ", what, " failed: ", cudaGetErrorString(err));
}

// Programmatic dependent launch on or off (env.h VLLM_EXL3_PDL), read per call: the bench toggles it.
inline bool use_pdl() { return env::pdl(); }

}  // namespace glue
}  // namespace exl3

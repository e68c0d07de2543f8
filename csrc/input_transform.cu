// The input Hadamard transform, every path's first step: xh = H(x * suh) per 128-block (and mul1's row sums).
#include <algorithm>

#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"

namespace exl3 {

// ------------------------------------------------------------------------------------------------------------
// xh = H(x * suh) per 128-block, fp32 math, one rounding to fp16 (docs/format.md §3.3) or bf16; per-row partial sums
// of the rounded fp16 xh (mul1's affine epilogue needs sum_k xh exactly as the tensor cores saw it).
// A half-warp owns one 128-block of one row, 8 consecutive values per lane: one 16-byte load and store per lane
// (twice the bytes in flight of 8-byte lanes, with which the kernel was latency-bound; bench/NOTES.md, "Kernel
// design measurements"), 3 butterfly stages in registers and 4 across lanes. A block is one row x kItBlocks 128-blocks.
// ------------------------------------------------------------------------------------------------------------
// Eight fp32 values as one 16-byte word of T.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  T* t = nullptr;
  return make_uint4(to_act2(v[0], v[1], t), to_act2(v[2], v[3], t), to_act2(v[4], v[5], t), to_act2(v[6], v[7], t));
}

constexpr int kItWarps = 4;
constexpr int kItThreads = kItWarps * kWarp;
constexpr int kItBlocks = 2 * kItWarps;  // 128-blocks per CUDA block (= per rowsum part)

// Grouped form (launch_input_transform_group): the suh of each shard; blockIdx.z is the shard.
struct ItShards {
  const void* suh[kMaxGroupShards];
};
template <typename S>
__device__ __forceinline__ const S& it_shards(const S& s) {
  return s;
}

// Shards: empty for one linear (the kernel as it always was: the grouped code is `if constexpr` and drops out), or
// ItShards for several linears of one input (a variadic pack rather than a flag keeps the one-linear kernel's
// parameters and code as they were).
template <typename... Shards>
__global__ void __launch_bounds__(kItThreads) input_transform_kernel(const InputTransformArgs a, const Shards... sh) {
  static_assert(sizeof...(Shards) <= 1, "at most one shard table");
  constexpr bool kGrouped = sizeof...(Shards) == 1;
  griddep_launch_dependents();  // the next kernel (GEMM or reconstruct) may start now; it waits for our results
  __shared__ float part[kItWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int sub = lane % 16;  // lane within the half-warp: values 8 sub .. 8 sub + 7 of its 128-block
  const int row = blockIdx.x;
  const int kb = blockIdx.y * kItBlocks + 2 * warp + lane / 16;

  if constexpr (kGrouped) {
    if (a.zero && blockIdx.z == 0) {  // the shards share one workspace: cleared once
      const size_t n = a.zero_bytes / sizeof(uint4);
      const size_t stride = static_cast<size_t>(gridDim.x) * gridDim.y * kItThreads;
      for (size_t i = (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kItThreads + threadIdx.x; i < n;
           i += stride)
        static_cast<uint4*>(a.zero)[i] = make_uint4(0, 0, 0, 0);
    }
  } else
  if (a.zero) {  // the next kernel's split-K workspace
    const size_t n = a.zero_bytes / sizeof(uint4);
    const size_t stride = static_cast<size_t>(gridDim.x) * gridDim.y * kItThreads;
    for (size_t i = (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kItThreads + threadIdx.x; i < n;
         i += stride)
      static_cast<uint4*>(a.zero)[i] = make_uint4(0, 0, 0, 0);
  }

  // Not warp-uniform (an odd kb_count leaves the last half-warp idle): the idle half still joins the shuffles.
  const bool active = kb < a.kb_count;
  const int k = (a.kb0 + kb) * kHadBlock + 8 * sub;
  float v[8] = {};
  if (active && row < a.rows) {
    const int xi = k - a.in_offset;
    const long long i = static_cast<long long>(row) * a.x_stride + xi;
    const char* src = static_cast<const char*>(a.x) + i * 2;
    if (xi >= 0 && xi + 8 <= a.in_width && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      load_act8(a.x, i, a.x_dtype, v);
    } else {  // input edges and unaligned rows
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = xi + e >= 0 && xi + e < a.in_width ? load_act(a.x, i + e, a.x_dtype) : 0.f;
    }
    if constexpr (kGrouped) {  // this shard's suh, by selects (a run-time index into the parameters: local memory)
      const ItShards& tab = it_shards(sh...);
      const void* suh = tab.suh[0];
#pragma unroll
      for (int i = 1; i < kMaxGroupShards; ++i)
        if (blockIdx.z == i) suh = tab.suh[i];
      mul_half8(v, static_cast<const __half*>(suh) + k);
    } else
    mul_half8(v, static_cast<const __half*>(a.suh) + k);
  }
  fwht128_halfwarp(v, lane);
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    v[e] *= a.scale;
    if (a.rowsum_parts) sum += __half2float(__float2half_rn(v[e]));  // kernel-uniform; fp16 xh only
  }
  if constexpr (kGrouped) {  // this shard's xh: launch_input_transform_group's layout
    if (active)
      *reinterpret_cast<uint4*>(static_cast<char*>(a.xh) +
                                ((static_cast<long long>(blockIdx.z) * gridDim.x + row) * a.kb_count * kHadBlock +
                                 kb * kHadBlock + 8 * sub) * 2) =
          a.xh_dtype == kActBF16 ? pack8<__nv_bfloat16>(v) : pack8<__half>(v);
  } else
  if (active)  // padding rows (row >= rows) were never loaded: zeros
    *reinterpret_cast<uint4*>(static_cast<char*>(a.xh) +
                              (static_cast<long long>(row) * a.kb_count * kHadBlock + kb * kHadBlock + 8 * sub) * 2) =
        a.xh_dtype == kActBF16 ? pack8<__nv_bfloat16>(v) : pack8<__half>(v);
  if (a.rowsum_parts) {  // kernel-uniform
    sum = warp_sum(sum);
    if (lane == 0) part[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0 && row < a.rows) {
      float s = 0.f;
      for (int w = 0; w < kItWarps; ++w) s += part[w];
      if constexpr (kGrouped)  // this shard's parts
        a.rowsum_parts[(static_cast<long long>(blockIdx.z) * a.rows + row) * gridDim.y + blockIdx.y] = s;
      else
      a.rowsum_parts[static_cast<long long>(row) * gridDim.y + blockIdx.y] = s;
    }
  }
  // Launched behind the reconstruct (launch_input_transform with pdl), this grid must not complete before it: the
  // GEMM that follows in the stream reads both. One waiting block is enough to hold the grid open; the others leave
  // and free their SMs. (Launched first, there is nothing to wait for.)
  if constexpr (kGrouped) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) griddep_wait();
  } else
  if (blockIdx.x == 0 && blockIdx.y == 0) griddep_wait();
}

int input_transform_parts(int kb_count) { return (kb_count + kItBlocks - 1) / kItBlocks; }

cudaError_t launch_input_transform(const InputTransformArgs& a, bool pdl, cudaStream_t stream) {
  if (a.xh_rows <= 0 || a.kb_count <= 0) return cudaSuccess;
  void* args[] = {const_cast<InputTransformArgs*>(&a)};
  return launch_kernel(reinterpret_cast<const void*>(&input_transform_kernel<>),
                       dim3(a.xh_rows, input_transform_parts(a.kb_count)), dim3(kItThreads), 0, pdl, stream, args);
}

cudaError_t launch_input_transform_group(const InputTransformArgs& a, const void* const* suh, int shards, bool pdl,
                                         cudaStream_t stream) {
  if (shards < 1 || shards > kMaxGroupShards) return cudaErrorInvalidValue;
  if (a.xh_rows <= 0 || a.kb_count <= 0) return cudaSuccess;
  ItShards sh{};
  for (int i = 0; i < kMaxGroupShards; ++i) sh.suh[i] = suh[i < shards ? i : 0];
  void* args[] = {const_cast<InputTransformArgs*>(&a), &sh};
  return launch_kernel(reinterpret_cast<const void*>(&input_transform_kernel<ItShards>),
                       dim3(a.xh_rows, input_transform_parts(a.kb_count), shards), dim3(kItThreads), 0, pdl, stream,
                       args);
}

}  // namespace exl3

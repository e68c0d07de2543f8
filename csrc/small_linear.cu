// The 16-bit small-M linear of exl3_kernels.h (launch_small_linear): a MoE router's gate at decode sizes. The weight
// row of each output column is read once, by one warp, eight 16-byte loads a lane in flight before any is used (a
// Qwen3-30B-A3B router row is 4 KB: one round of memory latency); the activation rows are small and shared by every
// warp, so they come through L1. Each lane sums its slice in k order, then the warp adds the lanes' sums by a
// butterfly, which leaves the same bits on every lane and in every run.
#include <type_traits>

#include "exl3_device.cuh"
#include "exl3_kernels.h"

namespace exl3 {
namespace {

constexpr int kSlWarps = 4;  // output columns per block
constexpr int kSlUnroll = 8;  // 16-byte weight loads in flight per lane

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float2 p;
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
    else
      p = __half22float2(*reinterpret_cast<const __half2*>(&w[e]));
    f[2 * e] = p.x, f[2 * e + 1] = p.y;
  }
}

template <int kRows, typename T>
__global__ void __launch_bounds__(kSlWarps * kWarp) small_linear_kernel(const SmallLinearArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int col = blockIdx.x * kSlWarps + threadIdx.x / kWarp;
  if (col >= a.n) return;  // warp-uniform
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const T*>(a.w) + static_cast<long long>(col) * a.k);
  const T* x = static_cast<const T*>(a.x);
  const int chunks = a.k / 8;
  float acc[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m) acc[m] = 0.f;
  for (int c0 = lane; c0 < chunks; c0 += kWarp * kSlUnroll) {
    uint4 wv[kSlUnroll];
#pragma unroll
    for (int u = 0; u < kSlUnroll; ++u) {
      const int c = c0 + u * kWarp;
      wv[u] = c < chunks ? __ldg(w + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kSlUnroll; ++u) {
      const int c = c0 + u * kWarp;
      if (c >= chunks) break;
      float wf[8];
      unpack8<T>(wv[u], wf);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m >= a.rows) break;
        float xf[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(x + m * a.x_stride + 8 * c), xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m] = fmaf(xf[e], wf[e], acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kRows; ++m)
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xFFFFFFFFu, acc[m], off);
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (m >= a.rows) break;
    if (lane == m % kWarp) {
      const long long i = static_cast<long long>(m) * a.n + col;
      if (a.y_fp32) static_cast<float*>(a.y)[i] = acc[m];
      else to_act(acc[m], static_cast<T*>(a.y) + i);
    }
  }
}

template <typename T>
cudaError_t launch_typed(const SmallLinearArgs& a, cudaStream_t stream) {
  void* args[] = {const_cast<SmallLinearArgs*>(&a)};
  const dim3 grid((a.n + kSlWarps - 1) / kSlWarps), block(kSlWarps * kWarp);
  const void* fn = a.rows <= 1   ? reinterpret_cast<const void*>(&small_linear_kernel<1, T>)
                   : a.rows <= 2 ? reinterpret_cast<const void*>(&small_linear_kernel<2, T>)
                   : a.rows <= 4 ? reinterpret_cast<const void*>(&small_linear_kernel<4, T>)
                   : a.rows <= 8 ? reinterpret_cast<const void*>(&small_linear_kernel<8, T>)
                                 : reinterpret_cast<const void*>(&small_linear_kernel<kSmallLinearMaxRows, T>);
  return launch_kernel(fn, grid, block, 0, false, stream, args);
}

}  // namespace

cudaError_t launch_small_linear(const SmallLinearArgs& a, cudaStream_t stream) {
  if (a.rows < 1 || a.rows > kSmallLinearMaxRows || a.n < 1 || a.k < 8 || a.k % 8 != 0) return cudaErrorInvalidValue;
  return a.dtype == kActBF16 ? launch_typed<__nv_bfloat16>(a, stream) : launch_typed<__half>(a, stream);
}

}  // namespace exl3

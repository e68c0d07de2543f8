// Device building blocks shared by the EXL3 kernels: tensor-core MMA, async copies, the 128-point Hadamard in a
// warp, activation loads/stores, dependent-launch control. No format knowledge lives here (see exl3_decode.cuh).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3_kernels.h"

namespace exl3 {

constexpr int kWarp = 32;

// D += A(16x16, row) * B(16x8, col), fp16 inputs, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16-byte global->shared copy that bypasses L1 (weights are read once); `smem` is a shared-window address
// (__cvta_generic_to_shared), which callers compute once per lane.
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

__device__ __forceinline__ uint32_t lds32(const void* smem) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))));
  return v;
}

// Four 8x8 b16 matrices from shared memory (`smem`: a shared-window address): lane l gives the address of row l % 8
// of matrix l / 8 and receives, in register m, row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix m.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}

// Programmatic dependent launch (sm_90+): let the next kernel start early / wait for the previous one's results.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Host side: launches fn (arguments `args`), with programmatic dependent launch when `pdl`: the kernel may then start
// before the previous one in the stream has finished, and must griddep_wait before it reads that kernel's results.
inline cudaError_t launch_kernel(const void* fn, dim3 grid, dim3 block, size_t smem, bool pdl, cudaStream_t stream,
                                 void** args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelExC(&cfg, fn, args);
}

// Natural-order (Sylvester) 128-point FWHT across a warp, unnormalized: lane L holds elements 4L .. 4L+3.
// Two butterfly stages in registers, five across lanes.
__device__ __forceinline__ void fwht128_warp(float (&v)[4], int lane) {
  float a = v[0] + v[1], b = v[0] - v[1], c = v[2] + v[3], d = v[2] - v[3];
  v[0] = a + c; v[1] = b + d; v[2] = a - c; v[3] = b - d;
#pragma unroll
  for (int m = 1; m < kWarp; m <<= 1) {
    const bool upper = lane & m;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = __shfl_xor_sync(0xFFFFFFFFu, v[e], m);
      v[e] = upper ? p - v[e] : v[e] + p;
    }
  }
}

// Natural-order (Sylvester) 128-point FWHT across a half-warp, unnormalized: lane L holds elements 8 (L % 16) ..
// +7. Index bits 0-2 in registers, bits 3-6 across the half-warp (both halves of the warp must call it).
__device__ __forceinline__ void fwht128_halfwarp(float (&v)[8], int lane) {
#pragma unroll
  for (int m = 1; m < 8; m <<= 1)
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (!(e & m)) {
        const float lo = v[e], hi = v[e | m];
        v[e] = lo + hi, v[e | m] = lo - hi;
      }
#pragma unroll
  for (int m = 1; m < 16; m <<= 1) {
    const bool upper = lane & m;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float q = __shfl_xor_sync(0xFFFFFFFFu, v[e], m);
      v[e] = upper ? q - v[e] : v[e] + q;
    }
  }
}

// v[e] *= s[e] for eight fp16 factors at s (16-byte aligned): the sign/scale vectors suh and svh.
__device__ __forceinline__ void mul_half8(float (&v)[8], const __half* s) {
  const uint4 u = *reinterpret_cast<const uint4*>(s);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[e]));
    v[2 * e] *= f.x, v[2 * e + 1] *= f.y;
  }
}

// Activations are fp16 or bf16 (exl3::ActDtype); math is fp32.

// Eight activations base[i .. i+7] (16-byte aligned) as fp32.
__device__ __forceinline__ void load_act8(const void* base, long long i, int dtype, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const char*>(base) + i * 2);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = dtype == kActBF16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]))
                                       : __half22float2(*reinterpret_cast<const __half2*>(&w[e]));
    v[2 * e] = f.x, v[2 * e + 1] = f.y;
  }
}

__device__ __forceinline__ float load_act(const void* base, long long i, int dtype) {
  if (dtype == kActBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return __half2float(static_cast<const __half*>(base)[i]);
}

// fp32 -> activation type, one value or a pair.
__device__ __forceinline__ void to_act(float v, __half* p) { *p = __float2half_rn(v); }
__device__ __forceinline__ void to_act(float v, __nv_bfloat16* p) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ uint32_t to_act2(float a, float b, __half*) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t to_act2(float a, float b, __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4], bool aligned, int valid_lo, int valid_hi) {
  if (aligned && valid_lo == 0 && valid_hi == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(to_act2(v[0], v[1], p), to_act2(v[2], v[3], p));
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e >= valid_lo && e < valid_hi) to_act(v[e], p + e);
  }
}

// Store outputs valid_lo .. valid_hi-1 of four consecutive ones at base[i..i+3] (one 8-byte store when `aligned`).
__device__ __forceinline__ void store_act4(void* base, long long i, const float (&v)[4], int dtype, bool aligned,
                                           int valid_lo, int valid_hi) {
  if (dtype == kActBF16) store4(static_cast<__nv_bfloat16*>(base) + i, v, aligned, valid_lo, valid_hi);
  else store4(static_cast<__half*>(base) + i, v, aligned, valid_lo, valid_hi);
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// The same value, through an identity shuffle: ptxas keeps it in a register instead of rematerializing the
// arithmetic that produced it (it does that for values derived from the thread index, even inside hot loops).
template <typename T>
__device__ __forceinline__ T pin(T v) {
  return static_cast<T>(__shfl_sync(0xFFFFFFFFu, static_cast<int>(v), threadIdx.x % kWarp));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, m);
  return v;
}

}  // namespace exl3

// Stream-K work split shared by the GEMM kernels (skinny.cuh, panel.cuh) and their host planner: which block
// owns which units (row chunk, 128-column group, k-tile; k-tile fastest), and the end of a segment (a block's run of
// units in one column group): split-K partial sums in fixed order, then the output Hadamard and svh.
#pragma once

#include <climits>

#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"

namespace exl3 {

constexpr int kGemmThreads = kGemmWarps * kWarp;

// Host side of one kernel instantiation: kernel pointer and dynamic shared memory.
struct GemmKernel {
  const void* fn;
  int smem;
};

// Stream-K bookkeeping shared by kernel and host: unit u (row chunk, column group, k-tile; k-tile fastest) lives in
// block floor(u * grid / units) .. ; block b starts at floor(b * units / grid).
__host__ __device__ inline int block_of_unit(long long u, long long units, long long grid) {
  return static_cast<int>(((u + 1) * grid + units - 1) / units - 1);
}
// floor(a * b / c) for a * b < 2^53: in double precision (the correctly rounded quotient of two exact integers
// cannot cross an integer here, since c < 2^31), far cheaper on the device than a 64-bit integer division.
__host__ __device__ __forceinline__ int floor_muldiv(int a, int b, int c) {
  return static_cast<int>(floor(static_cast<double>(a) * b / c));
}
// block_of_unit without the 64-bit integer division: ceil(n / units) - 1 = floor(n / units) - (units divides n).
__host__ __device__ __forceinline__ int block_of_unit_dev(int u, int units, int grid) {
  const long long n = static_cast<long long>(u + 1) * grid;
  const int q = floor_muldiv(u + 1, grid, units);
  return q - (static_cast<long long>(q) * units == n);
}

// The end of a segment [seg, seg_end) of this block, once its sums z (before the affine step and the output
// transform) for the row chunk's valid rows are complete in buf [kRows][kBufStride] (fp32). A block that holds only
// part of the column group parks them in its own slot of a.partials; the block that completes the group (counter)
// adds the slots in slot order (deterministic: no float atomics) and writes y = H(z) * svh. Block-wide: every
// thread of the block calls it. kAffine: mul1 codewords, z = inv_scale * acc + bias * sum_k(xh) first.
// rg_seg: the segment's (row chunk, group) index; group: its column group; row0: the chunk's first row. The caller
// passes these, kta, warp and lane in: recomputing them here changed the skinny kernels' register allocation and
// slowed mcg (bench/NOTES.md, "Kernel design measurements").
// Split-K hand-over: the counter add is a release (the barrier before it orders the whole block's partial stores
// under thread 0's release) and an acquire (with the barrier after it, the last block's loads see every block's
// partials): the semaphore pattern of the PTX memory model, one thread's fence instead of every thread's. The
// trace put this chain at the end of every split column group: the kernel's tail. EXL3_SPLITK_SC_FENCE=1 adds the
// all-thread sequentially consistent fences of the earlier version (bench comparison).
#ifndef EXL3_SPLITK_SC_FENCE
#define EXL3_SPLITK_SC_FENCE 0
#endif
__device__ __forceinline__ int count_units(int* counter, int n) {
  int old;
#if EXL3_SPLITK_SC_FENCE
  old = atomicAdd(counter, n);
#else
  asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(counter), "r"(n) : "memory");
#endif
  return old;
}

template <int kRows, int kBufStride, bool kAffine>
__device__ __forceinline__ void finish_segment(const GemmArgs& a, int units, float* buf, int* last_flag, int seg,
                                              int seg_end, int rg_seg, int group, int row0, int valid_rows, int kta,
                                              int warp, int lane) {
  const bool whole = seg == rg_seg * kta && seg_end - seg == kta;
  bool finalize = whole;
  if (!whole) {
    // Split column group: park this block's partial sum in its own slot; the block that completes the group
    // adds the slots in slot order, so the result does not depend on which block finishes last.
    // Blocks of this group: those holding its first and last unit, and every block between (block_of_unit).
    const int first = block_of_unit_dev(rg_seg * kta, units, gridDim.x);
    const int nslots = block_of_unit_dev((rg_seg + 1) * kta - 1, units, gridDim.x) - first + 1;
    float* group_slots = a.partials + static_cast<long long>(rg_seg) * a.max_slots * kRows * kHadBlock;
    float* mine = group_slots + static_cast<long long>(blockIdx.x - first) * kRows * kHadBlock;
    for (int i = threadIdx.x; i < valid_rows * (kHadBlock / 4); i += kGemmThreads) {
      const int r = i / (kHadBlock / 4), q = i % (kHadBlock / 4);
      const float* p = buf + r * kBufStride + 4 * q;
      __stcg(reinterpret_cast<float4*>(mine + r * kHadBlock) + q, make_float4(p[0], p[1], p[2], p[3]));
    }
#if EXL3_SPLITK_SC_FENCE
    __threadfence();
#endif
    __syncthreads();
    if (threadIdx.x == 0) {
      const int done = count_units(a.counters + rg_seg, seg_end - seg) + (seg_end - seg);
      *last_flag = done == kta;
    }
    __syncthreads();
    finalize = *last_flag;
    if (finalize) {
#if EXL3_SPLITK_SC_FENCE
      __threadfence();
#endif
      for (int i = threadIdx.x; i < valid_rows * (kHadBlock / 4); i += kGemmThreads) {
        const int r = i / (kHadBlock / 4), q = i % (kHadBlock / 4);
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k = 0; k < nslots; ++k) {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(group_slots + (k * kRows + r) * kHadBlock) + q);
          sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
        }
        float* p = buf + r * kBufStride + 4 * q;
        p[0] = sum.x, p[1] = sum.y, p[2] = sum.z, p[3] = sum.w;
      }
      __syncthreads();
    }
  }
  if (finalize) {
    // y = H(z) * svh for this group's 128 columns, one warp per row.
    const int n0 = (a.g0 + group) * kHadBlock + 4 * lane;
    float sv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) sv[e] = kHadScale * __half2float(static_cast<const __half*>(a.svh)[n0 + e]);
    const int oc = n0 - a.out_offset;
    const int lo = max(0, -oc), hi = min(4, a.out_features - oc);
    for (int r = warp; r < valid_rows; r += kGemmWarps) {
      const int row = row0 + r;
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = buf[r * kBufStride + 4 * lane + e];
      if constexpr (kAffine) {
        float rs = 0.f;
        for (int p = lane; p < a.parts; p += kWarp) rs += a.rowsum_parts[row * a.parts + p];
        rs = warp_sum(rs) * kMul1Bias;
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = fmaf(v[e], kMul1InvScale, rs);
      }
      fwht128_warp(v, lane);
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] *= sv[e];
      if (lo < hi) {
        const long long o = row * a.y_stride + oc;
        store_act4(a.y, o, v, a.y_dtype, (o & 3) == 0, lo, hi);
      }
    }
  }
}

}  // namespace exl3

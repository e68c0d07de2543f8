// Routed experts, everything but the grouped GEMM (moe_gemm.cuh): routing on the device, the two input
// transforms, the deterministic top-k reduction, the workspace layout and the launchers (moe.h describes the steps).
#include <algorithm>
#include <mutex>
#include <set>
#include <utility>

#include <cub/block/block_scan.cuh>

#include "exl3_device.cuh"
#include "exl3_kernels.h"
#include "moe.h"
#include "moe_gemm.cuh"

namespace exl3 {
namespace {

// ------------------------------------------------------------------------------------------------------------
// Step 1: routing. One block: per-expert counts (shared-memory atomics), two block scans (pair offsets, chunk
// offsets), then the scatter and the chunk table. Pair order inside an expert's list depends on atomic order, which
// changes nothing: every output row is computed on its own (moe_gemm.cuh).
// ------------------------------------------------------------------------------------------------------------
constexpr int kRouteThreads = kMoeMaxExperts;

// The local expert of pair p, or -1 (another rank's expert, or an id out of range).
__device__ __forceinline__ int local_expert(const MoeIds& ids, int p) {
  const long long id =
      ids.ids64 ? static_cast<const long long*>(ids.topk_ids)[p] : static_cast<const int*>(ids.topk_ids)[p];
  int e = -1;
  if (id >= 0 && (ids.expert_map ? id < ids.global_experts : id < ids.experts))
    e = ids.expert_map ? ids.expert_map[id] : static_cast<int>(id);
  return e < ids.experts ? e : -1;  // a map entry past this rank's experts: not local
}

__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const MoeRouteArgs a) {
  using Scan = cub::BlockScan<int, kRouteThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int count[kMoeMaxExperts], cursor[kMoeMaxExperts];
  const int t = threadIdx.x;
  griddep_launch_dependents();  // the gather transform behind us needs nothing we write: let it start now
  count[t] = 0;
  cursor[t] = 0;
  __syncthreads();
  for (int p = t; p < a.pairs; p += kRouteThreads) {
    const int e = local_expert(a.ids, p);
    a.pair_expert[p] = e;
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  const int n = t < a.ids.experts ? count[t] : 0;
  const int chunks = (n + a.rows_per_chunk - 1) / a.rows_per_chunk;
  int offset, chunk0, total_chunks;
  Scan(scan_tmp).ExclusiveSum(n, offset);
  __syncthreads();
  Scan(scan_tmp).ExclusiveSum(chunks, chunk0, total_chunks);
  __syncthreads();
  count[t] = offset;  // count[] now holds each expert's first position in sorted_pairs
  if (t == 0) *a.num_chunks = total_chunks;
  for (int c = 0; c < chunks; ++c) {
    a.chunk_expert[chunk0 + c] = t;
    a.chunk_start[chunk0 + c] = offset + c * a.rows_per_chunk;
    a.chunk_count[chunk0 + c] = min(a.rows_per_chunk, n - c * a.rows_per_chunk);
  }
  __syncthreads();
  for (int p = t; p < a.pairs; p += kRouteThreads) {
    const int e = a.pair_expert[p];
    if (e >= 0) a.sorted_pairs[count[e] + atomicAdd(&cursor[e], 1)] = p;
  }
}

// ------------------------------------------------------------------------------------------------------------
// Steps 2 and 4: per pair, per 128-block, xh = H(v * suh) / sqrt(128) rounded once to fp16. A half-warp owns one
// 128-block, 8 consecutive values per lane (3 butterfly stages in registers, 4 across the half-warp); a block is
// one pair x 8 such blocks.
// ------------------------------------------------------------------------------------------------------------
constexpr int kXfWarps = 4;
constexpr int kXfThreads = kXfWarps * kWarp;
constexpr int kXfBlocks = 2 * kXfWarps;  // 128-blocks per CUDA block

// v / sqrt(128), rounded to fp16, one 16-byte store.
__device__ __forceinline__ void store_scaled_fp16(const float (&v)[8], __half* dst) {
  const __half2 h0 = __floats2half2_rn(v[0] * kHadScale, v[1] * kHadScale);
  const __half2 h1 = __floats2half2_rn(v[2] * kHadScale, v[3] * kHadScale);
  const __half2 h2 = __floats2half2_rn(v[4] * kHadScale, v[5] * kHadScale);
  const __half2 h3 = __floats2half2_rn(v[6] * kHadScale, v[7] * kHadScale);
  uint4 o;
  o.x = *reinterpret_cast<const uint32_t*>(&h0);
  o.y = *reinterpret_cast<const uint32_t*>(&h1);
  o.z = *reinterpret_cast<const uint32_t*>(&h2);
  o.w = *reinterpret_cast<const uint32_t*>(&h3);
  *reinterpret_cast<uint4*>(dst) = o;
}

// store_scaled_fp16 for a kDup GEMM's input (moe.h moe_xdup): the same fp16 values, each in both halves of a word,
// in the order of the B operands the GEMM's two MMAs per k-tile take (moe_gemm.cuh): per k-tile of 16 and lane
// quad position c4, x0 = x[2 c4, 2 c4 + 1] and x1 = x[8 + 2 c4, 9 + 2 c4] become {dup(lo x0), dup(lo x1),
// dup(hi x0), dup(hi x1)}, 16 bytes. Lanes 2t and 2t + 1 of the half-warp hold k-tile t (x[0..7] and x[8..15]):
// each gives its partner half of its values and writes two of the four groups, 32 bytes at twice the plain
// offset (`dst`: the plain address of v[0] with the offset doubled). Every lane shuffles; the inactive ones store
// nothing.
__device__ __forceinline__ void store_scaled_fp16_dup(const float (&v)[8], __half* dst, int lane, bool active) {
  uint32_t h[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const __half2 p = __floats2half2_rn(v[2 * e] * kHadScale, v[2 * e + 1] * kHadScale);
    h[e] = *reinterpret_cast<const uint32_t*>(&p);
  }
  const bool upper = lane & 1;  // holds x[8..15]: writes c4 = 2, 3 (the lower lane c4 = 0, 1)
  uint32_t o[8];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t got = __shfl_xor_sync(0xFFFFFFFFu, upper ? h[j] : h[2 + j], 1);
    const uint32_t x0 = upper ? got : h[j], x1 = upper ? h[2 + j] : got;
    o[4 * j] = __byte_perm(x0, 0u, 0x1010), o[4 * j + 1] = __byte_perm(x1, 0u, 0x1010);
    o[4 * j + 2] = __byte_perm(x0, 0u, 0x3232), o[4 * j + 3] = __byte_perm(x1, 0u, 0x3232);
  }
  if (!active) return;
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// Reads only what the router wrote before the routing kernel started (x, topk ids): it runs beside the routing
// kernel (launched behind it with PDL) instead of after it, and one block waits for it at the end so that the
// GEMM behind this grid sees the routing table too.
__global__ void __launch_bounds__(kXfThreads) moe_gather_kernel(const MoeGatherArgs a) {
  griddep_launch_dependents();
  const int pair = blockIdx.x;
  const int expert = local_expert(a.ids, pair);
  if (blockIdx.x == 0 && blockIdx.y == 0) griddep_wait();
  if (expert < 0) return;
  const int lane = threadIdx.x % kWarp, sub = lane % 16;
  const int kbs = a.hidden_padded / kHadBlock;
  const int idx = blockIdx.y * kXfBlocks + threadIdx.x / 16;  // (proj, 128-block)
  const bool active = idx < 2 * kbs;                         // not warp-uniform: idle half-warps still shuffle
  const int proj = active ? idx / kbs : 0, k = (active ? idx % kbs : 0) * kHadBlock + 8 * sub;
  float v[8] = {};
  if (active) {
    const long long i = static_cast<long long>(pair / a.top_k) * a.x_stride + k;
    if (k + 8 <= a.hidden && ((reinterpret_cast<uintptr_t>(a.x) + i * 2) & 15) == 0) {
      load_act8(a.x, i, a.x_dtype, v);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = k + e < a.hidden ? load_act(a.x, i + e, a.x_dtype) : 0.f;
    }
    const float w = a.pair_weight ? a.pair_weight[pair] : 1.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] *= w;
    mul_half8(v, static_cast<const __half*>(a.suh) + (static_cast<long long>(expert) * 2 + proj) * a.hidden_padded + k);
  }
  fwht128_halfwarp(v, lane);
  if (a.dup) {
    store_scaled_fp16_dup(v, static_cast<__half*>(a.xh) + 2 * ((static_cast<long long>(pair) * 2 + proj) * a.hidden_padded + k), lane, active);
    return;
  }
  if (active) store_scaled_fp16(v, static_cast<__half*>(a.xh) + (static_cast<long long>(pair) * 2 + proj) * a.hidden_padded + k);
}

__device__ __forceinline__ float activate(float g, int activation) {
  if (activation == kActSilu) return g / (1.f + expf(-g));
  if (activation == kActGelu) return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
  const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2/pi) (g + 0.044715 g^3)
  return 0.5f * g * (1.f + tanhf(inner));
}

// The gated activation of one column: act(g) * u, or the clamped SwiGLU (moe.h kActSwigluOai).
__device__ __forceinline__ float gated(float g, float u, const MoeActArgs& a) {
  if (a.activation != kActSwigluOai) return activate(g, a.activation) * u;
  g = fminf(g, a.limit);
  u = fminf(fmaxf(u, -a.limit), a.limit);
  return g / (1.f + expf(-a.alpha * g)) * (u + 1.f);
}

__global__ void __launch_bounds__(kXfThreads) moe_act_kernel(const MoeActArgs a) {
  griddep_wait();
  griddep_launch_dependents();
  const int pair = blockIdx.x;
  const int expert = a.pair_expert[pair];
  if (expert < 0) return;
  const int lane = threadIdx.x % kWarp, sub = lane % 16;
  const int kbs = a.inter_padded / kHadBlock;
  const int kb = blockIdx.y * kXfBlocks + threadIdx.x / 16;
  const bool active = kb < kbs;
  const int k = (active ? kb : 0) * kHadBlock + 8 * sub;
  float v[8] = {};
  if (active) {
    float g[8] = {}, u[8] = {};
    for (int s = 0; s < a.splits; ++s) {  // split order: deterministic
      const float* row = a.gu + (static_cast<long long>(pair) * a.splits + s) * 2 * a.inter_padded + k;
#pragma unroll
      for (int h = 0; h < 8; h += 4) {
        const float4 gv = *reinterpret_cast<const float4*>(row + h);
        const float4 uv = *reinterpret_cast<const float4*>(row + a.inter_padded + h);
        g[h] += gv.x, g[h + 1] += gv.y, g[h + 2] += gv.z, g[h + 3] += gv.w;
        u[h] += uv.x, u[h + 1] += uv.y, u[h + 2] += uv.z, u[h + 3] += uv.w;
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int c = k + e;
      if (c < a.inter_offset || c >= a.inter_offset + a.inter_size) {
        v[e] = 0.f;
        continue;
      }
      if (a.bias) {
        g[e] += a.bias[(static_cast<long long>(expert) * 2) * a.inter_padded + c];
        u[e] += a.bias[(static_cast<long long>(expert) * 2 + 1) * a.inter_padded + c];
      }
      v[e] = gated(g[e], u[e], a);
    }
    mul_half8(v, static_cast<const __half*>(a.suh) + static_cast<long long>(expert) * a.inter_padded + k);
  }
  fwht128_halfwarp(v, lane);
  if (a.dup) {
    store_scaled_fp16_dup(v, static_cast<__half*>(a.xh) + 2 * (static_cast<long long>(pair) * a.inter_padded + k), lane, active);
    return;
  }
  if (active) store_scaled_fp16(v, static_cast<__half*>(a.xh) + static_cast<long long>(pair) * a.inter_padded + k);
}

// ------------------------------------------------------------------------------------------------------------
// Step 6: y[token] = sum_k slot[token * top_k + k] over the pairs routed to local experts, k in order.
// ------------------------------------------------------------------------------------------------------------
constexpr int kReduceThreads = 128;

__global__ void __launch_bounds__(kReduceThreads) moe_reduce_kernel(const MoeReduceArgs a) {
  griddep_wait();
  griddep_launch_dependents();
  const int token = blockIdx.x;
  const int h = (blockIdx.y * kReduceThreads + threadIdx.x) * 4;
  if (h >= a.hidden) return;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  const float* row = a.slots + static_cast<long long>(token) * a.top_k * a.splits * a.hidden_padded + h;
  // Four k at a time with every split unrolled: all their loads are in flight together (one at a time, the kernel
  // was a chain of L2 latencies); the sums still run k, then split, in order.
  for (int k0 = 0; k0 < a.top_k; k0 += 4) {
    float4 q[4][kMoeMaxSplits];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int k = k0 + kk;
      const bool local = k < a.top_k && a.pair_expert[token * a.top_k + k] >= 0;
#pragma unroll
      for (int s = 0; s < kMoeMaxSplits; ++s)
        q[kk][s] = local && s < a.splits ? *reinterpret_cast<const float4*>(row + (k * a.splits + s) * a.hidden_padded)
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int s = 0; s < kMoeMaxSplits; ++s) v[0] += q[kk][s].x, v[1] += q[kk][s].y, v[2] += q[kk][s].z, v[3] += q[kk][s].w;
  }
  if (a.bias) {  // the down bias of each local expert, times its router weight (as the slots carry theirs)
    for (int k = 0; k < a.top_k; ++k) {
      const int pair = token * a.top_k + k, expert = a.pair_expert[pair];
      if (expert < 0) continue;
      const float w = a.pair_weight ? a.pair_weight[pair] : 1.f;
      const float* b = a.bias + expert * a.bias_stride + h;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (h + j < a.hidden) v[j] += w * b[j];
    }
  }
  const long long i = static_cast<long long>(token) * a.y_stride + h;
  const bool aligned = ((reinterpret_cast<uintptr_t>(a.y) + i * 2) & 7) == 0;
  store_act4(a.y, i, v, a.y_dtype, aligned, 0, min(4, a.hidden - h));
}

// Raises a GEMM instantiation's shared-memory limit once per device (moe_prepare does it for a layer's kernels at
// load, so that nothing but launches happens during CUDA-graph capture).
cudaError_t prepare_gemm(const MoeGemmKernel& k) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> done;
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({dev, k.fn})) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem);
  if (err == cudaSuccess) done.insert({dev, k.fn});
  return err;
}

MoeGemmKernel pick_gemm(int bits2, int codebook, int rows) {
  return codebook == kCbMul1 ? moe_gemm_kernel_mul1(bits2, rows) : moe_gemm_kernel_3inst_mcg(bits2, rows);
}

}  // namespace

cudaError_t moe_prepare(int bits2, int codebook) {
  for (int rows : {8, 16, 64}) {
    const MoeGemmKernel k = pick_gemm(bits2, codebook, rows);
    if (!k.fn) return cudaErrorInvalidValue;
    const cudaError_t err = prepare_gemm(k);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_moe_route(const MoeRouteArgs& a, cudaStream_t stream) {
  if (a.ids.experts > kMoeMaxExperts || a.ids.experts <= 0) return cudaErrorInvalidValue;
  void* args[] = {const_cast<MoeRouteArgs*>(&a)};
  return launch_kernel(reinterpret_cast<const void*>(&moe_route_kernel), dim3(1), dim3(kRouteThreads), 0, false,
                       stream, args);
}

cudaError_t launch_moe_gather_transform(const MoeGatherArgs& a, bool pdl, cudaStream_t stream) {
  if (a.pairs <= 0) return cudaSuccess;
  const int kbs = a.hidden_padded / kHadBlock;
  void* args[] = {const_cast<MoeGatherArgs*>(&a)};
  return launch_kernel(reinterpret_cast<const void*>(&moe_gather_kernel),
                       dim3(a.pairs, (2 * kbs + kXfBlocks - 1) / kXfBlocks), dim3(kXfThreads), 0, pdl, stream, args);
}

cudaError_t launch_moe_act_transform(const MoeActArgs& a, bool pdl, cudaStream_t stream) {
  if (a.pairs <= 0) return cudaSuccess;
  const int kbs = a.inter_padded / kHadBlock;
  void* args[] = {const_cast<MoeActArgs*>(&a)};
  return launch_kernel(reinterpret_cast<const void*>(&moe_act_kernel),
                       dim3(a.pairs, (kbs + kXfBlocks - 1) / kXfBlocks), dim3(kXfThreads), 0, pdl, stream, args);
}

cudaError_t launch_moe_gemm(const MoeGemmArgs& a, int rows_per_chunk, bool pdl, cudaStream_t stream) {
  const MoeGemmKernel k = pick_gemm(a.bits2, a.codebook, rows_per_chunk);
  if (!k.fn) return cudaErrorInvalidValue;
  if (a.chunk_bound <= 0) return cudaSuccess;
  cudaError_t err = prepare_gemm(k);
  if (err != cudaSuccess) return err;
  void* args[] = {const_cast<MoeGemmArgs*>(&a)};
  return launch_kernel(k.fn, dim3(a.chunk_bound, a.groups * a.projs, a.splits), dim3(kMoeThreads), k.smem, pdl, stream,
                       args);
}

cudaError_t launch_moe_reduce(const MoeReduceArgs& a, bool pdl, cudaStream_t stream) {
  if (a.tokens <= 0 || a.hidden <= 0) return cudaSuccess;
  void* args[] = {const_cast<MoeReduceArgs*>(&a)};
  return launch_kernel(reinterpret_cast<const void*>(&moe_reduce_kernel),
                       dim3(a.tokens, (a.hidden + 4 * kReduceThreads - 1) / (4 * kReduceThreads)),
                       dim3(kReduceThreads), 0, pdl, stream, args);
}

}  // namespace exl3

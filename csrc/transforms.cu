// Input/output Hadamard transforms and the reconstruct kernels (Ŵ bit-exact; W in the original basis).
#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"

namespace exl3 {

constexpr int kXfWarps = 8;  // one warp per (row, 128-block)
constexpr int kXfThreads = kXfWarps * kWarp;

// ------------------------------------------------------------------------------------------------------------
// xh = H(x * suh) per 128-block, fp32 math, one fp16 rounding (exl3-format.md §3.3); per-row partial sums of the
// rounded xh (mul1's affine epilogue needs sum_k xh exactly as the tensor cores saw it).
// ------------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kXfThreads) input_transform_kernel(const InputTransformArgs a) {
  griddep_launch_dependents();  // the skinny kernel may start streaming weights now; it waits for our results
  __shared__ float part[kXfWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int row = blockIdx.x;
  const int kb = blockIdx.y * kXfWarps + warp;

  if (a.zero) {  // the next kernel's split-K workspace
    const size_t n = a.zero_bytes / sizeof(uint4);
    const size_t stride = static_cast<size_t>(gridDim.x) * gridDim.y * kXfThreads;
    for (size_t i = (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kXfThreads + threadIdx.x; i < n;
         i += stride)
      static_cast<uint4*>(a.zero)[i] = make_uint4(0, 0, 0, 0);
  }

  float sum = 0.f;
  if (kb < a.kb_count) {
    const int k = (a.kb0 + kb) * kHadBlock + 4 * lane;
    __half h[4] = {__float2half_rn(0.f), __float2half_rn(0.f), __float2half_rn(0.f), __float2half_rn(0.f)};
    if (row < a.rows) {
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int xi = k + e - a.in_offset;
        v[e] = (xi >= 0 && xi < a.in_width)
                   ? load_act(a.x, row * a.x_stride + xi, a.x_dtype) * __half2float(static_cast<const __half*>(a.suh)[k + e])
                   : 0.f;
      }
      fwht128_warp(v, lane);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        h[e] = __float2half_rn(v[e] * kHadScale);
        sum += __half2float(h[e]);
      }
    }
    __half2 lo = __halves2half2(h[0], h[1]), hi = __halves2half2(h[2], h[3]);
    uint2 u = {*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi)};
    *reinterpret_cast<uint2*>(static_cast<__half*>(a.xh) + static_cast<long long>(row) * a.kb_count * kHadBlock +
                              kb * kHadBlock + 4 * lane) = u;
  }
  if (a.rowsum_parts && row < a.rows) {  // block-uniform condition
    sum = warp_sum(sum);
    if (lane == 0) part[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0.f;
      for (int w = 0; w < kXfWarps; ++w) s += part[w];
      a.rowsum_parts[static_cast<long long>(row) * gridDim.y + blockIdx.y] = s;
    }
  }
}

int input_transform_parts(int kb_count) { return (kb_count + kXfWarps - 1) / kXfWarps; }

cudaError_t launch_input_transform(const InputTransformArgs& a, cudaStream_t stream) {
  if (a.xh_rows <= 0 || a.kb_count <= 0) return cudaSuccess;
  const dim3 grid(a.xh_rows, input_transform_parts(a.kb_count));
  input_transform_kernel<<<grid, kXfThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------------------------
// y = H(z) * svh per 128-column group (reconstruct + GEMM path).
// ------------------------------------------------------------------------------------------------------------
template <bool kF32>
__global__ void __launch_bounds__(kXfThreads) output_transform_kernel(const OutputTransformArgs a) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int row = blockIdx.x, group = blockIdx.y * kXfWarps + warp;
  if (group >= a.groups) return;  // warp-uniform
  const long long zi = row * a.z_stride + group * kHadBlock + 4 * lane;
  float v[4];
  if constexpr (kF32) {
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(a.z) + zi);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __half*>(a.z) + zi);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
  fwht128_warp(v, lane);
  const int n0 = (a.g0 + group) * kHadBlock + 4 * lane;
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] *= kHadScale * __half2float(static_cast<const __half*>(a.svh)[n0 + e]);
  const int oc = n0 - a.out_offset;
  const int lo = max(0, -oc), hi = min(4, a.out_features - oc);
  if (lo < hi) {
    const long long o = row * a.y_stride + oc;
    store_act4(a.y, o, v, a.y_dtype, (o & 3) == 0, lo, hi);
  }
}

cudaError_t launch_output_transform(const OutputTransformArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.groups <= 0) return cudaSuccess;
  const dim3 grid(a.rows, (a.groups + kXfWarps - 1) / kXfWarps);
  if (a.z_f32) output_transform_kernel<true><<<grid, kXfThreads, 0, stream>>>(a);
  else output_transform_kernel<false><<<grid, kXfThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------------------------
// Reconstruct: one block per (16-row k-tile, 128-column group); each warp decodes one tile straight from global
// memory into registers (the same lane decoder as the GEMM kernels), shared memory turns fragments into rows.
// ------------------------------------------------------------------------------------------------------------
template <int kBits2, bool kMul1>
__device__ __forceinline__ void decode_tile_rounded(const int16_t* rec, const LaneWindows<kBits2>& lw, uint32_t mul,
                                                    uint32_t add, __half (&v)[kLanePositions]) {
  using TB = TileBits<kBits2>;
  uint32_t w[TB::kLoadWords], s[kLanePositions], cw[kLanePositions];
#pragma unroll
  for (int i = 0; i < TB::kLoadWords; ++i)
    w[i] = *reinterpret_cast<const uint32_t*>(reinterpret_cast<const unsigned char*>(rec) + lw.word_byte[i]);
  lw.states(w, s);
#pragma unroll
  for (int j = 0; j < kLanePositions; ++j) cw[j] = codeword<kMul1>(s[j], mul, add);
#pragma unroll
  for (int j = 0; j < kLanePositions; j += 2) {
    const uint32_t p = rounded_pair<kMul1>(cw[j], cw[j + 1]);
    const __half2 h = *reinterpret_cast<const __half2*>(&p);
    v[j] = __low2half(h);
    v[j + 1] = __high2half(h);
  }
}

// Each warp walks one 16-column tile column down kReconRows k-tiles, keeping kReconDepth tiles of trellis words in
// flight in registers, decodes each tile in registers, turns the fragment into rows through 512 bytes of shared
// memory and writes 16 rows x 32 bytes (whole 32-byte sectors). No block-wide barriers.
constexpr int kReconRows = 16;
constexpr int kReconDepth = 4;

template <int kBits2, bool kMul1>
__global__ void __launch_bounds__(kXfThreads) reconstruct_kernel(const ReconstructArgs a) {
  using TB = TileBits<kBits2>;
  __shared__ __align__(16) __half stage[kXfWarps][kTile * kTile];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nt = blockIdx.x * kXfWarps + warp;  // tile column within the active groups
  const int kt_lo = blockIdx.y * kReconRows, kt_hi = min(kt_lo + kReconRows, a.kb_count * kTilesPerHad);
  if (nt >= a.groups * kTilesPerHad) return;  // warp-uniform
  LaneWindows<kBits2> lw;
  lw.init(lane);
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);
  const unsigned char* col = reinterpret_cast<const unsigned char*>(
      a.w.data + static_cast<long long>(a.kb0) * kTilesPerHad * a.w.row_stride +
      static_cast<long long>(a.g0 * kTilesPerHad + nt) * a.w.tile_stride);
  const long long row_bytes = a.w.row_stride * 2;
  uint32_t ring[kReconDepth][TB::kLoadWords];
  auto fetch = [&](int kt, uint32_t (&w)[TB::kLoadWords]) {
    if (kt < kt_hi) {
#pragma unroll
      for (int i = 0; i < TB::kLoadWords; ++i)
        w[i] = __ldcs(reinterpret_cast<const unsigned int*>(col + kt * row_bytes + lw.word_byte[i]));
    }
  };
#pragma unroll
  for (int d = 0; d < kReconDepth; ++d) fetch(kt_lo + d, ring[d]);
  const long long na = static_cast<long long>(a.groups) * kHadBlock;
  const int r = lane / 2, h = lane % 2;  // the row and 8-column half this lane writes
  __half* sw = stage[warp];
  for (int kt0 = kt_lo; kt0 < kt_hi; kt0 += kReconDepth) {
#pragma unroll
    for (int d = 0; d < kReconDepth; ++d) {
      const int kt = kt0 + d;
      if (kt >= kt_hi) break;
      uint32_t s[kLanePositions], cw[kLanePositions];
      lw.states(ring[d], s);
      fetch(kt + kReconDepth, ring[d]);
#pragma unroll
      for (int j = 0; j < kLanePositions; ++j) cw[j] = codeword<kMul1>(s[j], mul, add);
#pragma unroll
      for (int j = 0; j < kLanePositions; j += 2) {
        const uint32_t p = rounded_pair<kMul1>(cw[j], cw[j + 1]);
        const __half2 v = *reinterpret_cast<const __half2*>(&p);
        sw[tile_row(lane, j) * kTile + tile_col(lane, j)] = __low2half(v);
        sw[tile_row(lane, j + 1) * kTile + tile_col(lane, j + 1)] = __high2half(v);
      }
      __syncwarp();
      const uint4 u = *reinterpret_cast<const uint4*>(sw + r * kTile + h * 8);
      __syncwarp();
      const long long o = (static_cast<long long>(kt) * kTile + r) * na + nt * kTile + h * 8;
      if (a.out_dtype == kActBF16) {
        const __half2* hp = reinterpret_cast<const __half2*>(&u);
        uint4 b;
        uint32_t* bw = reinterpret_cast<uint32_t*>(&b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          __nv_bfloat162 t = __float22bfloat162_rn(__half22float2(hp[i]));
          bw[i] = *reinterpret_cast<uint32_t*>(&t);
        }
        *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) + o) = b;
      } else {
        *reinterpret_cast<uint4*>(static_cast<__half*>(a.out) + o) = u;
      }
    }
  }
}

// W = diag(suh) H Ŵ H diag(svh) for one 128x128 block, fp32 in shared memory (tools; not on the serving path).
constexpr int kFullStride = kHadBlock + 1;
constexpr int kFullSmem = kHadBlock * kFullStride * 4;

template <int kBits2, bool kMul1>
__global__ void __launch_bounds__(kXfThreads) reconstruct_full_kernel(const ReconstructFullArgs a) {
  extern __shared__ float blk[];  // [128][129]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group = blockIdx.x, kb = blockIdx.y;
  LaneWindows<kBits2> lw;
  lw.init(lane);
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);
  for (int t = warp; t < kTilesPerHad * kTilesPerHad; t += kXfWarps) {
    const int ki = t / kTilesPerHad, ni = t % kTilesPerHad;
    const int16_t* rec = a.w.data + static_cast<long long>(kb * kTilesPerHad + ki) * a.w.row_stride +
                         static_cast<long long>(group * kTilesPerHad + ni) * a.w.tile_stride;
    __half v[kLanePositions];
    decode_tile_rounded<kBits2, kMul1>(rec, lw, mul, add, v);
#pragma unroll
    for (int j = 0; j < kLanePositions; ++j)
      blk[(ki * kTile + tile_row(lane, j)) * kFullStride + ni * kTile + tile_col(lane, j)] = __half2float(v[j]);
  }
  __syncthreads();
  for (int n = warp; n < kHadBlock; n += kXfWarps) {  // down each column, then scale row k by suh[k]
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = blk[(4 * lane + e) * kFullStride + n];
    fwht128_warp(v, lane);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      blk[(4 * lane + e) * kFullStride + n] =
          v[e] * kHadScale * __half2float(static_cast<const __half*>(a.suh)[kb * kHadBlock + 4 * lane + e]);
  }
  __syncthreads();
  const long long n_total = static_cast<long long>(a.nt_total) * kTile;
  for (int k = warp; k < kHadBlock; k += kXfWarps) {  // along each row, then scale column n by svh[n]
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = blk[k * kFullStride + 4 * lane + e];
    fwht128_warp(v, lane);
    const int n0 = group * kHadBlock + 4 * lane;
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] *= kHadScale * __half2float(static_cast<const __half*>(a.svh)[n0 + e]);
    store_act4(a.out, (static_cast<long long>(kb) * kHadBlock + k) * n_total + n0, v, a.out_dtype, true, 0, 4);
  }
}

cudaError_t launch_reconstruct(const ReconstructArgs& a, cudaStream_t stream) {
  if (a.kb_count <= 0 || a.groups <= 0) return cudaSuccess;
  const dim3 grid(a.groups * kTilesPerHad / kXfWarps, (a.kb_count * kTilesPerHad + kReconRows - 1) / kReconRows);
  cudaError_t err = cudaErrorInvalidValue;
  auto go = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    if (a.w.codebook == kCbMul1) reconstruct_kernel<kB, true><<<grid, kXfThreads, 0, stream>>>(a);
    else if constexpr (kB % 2 == 0) reconstruct_kernel<kB, false><<<grid, kXfThreads, 0, stream>>>(a);
    else return;
    err = cudaGetLastError();
  };
  EXL3_DISPATCH_BITS2(a.w.bits2, go)
  return err;
}

cudaError_t launch_reconstruct_full(const ReconstructFullArgs& a, cudaStream_t stream) {
  if (a.kt_total % kTilesPerHad || a.nt_total % kTilesPerHad) return cudaErrorInvalidValue;
  const dim3 grid(a.nt_total / kTilesPerHad, a.kt_total / kTilesPerHad);
  if (grid.x == 0 || grid.y == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  auto go = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    const void* fn = nullptr;
    if (a.w.codebook == kCbMul1) fn = reinterpret_cast<const void*>(&reconstruct_full_kernel<kB, true>);
    else if constexpr (kB % 2 == 0) fn = reinterpret_cast<const void*>(&reconstruct_full_kernel<kB, false>);
    if (!fn) return;
    err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kFullSmem);
    if (err != cudaSuccess) return;
    void* args[] = {const_cast<ReconstructFullArgs*>(&a)};
    err = cudaLaunchKernel(fn, grid, dim3(kXfThreads), args, kFullSmem, stream);
  };
  EXL3_DISPATCH_BITS2(a.w.bits2, go)
  return err;
}

}  // namespace exl3

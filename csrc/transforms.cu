// The input Hadamard transform (skinny and panel paths) and the reconstruct kernels (Ŵ bit-exact; W in the original basis).
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
// Reconstruct: one block per (16-row k-tile, 128-column group); each warp decodes one tile straight from global
// memory into registers (the same lane decoder as the GEMM kernels), shared memory turns fragments into rows.
// ------------------------------------------------------------------------------------------------------------
// One lane's 8 weights of a tile, bit-exact Ŵ, from the words it loaded: as 4 half2 pairs (positions 2i, 2i+1;
// pair i is register i of the lane's fragment in position order) or as 8 halves.
template <int kBits2, bool kMul1>
__device__ __forceinline__ void rounded_pairs(const LaneWindows<kBits2>& lw, const uint32_t (&w)[TileBits<kBits2>::kLoadWords],
                                              uint32_t mul, uint32_t add, uint32_t (&p)[kLanePositions / 2]) {
  uint32_t s[kLanePositions], cw[kLanePositions];
  lw.states(w, s);
#pragma unroll
  for (int j = 0; j < kLanePositions; ++j) cw[j] = codeword<kMul1>(s[j], mul, add);
#pragma unroll
  for (int i = 0; i < kLanePositions / 2; ++i) p[i] = rounded_pair<kMul1>(cw[2 * i], cw[2 * i + 1]);
}

template <int kBits2, bool kMul1>
__device__ __forceinline__ void rounded_weights(const LaneWindows<kBits2>& lw, const uint32_t (&w)[TileBits<kBits2>::kLoadWords],
                                                uint32_t mul, uint32_t add, __half (&v)[kLanePositions]) {
  uint32_t p[kLanePositions / 2];
  rounded_pairs<kBits2, kMul1>(lw, w, mul, add, p);
#pragma unroll
  for (int i = 0; i < kLanePositions / 2; ++i) {
    const __half2 h = *reinterpret_cast<const __half2*>(&p[i]);
    v[2 * i] = __low2half(h);
    v[2 * i + 1] = __high2half(h);
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
      __half v[kLanePositions];
      rounded_weights<kBits2, kMul1>(lw, ring[d], mul, add, v);
      fetch(kt + kReconDepth, ring[d]);
#pragma unroll
      for (int j = 0; j < kLanePositions; ++j) sw[tile_row(lane, j) * kTile + tile_col(lane, j)] = v[j];
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

// ------------------------------------------------------------------------------------------------------------
// Reconstruct in the original basis, W = diag(suh) H Ŵ H diag(svh), one 128x128 block per CTA (what the
// reconstruct + cuBLAS path multiplies x with directly: no activation transforms, no fp32 intermediate).
// H128 = H8 (x) H16 (Sylvester order), so each side is a 16-point Hadamard inside every tile, on tensor cores, and
// an 8-point butterfly across tiles in fp32 registers. Register identities make the MMAs free of shuffles: the
// decoded fragment of Ŵ^T (an A operand) is, pair for pair, the B operand of Ŵ; an MMA's fp32 result, rounded to
// fp16 pairs, is the A operand of the next MMA; H16 is symmetric, so one set of registers is both its A and B.
// Warp w decodes tile column w (8 k-tiles) and finishes the k side in registers, then applies the in-tile n side;
// the 8-point n-side butterfly needs all 8 tile columns, so the results meet in shared memory, where warp w takes
// k-tile row w, finishes, scales by suh[k] svh[n] / 128 and writes it out.
// ------------------------------------------------------------------------------------------------------------
// Floats per shared row. 136: the fragment-order 8-byte stores (row = lane/4) and the row-order 16-byte loads
// (row = lane/2, alternate 16-byte halves) both hit distinct banks.
constexpr int kOrigStride = kHadBlock + 8;
constexpr int kOrigSmem = kHadBlock * kOrigStride * 4;

// H16[i][j] and H16[i][j+1] (+-1) as a half2: the lane's A-fragment registers of H16 are pairs (g, 2t), (g+8, 2t),
// (g, 2t+8), (g+8, 2t+8); by symmetry, {h0, h2} / {h1, h3} are its B fragments for output columns 0-7 / 8-15.
__device__ __forceinline__ uint32_t had16_pair(int i, int j) {
  const uint32_t lo = (__popc(i & j) & 1) ? 0xBC00u : 0x3C00u;
  const uint32_t hi = (__popc(i & (j + 1)) & 1) ? 0xBC00u : 0x3C00u;
  return lo | (hi << 16);
}

// Unnormalized 8-point Hadamard (Sylvester order) over the first index, for each of kN lanes of values.
template <int kN>
__device__ __forceinline__ void butterfly8(float (&v)[kTilesPerHad][kN]) {
#pragma unroll
  for (int m = 1; m < kTilesPerHad; m <<= 1)
#pragma unroll
    for (int i = 0; i < kTilesPerHad; ++i)
      if (!(i & m))
#pragma unroll
        for (int e = 0; e < kN; ++e) {
          const float p = v[i][e], q = v[i | m][e];
          v[i][e] = p + q;
          v[i | m][e] = p - q;
        }
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <int kBits2, bool kMul1>
__global__ void __launch_bounds__(kXfThreads) reconstruct_original_kernel(const ReconstructArgs a) {
  using TB = TileBits<kBits2>;
  static_assert(kXfWarps == kTilesPerHad, "one warp per tile column of a 128x128 block");
  extern __shared__ float xchg[];  // [128][kOrigStride]: k rows x n columns of the block
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;
  const int group = blockIdx.x, kb = blockIdx.y;  // within the active part
  LaneWindows<kBits2> lw;
  lw.init(lane);
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);
  const unsigned char* col = reinterpret_cast<const unsigned char*>(
      a.w.data + static_cast<long long>(a.kb0 + kb) * kTilesPerHad * a.w.row_stride +
      static_cast<long long>((a.g0 + group) * kTilesPerHad + warp) * a.w.tile_stride);
  const long long row_bytes = a.w.row_stride * 2;
  uint32_t words[kTilesPerHad][TB::kLoadWords];  // all 8 tiles in flight at once
#pragma unroll
  for (int kt = 0; kt < kTilesPerHad; ++kt)
#pragma unroll
    for (int i = 0; i < TB::kLoadWords; ++i)
      words[kt][i] = __ldcs(reinterpret_cast<const unsigned int*>(col + kt * row_bytes + lw.word_byte[i]));
  const uint32_t h0 = had16_pair(g, 2 * t), h1 = had16_pair(g + 8, 2 * t), h2 = had16_pair(g, 2 * t + 8),
                 h3 = had16_pair(g + 8, 2 * t + 8);

  // k side. Per tile: H16 . Ŵ for tile columns 0-7 (pairs 0, 1 = B) and 8-15 (pairs 2, 3); acc[kt] holds rows
  // (g, g+8) x columns (2t, 2t+1) of each, in the MMA result order. Then the butterfly across the 8 k-tiles.
  float acc[kTilesPerHad][8];
#pragma unroll
  for (int kt = 0; kt < kTilesPerHad; ++kt) {
    uint32_t p[kLanePositions / 2];
    rounded_pairs<kBits2, kMul1>(lw, words[kt], mul, add, p);
    float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16816(d0, h0, h1, h2, h3, p[0], p[1]);
    mma_16816(d1, h0, h1, h2, h3, p[2], p[3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[kt][e] = d0[e], acc[kt][4 + e] = d1[e];
  }
  butterfly8(acc);

  // n side inside each tile: T (fp16 A operand: rows k, columns n) . H16, then to shared memory.
  float* const sw = xchg + warp * kTile + 2 * t;
#pragma unroll
  for (int kt = 0; kt < kTilesPerHad; ++kt) {
    const float(&d)[8] = acc[kt];
    const uint32_t a0 = half2_bits(d[0], d[1]), a1 = half2_bits(d[2], d[3]), a2 = half2_bits(d[4], d[5]),
                   a3 = half2_bits(d[6], d[7]);
    float e0[4] = {0.f, 0.f, 0.f, 0.f}, e1[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16816(e0, a0, a1, a2, a3, h0, h2);
    mma_16816(e1, a0, a1, a2, a3, h1, h3);
    float* r0 = sw + (kt * kTile + g) * kOrigStride;
    float* r8 = r0 + 8 * kOrigStride;
    *reinterpret_cast<float2*>(r0) = make_float2(e0[0], e0[1]);
    *reinterpret_cast<float2*>(r0 + 8) = make_float2(e1[0], e1[1]);
    *reinterpret_cast<float2*>(r8) = make_float2(e0[2], e0[3]);
    *reinterpret_cast<float2*>(r8 + 8) = make_float2(e1[2], e1[3]);
  }
  __syncthreads();

  // Row k of k-tile `warp`, columns 4h..4h+3 and 8+4h..8+4h+3 of every tile column: the butterfly across the 8 tile
  // columns, the scales, the store.
  const int r = lane / 2, h = lane % 2;
  float v[kTilesPerHad][8];
  const float* sr = xchg + (warp * kTile + r) * kOrigStride + 4 * h;
#pragma unroll
  for (int nt = 0; nt < kTilesPerHad; ++nt)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(sr + nt * kTile + 8 * q);
      v[nt][4 * q] = f.x, v[nt][4 * q + 1] = f.y, v[nt][4 * q + 2] = f.z, v[nt][4 * q + 3] = f.w;
    }
  butterfly8(v);
  const int k = (a.kb0 + kb) * kHadBlock + warp * kTile + r;
  const float row_scale = __half2float(static_cast<const __half*>(a.suh)[k]) * (kHadScale * kHadScale);
  const __half* svh = static_cast<const __half*>(a.svh) + (a.g0 + group) * kHadBlock + 4 * h;
  const long long na = static_cast<long long>(a.groups) * kHadBlock;
  const long long o = (static_cast<long long>(kb) * kHadBlock + warp * kTile + r) * na + group * kHadBlock + 4 * h;
#pragma unroll
  for (int nt = 0; nt < kTilesPerHad; ++nt)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(svh + nt * kTile + 8 * q));
      const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
      const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
      const float w4[4] = {v[nt][4 * q] * row_scale * s01.x, v[nt][4 * q + 1] * row_scale * s01.y,
                           v[nt][4 * q + 2] * row_scale * s23.x, v[nt][4 * q + 3] * row_scale * s23.y};
      store_act4(a.out, o + nt * kTile + 8 * q, w4, a.out_dtype, true, 0, 4);
    }
}

cudaError_t launch_reconstruct(const ReconstructArgs& a, cudaStream_t stream) {
  if (a.kb_count <= 0 || a.groups <= 0) return cudaSuccess;
  if (!a.suh != !a.svh) return cudaErrorInvalidValue;
  cudaError_t err = cudaErrorInvalidValue;
  auto go = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    const void* fn = nullptr;
    if (a.suh) {
      if (a.w.codebook == kCbMul1) fn = reinterpret_cast<const void*>(&reconstruct_original_kernel<kB, true>);
      else if constexpr (kB % 2 == 0) fn = reinterpret_cast<const void*>(&reconstruct_original_kernel<kB, false>);
    } else {
      if (a.w.codebook == kCbMul1) fn = reinterpret_cast<const void*>(&reconstruct_kernel<kB, true>);
      else if constexpr (kB % 2 == 0) fn = reinterpret_cast<const void*>(&reconstruct_kernel<kB, false>);
    }
    if (!fn) return;
    dim3 grid(a.groups * kTilesPerHad / kXfWarps, (a.kb_count * kTilesPerHad + kReconRows - 1) / kReconRows);
    int smem = 0;
    if (a.suh) {
      grid = dim3(a.groups, a.kb_count);
      smem = kOrigSmem;
      // A host-side attribute (not a stream operation): cheap, and allowed during graph capture.
      err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) return;
    }
    void* args[] = {const_cast<ReconstructArgs*>(&a)};
    err = cudaLaunchKernel(fn, grid, dim3(kXfThreads), args, smem, stream);
  };
  EXL3_DISPATCH_BITS2(a.w.bits2, go)
  return err;
}

}  // namespace exl3

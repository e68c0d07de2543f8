// The reconstruct kernels: Ŵ (bit-exact), W' = Ŵ H diag(svh) (output side applied) and W in the original basis.
// Over 400 lines on purpose: the three share the decode staging and one launcher (launch_reconstruct) that picks
// between them; apart, the launcher would include every kernel anyway.
#include <algorithm>

#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"

namespace exl3 {

constexpr int kXfWarps = 8;  // reconstruct kernels: warps per block
constexpr int kXfThreads = kXfWarps * kWarp;

// ------------------------------------------------------------------------------------------------------------
// Reconstruct: one block per (16-row k-tile, 128-column group); each warp decodes one tile straight from global
// memory into registers (the same lane decoder as the GEMM kernels), shared memory turns fragments into rows.
// ------------------------------------------------------------------------------------------------------------
// One lane's 8 weights of a tile, bit-exact Ŵ, from the words it loaded: as 4 half2 pairs (positions 2i, 2i+1;
// pair i is register i of the lane's fragment in position order) or as 8 halves.
template <int kBits2, bool kMul1>
__device__ __forceinline__ void rounded_pairs(const LaneWindows<kBits2>& lw, const uint32_t (&w)[TileBits<kBits2>::kLoadWords],
                                              uint32_t mul, uint32_t add, uint32_t (&p)[kLanePositions / 2]) {
  uint32_t cw[kLanePositions];
  lane_codewords<kMul1>(lw, w, mul, add, cw);
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
// Reconstruct with the output side applied, W' = Ŵ H diag(svh) / 8: the weight the transformed input xh (scaled by
// kReconInputScale) multiplies to give y directly (the reconstruct + cuBLAS path: no output transform, no
// intermediate). H128 = H8 (x) H16 (Sylvester order) and the two factors commute, so W' = Ŵ (H8 (x) I16) .
// (I8 (x) H16 diag(svh) / 8): first an 8-point butterfly across the 8 tiles of a column group on the decoded fp16
// pairs (packed half2 adds; three roundings, bench/notes/kernels-v4.md "v4c"), then per tile one tensor-core product
// whose B operand is H16 with svh / 8 folded in (+-svh * 2^-3: exact in fp16). A warp owns whole 128-column rows: it
// walks down `rows_per_warp` k-tile rows of one column group, the next rows' words arriving through its own cp.async
// ring, so nothing crosses warps.
// movmatrix turns the decoded fragment of Ŵ^T (an A operand) into the A operand of Ŵ; a per-warp shared tile turns
// the MMA result layout into whole 256-byte rows for the stores.
// ------------------------------------------------------------------------------------------------------------
#ifndef EXL3_OUT_SIDE_ROWS  // tuning (bench VARIANTS): most k-tile rows per warp
#define EXL3_OUT_SIDE_ROWS 4
#endif
constexpr int kStageStride = kHadBlock + 8;  // halves per staged row: the fragment-order 4-byte stores hit distinct banks

// H16[i][j] and H16[i][j+1] (+-1) as a half2.
__device__ __forceinline__ uint32_t had16_pair(int i, int j) {
  const uint32_t lo = (__popc(i & j) & 1) ? 0xBC00u : 0x3C00u;
  const uint32_t hi = (__popc(i & (j + 1)) & 1) ? 0xBC00u : 0x3C00u;
  return lo | (hi << 16);
}

// a, b <- a + b, a - b: fp32, or two half2 pairs (fp16 sums).
__device__ __forceinline__ void sum_diff(float& a, float& b) {
  const float p = a;
  a = p + b;
  b = p - b;
}
__device__ __forceinline__ void sum_diff(uint32_t& a, uint32_t& b) {
  const __half2 p = *reinterpret_cast<const __half2*>(&a), q = *reinterpret_cast<const __half2*>(&b);
  const __half2 sum = __hadd2(p, q), diff = __hsub2(p, q);
  a = *reinterpret_cast<const uint32_t*>(&sum);
  b = *reinterpret_cast<const uint32_t*>(&diff);
}

// Unnormalized 8-point Hadamard (Sylvester order) across the first index, elementwise (T: float or half2 pairs).
template <typename T, int kN>
__device__ __forceinline__ void butterfly8(T (&v)[kTilesPerHad][kN]) {
#pragma unroll
  for (int m = 1; m < kTilesPerHad; m <<= 1)
#pragma unroll
    for (int i = 0; i < kTilesPerHad; ++i)
      if (!(i & m))
#pragma unroll
        for (int e = 0; e < kN; ++e) sum_diff(v[i][e], v[i | m][e]);
}

// The 8x8 b16 matrix held in fragment order (row lane/4, columns 2(lane%4), +1), transposed, in the same order.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t v) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
  return r;
}

// The A operands of Ŵ's 8 tiles (rows k, columns n) from the decoded fragments of Ŵ^T, in place.
__device__ __forceinline__ void transpose_tiles(uint32_t (&pw)[kTilesPerHad][kLanePositions / 2]) {
#pragma unroll
  for (int nt = 0; nt < kTilesPerHad; ++nt)
#pragma unroll
    for (int i = 0; i < kLanePositions / 2; ++i) pw[nt][i] = movmatrix_trans(pw[nt][i]);
}

// B operands of H16 diag(svh) / 8 for the 8 tile columns of a column group (svh: the group's 128 values): for
// output columns c = 8 nb + g of tile column nt, rows 2t, 2t+1 (and + 8). H16 is symmetric, so column c's pairs
// are row c's: had16_pair(c, 2t). +-svh * 2^-3 is exact in fp16.
__device__ __forceinline__ void svh_operands(const __half* svh, int g, int t, uint32_t (&hb)[kTilesPerHad][2][2]) {
#pragma unroll
  for (int nt = 0; nt < kTilesPerHad; ++nt)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      const int c = nb * 8 + g;
      const __half2 s = __half2half2(__hmul(svh[nt * kTile + c], __float2half(kReconWeightScale)));
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t h = had16_pair(c, 2 * t + 8 * i);
        const __half2 b = __hmul2(*reinterpret_cast<const __half2*>(&h), s);
        hb[nt][nb][i] = *reinterpret_cast<const uint32_t*>(&b);
      }
    }
}

// One k-tile row: per tile column nt, (tile nt as an A operand: rows k, columns n) . hb[nt][half] into the warp's
// staged rows as T (sw: the lane's pair in row g; row g+8 lies 8 rows below). Results: rows (g, g+8) x columns
// (2t, 2t+1) of each half.
template <typename T>
__device__ __forceinline__ void stage_row(const uint32_t (&a)[kTilesPerHad][kLanePositions / 2],
                                          const uint32_t (&hb)[kTilesPerHad][2][2], uint32_t* sw) {
#pragma unroll
  for (int nt = 0; nt < kTilesPerHad; ++nt) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_16816(d, a[nt][0], a[nt][1], a[nt][2], a[nt][3], hb[nt][nb][0], hb[nt][nb][1]);
      const int c = nt * kTile + nb * 8;
      sw[c / 2] = to_act2(d[0], d[1], static_cast<T*>(nullptr));
      sw[(8 * kStageStride + c) / 2] = to_act2(d[2], d[3], static_cast<T*>(nullptr));
    }
  }
}

// A warp's 16 staged rows (kStageStride halves apart) to rows row0.. of out (row stride na halves) at column col0:
// two whole 256-byte rows per 16-byte store.
__device__ __forceinline__ void store_staged_rows(const __half* sw, void* out, long long row0, long long na,
                                                  long long col0, int lane) {
#pragma unroll
  for (int i = 0; i < kTile / 2; ++i) {
    const int r = 2 * i + lane / 16, c = (lane % 16) * 8;
    const uint4 u = *reinterpret_cast<const uint4*>(sw + r * kStageStride + c);
    *reinterpret_cast<uint4*>(static_cast<__half*>(out) + (row0 + r) * na + col0 + c) = u;
  }
}

// Per warp, a cp.async ring of whole k-tile rows of trellis words in shared memory (a register ring deep enough to
// cover DRAM latency spills: ncu put 24 % of the stall samples on each row's loads with one row in registers).
template <int kBits2>
struct OutSideRing {
  static constexpr int kRowBytes = kTilesPerHad * TileBits<kBits2>::kBytes;  // 8 tile records, dense
  static constexpr int kStages = kBits2 <= 8 ? 4 : 2;                        // <= 4 KB per warp
  static constexpr int kStageBytes = kXfWarps * kTile * kStageStride * 2;    // the output staging rows
  static constexpr int kSmem = kStageBytes + kXfWarps * kStages * kRowBytes;
};

template <int kBits2, bool kMul1>
__global__ void __launch_bounds__(kXfThreads, 2) reconstruct_output_side_kernel(const ReconstructArgs a, int rows_per_warp) {
  griddep_launch_dependents();  // an input transform launched behind us may fill the SMs our last wave leaves idle
  using TB = TileBits<kBits2>;
  using R = OutSideRing<kBits2>;
  extern __shared__ __align__(16) unsigned char smem[];  // [staged output rows][per-warp rings]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;
  const int group = blockIdx.x;
  const int kt_lo = (blockIdx.y * kXfWarps + warp) * rows_per_warp;
  const int kt_hi = min(kt_lo + rows_per_warp, a.kb_count * kTilesPerHad);
  if (kt_lo >= kt_hi) return;  // warp-uniform; no block-wide barriers below

  const unsigned char* rows = reinterpret_cast<const unsigned char*>(
      a.w.data + static_cast<long long>(a.kb0) * kTilesPerHad * a.w.row_stride +
      static_cast<long long>(a.g0 + group) * kTilesPerHad * a.w.tile_stride);
  const long long row_bytes = a.w.row_stride * 2;
  const int tile_bytes = a.w.tile_stride * 2;
  const unsigned char* ring = smem + R::kStageBytes + warp * R::kStages * R::kRowBytes;
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  auto issue = [&](int kt) {  // row kt's 8 tile records into its slot; one commit group per call, even if empty
    if (kt < kt_hi) {
      const uint32_t slot = ring_s + (kt % R::kStages) * R::kRowBytes;
#pragma unroll
      for (int c = lane; c < R::kRowBytes / 16; c += kWarp)
        cp_async16(slot + c * 16, rows + kt * row_bytes + (c / TB::kChunks16) * tile_bytes + (c % TB::kChunks16) * 16);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < R::kStages - 1; ++s) issue(kt_lo + s);

  LaneWindows<kBits2> lw;
  lw.init(lane);
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);
  uint32_t hb[kTilesPerHad][2][2];
  svh_operands(static_cast<const __half*>(a.svh) + (a.g0 + group) * kHadBlock, g, t, hb);
  const long long na = static_cast<long long>(a.groups) * kHadBlock;
  __half* const sw = reinterpret_cast<__half*>(smem) + warp * kTile * kStageStride;
  uint32_t* const sw_lane = reinterpret_cast<uint32_t*>(sw + g * kStageStride + 2 * t);
  for (int kt = kt_lo; kt < kt_hi; ++kt) {
    cp_async_wait<R::kStages - 2>();  // row kt has landed (this lane's part) ...
    __syncwarp();                     // ... and every lane's; and every lane is done with the slot refilled next
    issue(kt + R::kStages - 1);
    const unsigned char* st = ring + (kt % R::kStages) * R::kRowBytes;
    uint32_t pw[kTilesPerHad][kLanePositions / 2];  // the row's 8 tiles of Ŵ, fragment order
#pragma unroll
    for (int nt = 0; nt < kTilesPerHad; ++nt) {
      uint32_t w[TB::kLoadWords];
#pragma unroll
      for (int i = 0; i < TB::kLoadWords; ++i) w[i] = lds32(st + nt * TB::kBytes + lw.word_byte[i]);
      rounded_pairs<kBits2, kMul1>(lw, w, mul, add, pw[nt]);
    }
    butterfly8(pw);
    transpose_tiles(pw);
    if (a.out_dtype == kActBF16) stage_row<__nv_bfloat16>(pw, hb, sw_lane);
    else stage_row<__half>(pw, hb, sw_lane);
    __syncwarp();
    store_staged_rows(sw, a.out, static_cast<long long>(kt) * kTile, na, group * kHadBlock, lane);
    __syncwarp();
  }
  // Launched behind the input transform with programmatic dependent launch, this kernel runs beside it (it needs
  // nothing from it) but must not complete before it: the GEMM that follows in the stream reads both. (Launched
  // first, there is nothing to wait for.)
  griddep_wait();
}

// ------------------------------------------------------------------------------------------------------------
// Reconstruct in the original basis, W = diag(suh) H Ŵ H diag(svh) / 128, one 128x128 block per CTA: what x itself
// multiplies, so a call needs no input transform. From a quarter as many rows as output columns (`auto`) that
// transform (rows x K values in and out) costs more than this kernel's extra work over the output-side one
// (bench/NOTES.md, "Path crossovers").
// Two phases around one exchange of the block in fp16 (34 KB of shared memory):
// * k side, warp w = tile column w: decode its 8 k-tiles, H16 inside each tile on the tensor cores (the decoded
//   fragment of Ŵ^T, an A operand, is pair for pair the B operand of Ŵ; H16 is symmetric, so one set of registers
//   is its A operand), the 8-point butterfly across the k-tiles in fp32, the row scales suh[k] / 16, one rounding
//   to fp16 into the exchange.
// * n side, warp w = k-tile row w: the row's 8 tiles come back as A operands (ldmatrix), then exactly the output-side
//   kernel's steps: the butterfly across the tile columns on fp16 pairs, H16 diag(svh) / 8 on the tensor cores,
//   staged in the warp's own (already consumed) rows of the exchange and written as whole 256-byte rows.
// ------------------------------------------------------------------------------------------------------------
// Three CTAs per SM (80 registers) take less time than two (bench/NOTES.md, "Kernel design measurements").
#ifndef EXL3_ORIG_MIN_BLOCKS  // tuning (bench VARIANTS): CTAs per SM the register budget allows
#define EXL3_ORIG_MIN_BLOCKS 3
#endif

template <int kBits2, bool kMul1>
__global__ void __launch_bounds__(kXfThreads, EXL3_ORIG_MIN_BLOCKS) reconstruct_original_kernel(const ReconstructArgs a) {
  using TB = TileBits<kBits2>;
  static_assert(kXfWarps == kTilesPerHad, "one warp per tile column, then per k-tile row, of a 128x128 block");
  __shared__ __align__(16) __half xchg[kHadBlock * kStageStride];  // k rows x n columns of the block
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
  const __half* suh = static_cast<const __half*>(a.suh) + (a.kb0 + kb) * kHadBlock;

  uint32_t* const x_lane = reinterpret_cast<uint32_t*>(xchg + g * kStageStride + warp * kTile + 2 * t);
  const uint32_t h0 = had16_pair(g, 2 * t), h1 = had16_pair(g + 8, 2 * t), h2 = had16_pair(g, 2 * t + 8),
                 h3 = had16_pair(g + 8, 2 * t + 8);
  // k side: acc[kt] = H16 . tile kt for tile columns 0-7 (pairs 0, 1 as B) and 8-15 (pairs 2, 3): rows (g, g+8) x
  // columns (2t, 2t+1) of each, in the MMA result order. Then the butterfly across the k-tiles in fp32.
  {
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
    // Rows kt * 16 + g and + 8 of the block, scaled by suh / 16 (the 1/128 of the two Hadamards: 1/16 here, 1/8 in
    // the n side's operand), rounded once.
#pragma unroll
    for (int kt = 0; kt < kTilesPerHad; ++kt) {
      const float s0 = __half2float(suh[kt * kTile + g]) * kReconInputScale;
      const float s8 = __half2float(suh[kt * kTile + g + 8]) * kReconInputScale;
      const float(&d)[8] = acc[kt];
      uint32_t* const r0 = x_lane + kt * kTile * kStageStride / 2;
      uint32_t* const r8 = r0 + 8 * kStageStride / 2;
      r0[0] = to_act2(d[0] * s0, d[1] * s0, static_cast<__half*>(nullptr));
      r8[0] = to_act2(d[2] * s8, d[3] * s8, static_cast<__half*>(nullptr));
      r0[4] = to_act2(d[4] * s0, d[5] * s0, static_cast<__half*>(nullptr));
      r8[4] = to_act2(d[6] * s8, d[7] * s8, static_cast<__half*>(nullptr));
    }
  }
  __syncthreads();

  // n side: k-tile row `warp`. ldmatrix lane l gives the address of row l % 8 (+ 8 for lanes 8-15 and 24-31) and
  // 8-column half l / 16 of each tile: registers 0-3 are then the A operand's (g, 2t), (g+8, 2t), (g, 2t+8),
  // (g+8, 2t+8) pairs.
  __half* const sw = xchg + warp * kTile * kStageStride;
  uint32_t at[kTilesPerHad][kLanePositions / 2];
  {
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(
        sw + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kStageStride + 8 * (lane >> 4)));
#pragma unroll
    for (int nt = 0; nt < kTilesPerHad; ++nt) ldmatrix_x4(at[nt], base + nt * kTile * 2);
  }
  butterfly8(at);
  uint32_t hb[kTilesPerHad][2][2];
  svh_operands(static_cast<const __half*>(a.svh) + (a.g0 + group) * kHadBlock, g, t, hb);
  __syncwarp();  // every lane's ldmatrix is done before the rows are reused for the output
  uint32_t* const sw_lane = reinterpret_cast<uint32_t*>(sw + g * kStageStride + 2 * t);
  if (a.out_dtype == kActBF16) stage_row<__nv_bfloat16>(at, hb, sw_lane);
  else stage_row<__half>(at, hb, sw_lane);
  __syncwarp();
  const long long na = static_cast<long long>(a.groups) * kHadBlock;
  store_staged_rows(sw, a.out, static_cast<long long>(kb) * kHadBlock + warp * kTile, na, group * kHadBlock, lane);
}

cudaError_t launch_reconstruct(const ReconstructArgs& a, bool pdl, cudaStream_t stream) {
  if (a.kb_count <= 0 || a.groups <= 0) return cudaSuccess;
  const int kt_total = a.kb_count * kTilesPerHad;
  cudaError_t err = cudaErrorInvalidValue;
  auto go = [&](auto b2) {
    constexpr int kB = decltype(b2)::value;
    constexpr bool kHas3InstMcg = kB % 2 == 0;  // 3inst/mcg exist for integer widths only
    if (a.w.codebook != kCbMul1 && !kHas3InstMcg) return;
    if (a.suh) {
      if (!a.svh) return;
      const void* fn = reinterpret_cast<const void*>(&reconstruct_original_kernel<kB, true>);
      if constexpr (kHas3InstMcg)
        if (a.w.codebook != kCbMul1) fn = reinterpret_cast<const void*>(&reconstruct_original_kernel<kB, false>);
      void* args[] = {const_cast<ReconstructArgs*>(&a)};
      err = launch_kernel(fn, dim3(a.groups, a.kb_count), dim3(kXfThreads), 0, false, stream, args);
      return;
    }
    if (a.svh) {
      // Up to 4 k-tile rows per warp, fewer when that would leave under ~2048 warps (small layers).
      int rows_per_warp = std::max(1, std::min(EXL3_OUT_SIDE_ROWS, kt_total * a.groups / 2048));
      const void* fn = reinterpret_cast<const void*>(&reconstruct_output_side_kernel<kB, true>);
      if constexpr (kHas3InstMcg)
        if (a.w.codebook != kCbMul1) fn = reinterpret_cast<const void*>(&reconstruct_output_side_kernel<kB, false>);
      // A host-side attribute (not a stream operation): cheap, and allowed during graph capture.
      if ((err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, OutSideRing<kB>::kSmem)) !=
          cudaSuccess)
        return;
      const dim3 grid(a.groups, (kt_total + kXfWarps * rows_per_warp - 1) / (kXfWarps * rows_per_warp));
      void* args[] = {const_cast<ReconstructArgs*>(&a), &rows_per_warp};
      err = launch_kernel(fn, grid, dim3(kXfThreads), OutSideRing<kB>::kSmem, pdl, stream, args);
      return;
    } else {
      const dim3 grid(a.groups * kTilesPerHad / kXfWarps, (kt_total + kReconRows - 1) / kReconRows);
      if (a.w.codebook == kCbMul1) reconstruct_kernel<kB, true><<<grid, kXfThreads, 0, stream>>>(a);
      else if constexpr (kHas3InstMcg) reconstruct_kernel<kB, false><<<grid, kXfThreads, 0, stream>>>(a);
    }
    err = cudaGetLastError();
  };
  EXL3_DISPATCH_BITS2(a.w.bits2, go)
  return err;
}

}  // namespace exl3

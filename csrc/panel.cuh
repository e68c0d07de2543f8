// Panel GEMM for mid-size batches (17..~128 rows): y = x · W with each EXL3 tile decoded once per 64 activation rows
// (the skinny kernel decodes it once per 16). Included by panel.cu only.
//
// Design (bench/NOTES.md has the numbers behind it):
// * A block computes a panel of one 128-column group x 64 rows over a stream-K range of k-tiles (the same units and
//   split-K partial slots as the skinny kernel, stream_k.cuh). Warp w owns tile column w of the group for the whole
//   range, so no cross-warp reduction: its sums go straight to the block's fp32 panel at the end of a segment.
// * The block streams each k-tile row of the group (8 tiles) and the chunk's 64 activation rows through one shared
//   cp.async ring, several k-tiles deep; a block barrier per k-tile hands stages over (a tile is decoded by one warp
//   only, the activations are read by all eight).
// * Per k-tile a lane decodes the 8 weights of its fragment once, rounds them to Ŵ pairs (the A operand) and runs
//   one mma.m16n8k16 per 8 valid rows: decode cost per weight falls with the row count while the tensor pipe,
//   idle in the skinny kernel, takes the rows. (The skinny kernel's codeword form would need two MMAs and four
//   byte permutes per 8 rows; with many rows that costs more than the rounding it saves.)
#pragma once

#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"
#include "stream_k.cuh"

namespace exl3 {

constexpr int kPanelRows = 64;                  // activation rows per row chunk
constexpr int kPanelGroups = kPanelRows / 8;    // MMA row groups (n8)

template <int kBits2>
struct PanelTraits {
  using TB = TileBits<kBits2>;
  static constexpr int kRows = kPanelRows;
  static constexpr int kItemBytes = kTilesPerHad * TB::kBytes;  // one k-tile row of the column group
  static constexpr int kXRowBytes = kTile * 2 + 16;  // padded: the fragment reads (8 rows x 4 lanes) hit 32 banks
  static constexpr int kStageBytes = kItemBytes + kRows * kXRowBytes;
  static constexpr int kStages = 4;
  static constexpr int kBufStride = kHadBlock + 4;  // floats
  static constexpr int kBufBytes = kRows * kBufStride * 4;
  // 44-78 KB: under the 99 KB per block of sm_12x (DGX Spark) for every width.
  static constexpr int kSmemBytes = kStages * kStageBytes + kBufBytes + 16;
  static_assert(kSmemBytes <= 96 * 1024, "shared memory per block (sm_12x: 99 KB)");
  static constexpr int kTileChunks = kTilesPerHad * TB::kChunks16;  // 16-byte copies per stage: tiles
  static constexpr int kTileCopies = (kTileChunks + kGemmThreads - 1) / kGemmThreads;
  static_assert(kRows * 2 <= kGemmThreads, "one activation chunk per thread");
};

template <int kBits2, bool kMul1>
__global__ void __launch_bounds__(kGemmThreads, 2) panel_kernel(const SkinnyArgs a, const int units) {
  using T = PanelTraits<kBits2>;
  using TB = typename T::TB;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g8 = lane >> 2, c4 = lane & 3;
  float* buf = reinterpret_cast<float*>(smem + T::kStages * T::kStageBytes);
  int* last_flag = reinterpret_cast<int*>(smem + T::kStages * T::kStageBytes + T::kBufBytes);
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  const int kta = a.kb_count * kTilesPerHad;
  const int u_begin = floor_muldiv(blockIdx.x, units, gridDim.x);
  const int u_end = floor_muldiv(blockIdx.x + 1, units, gridDim.x);
  const long long xh_stride = static_cast<long long>(a.kb_count) * kHadBlock;
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);

  // Copies of unit u into stage `slot`: thread t copies tile chunks t, t + 256, ... and activation chunk t (row
  // t / 2, half t % 2) when that row is valid (padding rows stay stale: an MMA output row depends on its own
  // activation row only, and padding rows are dropped).
  auto copy_tiles = [&](int u, int slot) {
    const int rg = fast_div(u, a.kta_div), kt = u - rg * kta;
    const int16_t* src = a.w.data + (static_cast<long long>(a.kb0) * kTilesPerHad + kt) * a.w.row_stride +
                         static_cast<long long>(a.g0 + fast_mod(rg, a.groups_div)) * kTilesPerHad * a.w.tile_stride;
    const uint32_t dst = ring + slot * T::kStageBytes;
#pragma unroll
    for (int i = 0; i < T::kTileCopies; ++i) {
      const int c = threadIdx.x + i * kGemmThreads;
      if (T::kTileChunks % kGemmThreads == 0 || c < T::kTileChunks)
        cp_async16(dst + c * 16, src + (c / TB::kChunks16) * a.w.tile_stride + (c % TB::kChunks16) * 8);
    }
  };
  auto copy_x = [&](int u, int slot) {
    const int rg = fast_div(u, a.kta_div), kt = u - rg * kta;
    const int chunk = fast_div(rg, a.groups_div);
    const int row = threadIdx.x / 2;
    if (row < min(T::kRows, a.rows - chunk * T::kRows))
      cp_async16(ring + slot * T::kStageBytes + T::kItemBytes + row * T::kXRowBytes + (threadIdx.x % 2) * 16,
                 static_cast<const __half*>(a.xh) + (chunk * T::kRows + row) * xh_stride + kt * kTile +
                     (threadIdx.x % 2) * 8);
  };

  LaneWindows<kBits2, kMul1> lw;
  lw.init(lane);

  // Prologue: the weights do not depend on the previous kernel and stream first; the activations (written by the
  // input-transform kernel) follow once it has finished.
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (u_begin + s < u_end) copy_tiles(u_begin + s, s);
    cp_async_commit();
  }
  griddep_wait();
  for (int s = 0; s < T::kStages - 1; ++s)
    if (u_begin + s < u_end) copy_x(u_begin + s, s);
  cp_async_commit();
  cp_async_wait<0>();  // once: from here on each stage's tiles and activations share one commit group

  int slot = 0;
  for (int seg = u_begin; seg < u_end;) {
    const int rg_seg = fast_div(seg, a.kta_div);
    const int seg_end = min(u_end, (rg_seg + 1) * kta);
    const int row0 = fast_div(rg_seg, a.groups_div) * T::kRows;
    const int valid_rows = min(T::kRows, a.rows - row0);
    const int row_groups = (valid_rows + 7) / 8;  // MMAs per tile; warp-uniform
    float acc[kPanelGroups][4];
#pragma unroll
    for (int rg = 0; rg < kPanelGroups; ++rg)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rg][e] = 0.f;

    for (int u = seg; u < seg_end; ++u) {
      cp_async_wait<T::kStages - 2>();
      __syncthreads();  // stage u has landed for every thread, and every warp is done with the slot refilled now
      const int pf = u + T::kStages - 1;
      const int pf_slot = slot == 0 ? T::kStages - 1 : slot - 1;
      if (pf < u_end) {
        copy_tiles(pf, pf_slot);
        copy_x(pf, pf_slot);
      }
      cp_async_commit();

      const unsigned char* st = smem + slot * T::kStageBytes;
      uint32_t wd[TB::kLoadWords];
#pragma unroll
      for (int i = 0; i < TB::kLoadWords; ++i) wd[i] = lds32(st + warp * TB::kBytes + lw.word_byte[i]);
      uint32_t s[kLanePositions], cw[kLanePositions];
      lw.states(wd, s);
#pragma unroll
      for (int j = 0; j < kLanePositions; ++j) cw[j] = codeword<kMul1>(s[j], mul, add);
      const uint32_t a0 = rounded_pair<kMul1>(cw[0], cw[1]), a1 = rounded_pair<kMul1>(cw[4], cw[5]);
      const uint32_t a2 = rounded_pair<kMul1>(cw[2], cw[3]), a3 = rounded_pair<kMul1>(cw[6], cw[7]);
      const unsigned char* xs = st + T::kItemBytes + g8 * T::kXRowBytes + 4 * c4;
#pragma unroll
      for (int rg = 0; rg < kPanelGroups; ++rg) {
        if (rg < row_groups) {
          // Activation fragment: row 8*rg + lane/4 of the chunk, k = 2*(lane%4) + {0,1} and {8,9}.
          const unsigned char* xr = xs + rg * 8 * T::kXRowBytes;
          mma_16816(acc[rg], a0, a1, a2, a3, lds32(xr), lds32(xr + 16));
        }
      }
      slot = slot + 1 == T::kStages ? 0 : slot + 1;
    }

    // This warp's tile column into the block's panel: C fragment c0/c1 = rows 8rg + 2c4 + {0,1} at column g8 of the
    // tile, c2/c3 the same rows at column g8 + 8. Padding rows are never written.
    __syncthreads();  // the previous segment's finish is done with buf
#pragma unroll
    for (int rg = 0; rg < kPanelGroups; ++rg) {
      const int r = rg * 8 + 2 * c4;
      float* p = buf + r * T::kBufStride + warp * kTile + g8;
      if (r < valid_rows) p[0] = acc[rg][0], p[8] = acc[rg][2];
      if (r + 1 < valid_rows) p[T::kBufStride] = acc[rg][1], p[T::kBufStride + 8] = acc[rg][3];
    }
    __syncthreads();  // buf complete
    finish_segment<T::kRows, T::kBufStride, false>(a, units, buf, last_flag, seg, seg_end, valid_rows);
    seg = seg_end;
  }
}

// Host side of one instantiation.
template <int kBits2, bool kMul1>
GemmKernel panel_kernel_ref() {
  return {reinterpret_cast<const void*>(&panel_kernel<kBits2, kMul1>), PanelTraits<kBits2>::kSmemBytes};
}

// Per-codebook/width lookup (panel.cu).
GemmKernel panel_kernel_for(int codebook, int bits2);

}  // namespace exl3

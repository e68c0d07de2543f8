// Panel GEMM for mid-size batches (`auto` on the H200: 17-64 rows, 9-16 for layers whose W' fits in L2; up to 256
// on sm_12x): y = x · W with each EXL3 tile decoded once per 64 activation rows (the skinny kernel decodes it once
// per 16). Included by panel.cu only.
//
// Design (the numbers behind it: bench/notes/kernels-v3.md "v3 (same session): the panel kernel"):
// * A block computes a panel of one 128-column group x 64 rows over a stream-K range of k-tiles (the same units and
//   split-K partial slots as the skinny kernel, stream_k.cuh). Warp w owns tile column w of the group for the whole
//   range, so no cross-warp reduction: its sums go straight to the block's fp32 panel at the end of a segment.
// * The block streams the k-tile rows of the group (8 tiles each) and the chunk's 64 activation rows through one
//   shared cp.async ring, several stages of 1-4 k-tiles deep; a block barrier per stage hands stages over (a tile is
//   decoded by one warp only, the activations are read by all eight).
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
  static constexpr int kXBytes = kRows * kXRowBytes;  // the chunk's activations for one k-tile
  static constexpr int kBufStride = kHadBlock + 4;   // floats
  static constexpr int kBufBytes = kRows * kBufStride * 4;
  // A stage holds kK consecutive k-tiles (its barrier, waits and copy set-up are paid once for all of them): the
  // deepest of 4/2/1 k-tiles with 4, else 3 stages that fits 96 KB with the panel, under the 99 KB per block of
  // sm_12x (DGX Spark).
  static constexpr int kBudget = 96 * 1024 - kBufBytes - 16;
  static constexpr bool fits(int k, int stages) { return stages * k * (kItemBytes + kXBytes) <= kBudget; }
  static constexpr int kK = fits(4, 3) ? 4 : fits(2, 3) ? 2 : 1;
  static constexpr int kStages = fits(kK, 4) ? 4 : 3;
  static_assert(fits(kK, kStages), "shared memory per block");
  static constexpr int kStageBytes = kK * (kItemBytes + kXBytes);  // kK tile rows, then kK activation blocks
  static constexpr int kSmemBytes = kStages * kStageBytes + kBufBytes + 16;
  static constexpr int kTileChunks = kTilesPerHad * TB::kChunks16;  // 16-byte copies per k-tile: tiles
  static constexpr int kTileCopies = (kTileChunks + kGemmThreads - 1) / kGemmThreads;
  static_assert(kRows * 2 <= kGemmThreads, "one activation chunk per thread and k-tile");
};

template <int kBits2, bool kMul1>
__global__ void __launch_bounds__(kGemmThreads, 2) panel_kernel(const GemmArgs a, const int units) {
  using T = PanelTraits<kBits2>;
  using TB = typename T::TB;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g8 = lane >> 2, c4 = lane & 3;
  float* buf = reinterpret_cast<float*>(smem + T::kStages * T::kStageBytes);
  int* last_flag = reinterpret_cast<int*>(smem + T::kStages * T::kStageBytes + T::kBufBytes);

  const int kta = a.kb_count * kTilesPerHad;
  const int u_begin = floor_muldiv(blockIdx.x, units, gridDim.x);
  const int u_end = floor_muldiv(blockIdx.x + 1, units, gridDim.x);
  const long long xh_stride = static_cast<long long>(a.kb_count) * kHadBlock;
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);

  // The block's stages in order: up to kK consecutive units of one segment (a maximal run of units in one column
  // group of one row chunk). Divisions happen once per segment.
  struct Stage {
    int u, n, seg_end;   // units [u, u + n) of the segment ending at seg_end; u = INT_MAX past the block's range
    int xrows;           // valid rows of the row chunk
    const int16_t* src;  // first tile of unit u's k-tile row in the column group
    const __half* xsrc;  // first activation row of the row chunk at unit u's k-tile
  };
  auto locate = [&](int s, Stage& st) {
    if (s >= u_end) {
      st.u = INT_MAX, st.n = 0;
      return;
    }
    const int rg = fast_div(s, a.kta_div), kt = s - rg * kta, chunk = fast_div(rg, a.groups_div);
    st.u = s;
    st.seg_end = min(u_end, (rg + 1) * kta);
    st.n = min(T::kK, st.seg_end - s);
    st.xrows = min(T::kRows, a.rows - chunk * T::kRows);
    st.src = a.w.data + (static_cast<long long>(a.kb0) * kTilesPerHad + kt) * a.w.row_stride +
             static_cast<long long>(a.g0 + (rg - chunk * a.groups)) * kTilesPerHad * a.w.tile_stride;
    st.xsrc = static_cast<const __half*>(a.xh) + chunk * T::kRows * xh_stride + kt * kTile;
  };
  auto next = [&](Stage& st) {
    const int s = st.u + st.n;
    if (s < st.seg_end) {
      st.src += st.n * a.w.row_stride;
      st.xsrc += st.n * kTile;
      st.u = s;
      st.n = min(T::kK, st.seg_end - s);
    } else {
      locate(s, st);
    }
  };

  // Per-thread copy offsets, fixed for the kernel: thread t copies tile chunks t, t + 256, ... of each k-tile row
  // and activation chunk t (row t / 2, half t % 2) when that row is valid (padding rows stay stale: an MMA output
  // row depends on its own activation row only, and padding rows are dropped).
  int copy_src[T::kTileCopies];
#pragma unroll
  for (int i = 0; i < T::kTileCopies; ++i) {
    const int c = threadIdx.x + i * kGemmThreads;
    copy_src[i] = pin((c / TB::kChunks16) * a.w.tile_stride + (c % TB::kChunks16) * 8);
  }
  const int x_row = threadIdx.x / 2;
  const long long x_src = x_row * xh_stride + (threadIdx.x % 2) * 8;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t tile_dst = pin(ring + threadIdx.x * 16);
  const uint32_t x_dst = pin(ring + T::kK * T::kItemBytes + x_row * T::kXRowBytes + (threadIdx.x % 2) * 16);
  auto copy_tiles = [&](const Stage& st, int slot) {
    for (int j = 0; j < st.n; ++j)
#pragma unroll
      for (int i = 0; i < T::kTileCopies; ++i)
        if (T::kTileChunks % kGemmThreads == 0 || threadIdx.x + i * kGemmThreads < T::kTileChunks)
          cp_async16(tile_dst + slot * T::kStageBytes + j * T::kItemBytes + i * kGemmThreads * 16,
                     st.src + j * a.w.row_stride + copy_src[i]);
  };
  auto copy_x = [&](const Stage& st, int slot) {
    if (x_row < st.xrows)
      for (int j = 0; j < st.n; ++j)
        cp_async16(x_dst + slot * T::kStageBytes + j * T::kXBytes, st.xsrc + x_src + j * kTile);
  };

  LaneWindows<kBits2, kMul1> lw;
  lw.init(lane);

  // Prologue: the weights do not depend on the previous kernel and stream first; the activations (written by the
  // input-transform kernel) follow once it has finished.
  Stage cur, pf;
  locate(u_begin, cur);
  pf = cur;
  for (int s = 0; s < T::kStages - 1; ++s) {
    copy_tiles(pf, s);
    cp_async_commit();
    next(pf);
  }
  griddep_wait();
  {
    Stage q = cur;
    for (int s = 0; s < T::kStages - 1; ++s) {
      copy_x(q, s);
      next(q);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();  // once: from here on each stage's tiles and activations share one commit group

  int slot = 0, pf_slot = T::kStages - 1;
  while (cur.u != INT_MAX) {
    const int seg = cur.u, seg_end = cur.seg_end, valid_rows = cur.xrows;
    const int row_groups = (valid_rows + 7) / 8;  // MMAs per tile; block-uniform
    float acc[kPanelGroups][4];
#pragma unroll
    for (int rg = 0; rg < kPanelGroups; ++rg)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rg][e] = 0.f;

    bool last;
    do {
      cp_async_wait<T::kStages - 2>();
      __syncthreads();  // this stage has landed for every thread, and every warp is done with the slot refilled now
      copy_tiles(pf, pf_slot);
      copy_x(pf, pf_slot);
      cp_async_commit();
      next(pf);
      pf_slot = pf_slot + 1 == T::kStages ? 0 : pf_slot + 1;

      const unsigned char* st = smem + slot * T::kStageBytes;
      for (int j = 0; j < cur.n; ++j) {
        uint32_t wd[TB::kLoadWords];
#pragma unroll
        for (int i = 0; i < TB::kLoadWords; ++i)
          wd[i] = lds32(st + j * T::kItemBytes + warp * TB::kBytes + lw.word_byte[i]);
        // lane_codewords written out: exl3_decode.cuh says why, above it.
        uint32_t s[kLanePositions], cw[kLanePositions];
        lw.states(wd, s);
#pragma unroll
        for (int p = 0; p < kLanePositions; ++p) cw[p] = codeword<kMul1>(s[p], mul, add);
        const uint32_t a0 = rounded_pair<kMul1>(cw[0], cw[1]), a1 = rounded_pair<kMul1>(cw[4], cw[5]);
        const uint32_t a2 = rounded_pair<kMul1>(cw[2], cw[3]), a3 = rounded_pair<kMul1>(cw[6], cw[7]);
        // Activation fragment of row group rg: row 8*rg + lane/4 of the chunk, k = 2*(lane%4) + {0,1}, {8,9}.
        const unsigned char* xs = st + T::kK * T::kItemBytes + j * T::kXBytes + g8 * T::kXRowBytes + 4 * c4;
#pragma unroll
        for (int rg = 0; rg < kPanelGroups; ++rg) {
          if (rg < row_groups) {
            const unsigned char* xr = xs + rg * 8 * T::kXRowBytes;
            mma_16816(acc[rg], a0, a1, a2, a3, lds32(xr), lds32(xr + 16));
          }
        }
      }
      slot = slot + 1 == T::kStages ? 0 : slot + 1;
      last = cur.u + cur.n >= seg_end;
      next(cur);
    } while (!last);

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
    // (The segment's indices recomputed here rather than kept from its start: fewer live registers in the loop.)
    const int rg_seg = fast_div(seg, a.kta_div), chunk = fast_div(rg_seg, a.groups_div);
    finish_segment<T::kRows, T::kBufStride, false>(a, units, buf, last_flag, seg, seg_end, rg_seg,
                                                   rg_seg - chunk * a.groups, chunk * T::kRows, valid_rows,
                                                   a.kb_count * kTilesPerHad, threadIdx.x / kWarp,
                                                   threadIdx.x % kWarp);
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

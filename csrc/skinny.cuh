// Skinny GEMM for decode batches: y = x · W for 1..16 activation rows per row chunk, EXL3 tiles decoded in
// registers and fed to tensor cores. Included by one translation unit per codebook family.
//
// Design (the numbers behind it: bench/notes/kernels-v1.md "Design choices and why", kernels-v2.md):
// * Transposed product: each decoded 16x16 tile is the *A* operand (W^T, m16 x k16) of mma.m16n8k16 and eight
//   activation rows are B (k16 x n8). The format's tile order is exactly the A-fragment order (§1.4), so a lane
//   decodes the 8 weights it feeds and nothing moves between lanes.
// * Duplicated activations: a tile's codeword registers go to the tensor cores as they are (one weight per 32-bit
//   register, two fp16 halves that sum to the weight), against activations duplicated into both halves. That
//   drops the pack/round instructions from the decode (integer issue is the bottleneck on Hopper) at the price of
//   a second MMA per tile, which the idle tensor pipe absorbs. For mul1 the half holds 1024 + bytesum and the
//   affine step is applied once per output: z = inv_scale * acc + bias * sum_k(xh).
// * Work split: the (row chunk, 128-column group, k-tile) space is cut into equal contiguous ranges, one per block
//   (stream-K), so every SM gets the same number of tiles for any shape. Eight warps of a block split the k-tiles
//   of each column group they visit; each warp streams its tiles *and* the matching activations through a private
//   cp.async ring (several k-tiles deep: loads are latency-bound otherwise). A block that holds only part of a
//   column group parks its partial sum in its own fp32 slot; the block that completes the group (counter) sums
//   the slots in a fixed order (deterministic, no float atomics), then applies the output Hadamard and svh
//   (stream_k.cuh, shared with the panel kernel). When there is enough work, each block owns whole groups and
//   writes directly.
#pragma once

#include <climits>
#include <type_traits>

#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"
#include "stream_k.cuh"

namespace exl3 {

#ifndef EXL3_SKINNY_INFLIGHT
#define EXL3_SKINNY_INFLIGHT 4096
#endif
// Bytes of trellis per warp in flight (bench/notes/kernels-v2.md "v2-run2", "v2-run4").
constexpr int kSkinnyInFlight = EXL3_SKINNY_INFLIGHT;
// Blocks per SM for 1-8 rows (9-16 rows: 2). Two blocks (16 warps, up to 128 registers) beat three (24 warps, 80
// registers) on the H200: with 80 registers ptxas serializes the decode of one tile into a single chain of four
// codewords per MMA, and the longer per-warp runs amortize the prologue (bench/NOTES.md, "Kernel design
// measurements").
// Overridable at build time for tuning runs.
#ifndef EXL3_SKINNY_MIN_BLOCKS
#define EXL3_SKINNY_MIN_BLOCKS 2
#endif
constexpr int kSkinnyMinBlocks1 = EXL3_SKINNY_MIN_BLOCKS;
constexpr int kSkinnySlotRows = 2;  // activation rows per pass of the cross-warp reduction

template <int kBits2, bool kMul1, int kMT, bool kDup>
struct SkinnyTraits {
  using TB = TileBits<kBits2>;
  static constexpr int kRows = 8 * kMT;                // activation rows per row chunk
  static constexpr int kNT = kTilesPerHad;             // a warp covers one 128-column group
  static constexpr int kItemBytes = kNT * TB::kBytes;  // one k-tile row of the group
  static constexpr int kXRowBytes = kTile * 2 + 16;    // one row of the k-tile's activations, padded: the
                                                       // fragment reads (8 rows x 4 lanes) then hit 32 banks
  static constexpr int kXBytes = kRows * kXRowBytes;
  static constexpr int kStageBytes = kItemBytes + kXBytes;
  static constexpr int kBufStride = kHadBlock + 4;  // floats; the padding makes fragment stores conflict-free
  static constexpr int kBufBytes = kRows * kBufStride * 4;
  // Cross-warp reduction: every warp parks kSkinnySlotRows rows of its partial sums at once, then all threads add
  // the eight slots in warp order (one pass per row pair instead of eight serial warp turns).
  static constexpr int kSlotBytes = kGemmWarps * kSkinnySlotRows * kBufStride * 4;
  static constexpr int kMinBlocks = kMT == 1 ? kSkinnyMinBlocks1 : 2;
  // Ring depth: kSkinnyInFlight bytes of tiles per warp, at least 4 stages, within the shared memory that lets
  // kMinBlocks blocks share a Hopper SM (228 KB, 1 KB reserved per block) and at most 96 KB, under the 99 KB per
  // block of sm_12x (DGX Spark).
  static constexpr int kSmemBudgetSm = (228 / kMinBlocks - 4) * 1024;
  static constexpr int kSmemBudget = kSmemBudgetSm < 96 * 1024 ? kSmemBudgetSm : 96 * 1024;
  static constexpr int kStagesRaw = 1 + (kSkinnyInFlight + kItemBytes - 1) / kItemBytes;
  static constexpr int kStagesFit = (kSmemBudget - kBufBytes - kSlotBytes - 16) / (kGemmWarps * kStageBytes);
  static constexpr int kStagesWanted = kStagesRaw > 12 ? 12 : kStagesRaw;
  static constexpr int kStagesCapped = kStagesWanted < kStagesFit ? kStagesWanted : kStagesFit;
  // At least 4: nvcc 13.0's cicc segfaults on the sm_121a build of a 3-stage ring (reproducible, sm_90a is fine);
  // the widest tiles then fit two blocks per SM instead of three.
  static constexpr int kStages = kStagesCapped < 4 ? 4 : kStagesCapped;
  static constexpr int kRingBytes = kGemmWarps * kStages * kStageBytes;
  static_assert(kRingBytes + kBufBytes + kSlotBytes + 16 <= 226 * 1024, "shared memory per block");
  static constexpr int kSmemBytes = kRingBytes + kBufBytes + kSlotBytes + 16;
  static constexpr int kCopyIters = (kNT * TB::kChunks16 + kWarp - 1) / kWarp;
  static constexpr int kXChunks = kRows * 2;           // two 16-byte chunks per activation row
  static_assert(kXChunks <= kWarp, "one x chunk per lane");
  static constexpr bool kAffineEpilogue = kMul1 && kDup;  // mul1 codewords carry 1024 + bytesum
};

// Shard of global column group gg (GemmShards::group_end, unused entries INT_MAX) and that shard's table entries,
// chosen by selects: a run-time index into the kernel-parameter arrays could put them in local memory.
struct ShardRef {
  int s, group_begin;
  const int16_t* data;
  long long row_stride;
  const void* svh;
};
__device__ __forceinline__ ShardRef shard_ref(const GemmShards& sh, int gg) {
  ShardRef r{0, 0, sh.data[0], sh.row_stride[0], sh.svh[0]};
#pragma unroll
  for (int i = 1; i < kMaxGroupShards; ++i)
    if (gg >= sh.group_end[i - 1]) r = {i, sh.group_end[i - 1], sh.data[i], sh.row_stride[i], sh.svh[i]};
  return r;
}
template <typename S>
__device__ __forceinline__ const S& shard_table(const S& s) {
  return s;
}

// 1-8 rows: kSkinnyMinBlocks1 blocks per SM; 9-16 rows need the registers of two.
// Shards: empty for one linear (the kernel as it always was: the grouped code below is `if constexpr` and drops
// out), or GemmShards for the grouped form (launch_gemm_group): the column groups of 2..kMaxGroupShards linears that
// share the input (attention q, k, v) in one stream-K space. Grouped, a.groups is their total, a.xh /
// a.rowsum_parts the first shard's (the others follow at xh_shard / rowsum_shard), a.w only gives the codebook, width
// and tile stride common to all shards, a.kb0 = a.g0 = 0, and y [rows, a.out_features] holds the shards side by
// side. A variadic pack rather than a flag keeps the one-linear kernels' parameters and code as they were.
template <int kBits2, bool kMul1, int kMT, bool kDup, typename... Shards>
__global__ void __launch_bounds__(kGemmThreads, kMT == 1 ? kSkinnyMinBlocks1 : 2)
    skinny_kernel(const GemmArgs a, const int units, const Shards... sh) {
  static_assert(sizeof...(Shards) <= 1, "at most one shard table");
  constexpr bool kGrouped = sizeof...(Shards) == 1;
  using T = SkinnyTraits<kBits2, kMul1, kMT, kDup>;
  using TB = typename T::TB;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g8 = lane >> 2, c4 = lane & 3;
  unsigned char* ring = smem + warp * T::kStages * T::kStageBytes;
  float* buf = reinterpret_cast<float*>(smem + T::kRingBytes);
  float* slots = reinterpret_cast<float*>(smem + T::kRingBytes + T::kBufBytes);
  int* last_flag = reinterpret_cast<int*>(smem + T::kRingBytes + T::kBufBytes + T::kSlotBytes);

  // Diagnostics: this warp's record {smid, entry, first data, last item done, exit} (native_linear_traced).
  unsigned long long* trace =
      a.trace ? a.trace + (static_cast<long long>(blockIdx.x) * kGemmWarps + warp) * 5 : nullptr;
  if (trace && lane == 0) trace[0] = sm_id(), trace[1] = global_ns();
  const int kta = a.kb_count * kTilesPerHad;  // active k-tiles
  const int u_begin = floor_muldiv(blockIdx.x, units, gridDim.x);
  const int u_end = floor_muldiv(blockIdx.x + 1, units, gridDim.x);
  const long long xh_stride = static_cast<long long>(a.kb_count) * kHadBlock;
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);

  // This warp's work items: every 8th k-tile of each segment (a maximal run of units in one column group of one
  // row chunk), segments in order. Divisions happen once per segment, not per item.
  struct Item {
    int u, seg_end;
    int xlanes;          // lanes that copy activations: two per valid row of the chunk (padding rows stay stale:
                         // an MMA output row depends on its own activation row only, and padding rows are dropped)
    const int16_t* src;  // first tile of this item's k-tile row in the column group
    const __half* xsrc;  // first activation row of the row chunk at this k-tile
  };
  struct ItemStep : Item {
    int step;  // grouped: int16 elements to this warp's next k-tile row (its shard's row stride x 8; 32 bits: one
               // register less in the main loop)
  };
  using It = std::conditional_t<kGrouped, ItemStep, Item>;
  const long long item_step = static_cast<long long>(kGemmWarps) * a.w.row_stride;
  auto locate = [&](int s, It& it) {  // first item of this warp at or after unit s
    it.u = INT_MAX;
    while (s < u_end) {
      const int rg = fast_div(s, a.kta_div), e = min(u_end, (rg + 1) * kta);
      if (s + warp < e) {
        const int kt = s + warp - rg * kta;
        it.u = s + warp;
        it.seg_end = e;
        if constexpr (kGrouped) {
          // Global column group -> its shard's trellis (own N tiles, row stride) and transformed input (own suh).
          const GemmShards& tab = shard_table(sh...);
          const int chunk = fast_div(rg, a.groups_div), gg = rg - chunk * a.groups;
          const ShardRef r = shard_ref(tab, gg);
          it.src = r.data + static_cast<long long>(kt) * r.row_stride +
                   static_cast<long long>(gg - r.group_begin) * kTilesPerHad * a.w.tile_stride;
          it.step = static_cast<int>(kGemmWarps * r.row_stride);
          it.xlanes = 2 * min(T::kRows, a.rows - chunk * T::kRows);
          it.xsrc = static_cast<const __half*>(a.xh) + r.s * tab.xh_shard + chunk * T::kRows * xh_stride + kt * kTile;
          return;
        }
        it.src = a.w.data + (static_cast<long long>(a.kb0) * kTilesPerHad + kt) * a.w.row_stride +
                 static_cast<long long>(a.g0 + fast_mod(rg, a.groups_div)) * kTilesPerHad * a.w.tile_stride;
        const int chunk = fast_div(rg, a.groups_div);
        it.xlanes = 2 * min(T::kRows, a.rows - chunk * T::kRows);
        it.xsrc = static_cast<const __half*>(a.xh) + chunk * T::kRows * xh_stride + kt * kTile;
        return;
      }
      s = e;
    }
  };
  auto advance = [&](It& it) {
    it.u += kGemmWarps;
    if constexpr (kGrouped) it.src += it.step;
    else it.src += item_step;
    it.xsrc += kGemmWarps * kTile;
    if (it.u >= it.seg_end) locate(it.seg_end, it);
  };
  // Each lane copies 16-byte chunks lane, lane + 32, ... of an item's tiles (packed in shared memory) and chunk
  // `lane` of its activations (row lane / 2, half lane % 2 of the 16 k). The per-lane offsets are fixed 32-bit
  // numbers computed here once (per-item address arithmetic was ~15 % of the loop's instructions).
  int copy_src[T::kCopyIters];
#pragma unroll
  for (int i = 0; i < T::kCopyIters; ++i) {
    const int c = lane + i * kWarp;
    copy_src[i] = (c / TB::kChunks16) * a.w.tile_stride + (c % TB::kChunks16) * 8;
  }
  int x_copy_src = (lane / 2) * static_cast<int>(xh_stride) + (lane % 2) * 8;
  uint32_t ring_lane = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 16;
  uint32_t x_lane = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + T::kItemBytes +
                    (lane / 2) * T::kXRowBytes + (lane % 2) * 16;
  // Pinned: ptxas would otherwise recompute them from the thread index in every iteration.
#pragma unroll
  for (int i = 0; i < T::kCopyIters; ++i) copy_src[i] = pin(copy_src[i]);
  x_copy_src = pin(x_copy_src);
  ring_lane = pin(ring_lane);
  x_lane = pin(x_lane);
  auto copy_tiles = [&](const It& it, int slot) {
    if (it.u == INT_MAX) return;
    const uint32_t dst = ring_lane + slot * T::kStageBytes;
#pragma unroll
    for (int i = 0; i < T::kCopyIters; ++i)
      if ((T::kNT * TB::kChunks16) % kWarp == 0 || lane + i * kWarp < T::kNT * TB::kChunks16)
        cp_async16(dst + i * kWarp * 16, it.src + copy_src[i]);
  };
  auto copy_x = [&](const It& it, int slot) {
    if (it.u != INT_MAX && lane < it.xlanes) cp_async16(x_lane + slot * T::kStageBytes, it.xsrc + x_copy_src);
  };

  // mul1 loads the FMA pipe (hash multiply + byte-sum dot product per weight): its window shifts go to the ALU.
  LaneWindows<kBits2, kMul1> lw;
  lw.init(lane);

  // Prologue: the weights do not depend on the previous kernel, so they stream before we wait for it; the
  // activations (written by the input-transform kernel) follow once it has finished.
  It pf;
  locate(u_begin, pf);
  for (int s = 0; s < T::kStages - 1; ++s) {
    copy_tiles(pf, s);
    cp_async_commit();
    if (pf.u != INT_MAX) advance(pf);
  }
  griddep_wait();  // xh, rowsum parts and the zeroed counters come from the input-transform kernel
  {
    It q;
    locate(u_begin, q);
    for (int s = 0; s < T::kStages - 1 && q.u != INT_MAX; ++s) {
      copy_x(q, s);
      advance(q);
    }
    cp_async_commit();
    cp_async_wait<0>();  // once: from here on each stage's tiles and activations share one commit group
    __syncwarp();
    if (trace && lane == 0) trace[2] = global_ns();
  }

  int slot = 0, pf_slot = T::kStages - 1;
  for (int seg = u_begin; seg < u_end;) {
    const int rg_seg = fast_div(seg, a.kta_div);
    const int seg_end = min(u_end, (rg_seg + 1) * kta);
    const int chunk = fast_div(rg_seg, a.groups_div), group = rg_seg - chunk * a.groups;
    float acc[T::kNT][kMT][4];
#pragma unroll
    for (int nt = 0; nt < T::kNT; ++nt)
#pragma unroll
      for (int rg = 0; rg < kMT; ++rg)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][rg][e] = 0.f;

    for (int u = seg + warp; u < seg_end; u += kGemmWarps) {
      cp_async_wait<T::kStages - 2>();
      __syncwarp();
      copy_tiles(pf, pf_slot);  // refills the slot consumed last iteration
      copy_x(pf, pf_slot);
      cp_async_commit();
      if (pf.u != INT_MAX) advance(pf);
      pf_slot = pf_slot + 1 == T::kStages ? 0 : pf_slot + 1;

      const unsigned char* st = ring + slot * T::kStageBytes;
      // Activation fragments: row 8*rg + lane/4 of the chunk, k = 2*(lane%4) + {0,1} and {8,9} of the k-tile.
      uint32_t b0[kMT][2], b1[kMT][2];  // dup: even / odd k of each pair; plain: b0 only
#pragma unroll
      for (int rg = 0; rg < kMT; ++rg) {
        const unsigned char* xs = st + T::kItemBytes + (rg * 8 + g8) * T::kXRowBytes + 4 * c4;
        const uint32_t x0 = lds32(xs), x1 = lds32(xs + 16);
        if constexpr (kDup) {
          b0[rg][0] = __byte_perm(x0, 0u, 0x1010);
          b0[rg][1] = __byte_perm(x1, 0u, 0x1010);
          b1[rg][0] = __byte_perm(x0, 0u, 0x3232);
          b1[rg][1] = __byte_perm(x1, 0u, 0x3232);
        } else {
          b0[rg][0] = x0;
          b0[rg][1] = x1;
        }
      }
#pragma unroll
      for (int nt = 0; nt < T::kNT; ++nt) {
        uint32_t w[TB::kLoadWords];
#pragma unroll
        for (int i = 0; i < TB::kLoadWords; ++i) w[i] = lds32(st + nt * TB::kBytes + lw.word_byte[i]);
        // lane_codewords written out: exl3_decode.cuh says why, above it.
        uint32_t s[kLanePositions], cw[kLanePositions];
        lw.states(w, s);
#pragma unroll
        for (int j = 0; j < kLanePositions; ++j) cw[j] = codeword<kMul1>(s[j], mul, add);
#pragma unroll
        for (int rg = 0; rg < kMT; ++rg) {
          if constexpr (kDup) {
            mma_16816(acc[nt][rg], cw[0], cw[4], cw[2], cw[6], b0[rg][0], b0[rg][1]);
            mma_16816(acc[nt][rg], cw[1], cw[5], cw[3], cw[7], b1[rg][0], b1[rg][1]);
          } else {
            mma_16816(acc[nt][rg], rounded_pair<kMul1>(cw[0], cw[1]), rounded_pair<kMul1>(cw[4], cw[5]),
                      rounded_pair<kMul1>(cw[2], cw[3]), rounded_pair<kMul1>(cw[6], cw[7]), b0[rg][0], b0[rg][1]);
          }
        }
      }
      slot = slot + 1 == T::kStages ? 0 : slot + 1;
    }

    if (trace && lane == 0) trace[3] = global_ns();
    // ---- segment epilogue: sum the warps' partials in shared memory (fixed warp order: deterministic) ----
    const int row0 = chunk * T::kRows;
    const int valid_rows = min(T::kRows, a.rows - row0);
    // One pass per pair of valid rows: the lanes holding rows r0, r0+1 (C fragment: c0/c1 rows 2*c4 + {0,1} at
    // column g8, c2/c3 the same rows at g8 + 8) park them in this warp's slot; then thread t adds up the eight
    // slots of output (r0 + t / 128, t % 128) in warp order. Padding rows of the chunk are never touched.
    static_assert(kGemmThreads == kSkinnySlotRows * kHadBlock, "one output per thread and pass");
    for (int r0 = 0; r0 < valid_rows; r0 += kSkinnySlotRows) {
      __syncthreads();  // the previous pass (or segment) is done with the slots and buf
#pragma unroll
      for (int rg = 0; rg < kMT; ++rg) {
        if (rg * 8 + 2 * c4 == r0) {
          float* p = slots + warp * kSkinnySlotRows * T::kBufStride + g8;
#pragma unroll
          for (int nt = 0; nt < T::kNT; ++nt) {
            p[nt * kTile] = acc[nt][rg][0], p[T::kBufStride + nt * kTile] = acc[nt][rg][1];
            p[nt * kTile + 8] = acc[nt][rg][2], p[T::kBufStride + nt * kTile + 8] = acc[nt][rg][3];
          }
        }
      }
      __syncthreads();
      const int r = threadIdx.x / kHadBlock, col = threadIdx.x % kHadBlock;
      if (r0 + r < valid_rows) {
        const float* q = slots + r * T::kBufStride + col;
        float sum = q[0];
#pragma unroll
        for (int w = 1; w < kGemmWarps; ++w) sum += q[w * kSkinnySlotRows * T::kBufStride];
        buf[(r0 + r) * T::kBufStride + col] = sum;
      }
    }
    __syncthreads();  // buf complete
    if constexpr (kGrouped) {
      // The shard's svh and row sums, its columns at its offset in y: with g0 = -group_begin the epilogue reads svh
      // at the shard's own column (group - group_begin) * 128 + ..., and with out_offset = -group_begin * 128 it
      // writes y at the global column (a.out_features and a.y_stride are y's full width). Partials and counters
      // stay indexed by the global (row chunk, group).
      const GemmShards& tab = shard_table(sh...);
      const ShardRef r = shard_ref(tab, group);
      GemmArgs b = a;
      b.svh = r.svh;
      b.rowsum_parts = a.rowsum_parts ? a.rowsum_parts + r.s * tab.rowsum_shard : nullptr;
      b.g0 = -r.group_begin;
      b.out_offset = -r.group_begin * kHadBlock;
      finish_segment<T::kRows, T::kBufStride, T::kAffineEpilogue>(b, units, buf, last_flag, seg, seg_end, rg_seg,
                                                                  group, row0, valid_rows, kta, warp, lane);
    } else
    finish_segment<T::kRows, T::kBufStride, T::kAffineEpilogue>(a, units, buf, last_flag, seg, seg_end, rg_seg, group,
                                                                 row0, valid_rows, kta, warp, lane);
    seg = seg_end;
  }
  if (trace && lane == 0) trace[4] = global_ns();
}

template <int kBits2, bool kMul1, int kMT, bool kDup>
GemmKernel skinny_kernel_ref() {
  return {reinterpret_cast<const void*>(&skinny_kernel<kBits2, kMul1, kMT, kDup>),
          SkinnyTraits<kBits2, kMul1, kMT, kDup>::kSmemBytes};
}

template <int kBits2, bool kMul1, int kMT, bool kDup>
GemmKernel skinny_group_kernel_ref() {
  return {reinterpret_cast<const void*>(&skinny_kernel<kBits2, kMul1, kMT, kDup, GemmShards>),
          SkinnyTraits<kBits2, kMul1, kMT, kDup>::kSmemBytes};
}

// Per-family lookup (one definition per translation unit). dup: duplicated-activation codeword path.
GemmKernel skinny_kernel_mul1(int bits2, int mt, bool dup);
GemmKernel skinny_kernel_3inst_mcg(int bits2, int mt, bool dup);
// The grouped kernels exist for the duplicated-activation path (the default; plain is a bench comparison) and 1-8
// rows (mt 1) only: at 9-16 rows (mt 2) the one-linear kernels are at their 128-register limit and the grouped ones
// spilled more (8-40 bytes of stack), so native_linear_group runs those row counts shard by shard.
GemmKernel skinny_group_kernel_mul1(int bits2, int mt);
GemmKernel skinny_group_kernel_3inst_mcg(int bits2, int mt);

}  // namespace exl3

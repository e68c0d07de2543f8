// Skinny GEMM for decode batches: y = x · W for 1..16 activation rows per row chunk, EXL3 tiles decoded in
// registers and fed to tensor cores. Included by one translation unit per codebook family.
//
// Design (bench/NOTES.md has the numbers behind it):
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
//   of each column group they visit; each warp streams its tiles through a private cp.async ring. Partial column
//   groups are added into an fp32 workspace with L2 atomics; the block that completes a group (counter) applies
//   the output Hadamard and svh. When there is enough work, each block owns whole groups and writes directly.
#pragma once

#include <climits>

#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"

namespace exl3 {

constexpr int kSkinnyWarps = 8;
constexpr int kSkinnyThreads = kSkinnyWarps * kWarp;
constexpr int kSkinnyInFlight = 3072;  // bytes of trellis each warp keeps in flight (see NOTES: ~48 KB per SM)

template <int kBits2, bool kMul1, int kMT, bool kDup>
struct SkinnyTraits {
  using TB = TileBits<kBits2>;
  static constexpr int kRows = 8 * kMT;                // activation rows per row chunk
  static constexpr int kNT = kTilesPerHad;             // a warp covers one 128-column group
  static constexpr int kItemBytes = kNT * TB::kBytes;  // one k-tile row of the group
  static constexpr int kStagesRaw = 1 + (kSkinnyInFlight + kItemBytes - 1) / kItemBytes;
  static constexpr int kStages = kStagesRaw < 3 ? 3 : (kStagesRaw > 10 ? 10 : kStagesRaw);
  static constexpr int kRingBytes = kSkinnyWarps * kStages * kItemBytes;
  static constexpr int kBufStride = kHadBlock + 4;  // floats; the padding makes fragment stores conflict-free
  static constexpr int kBufBytes = kRows * kBufStride * 4;
  static constexpr int kSmemBytes = kRingBytes + kBufBytes + 16;
  static constexpr int kCopyIters = (kNT * TB::kChunks16 + kWarp - 1) / kWarp;
  static constexpr bool kAffineEpilogue = kMul1 && kDup;  // mul1 codewords carry 1024 + bytesum
};

template <int kBits2, bool kMul1, int kMT, bool kDup>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    skinny_kernel(const SkinnyArgs a, const int units) {
  using T = SkinnyTraits<kBits2, kMul1, kMT, kDup>;
  using TB = typename T::TB;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g8 = lane >> 2, c4 = lane & 3;
  unsigned char* ring = smem + warp * T::kStages * T::kItemBytes;
  float* buf = reinterpret_cast<float*>(smem + T::kRingBytes);
  int* last_flag = reinterpret_cast<int*>(smem + T::kRingBytes + T::kBufBytes);

  const int kta = a.kb_count * kTilesPerHad;  // active k-tiles
  const int u_begin = static_cast<int>(static_cast<long long>(blockIdx.x) * units / gridDim.x);
  const int u_end = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * units / gridDim.x);
  const long long xh_stride = static_cast<long long>(a.kb_count) * kHadBlock;
  const uint32_t mul = codebook_mul(a.w.codebook), add = codebook_add(a.w.codebook);

  // This warp's work items: every 8th k-tile of each segment (a maximal run of units in one column group of one
  // row chunk), segments in order. Divisions happen once per segment, not per item.
  struct Item {
    int u, seg_end;
    const int16_t* src;  // first tile of this item's k-tile row in the column group
  };
  const long long item_step = static_cast<long long>(kSkinnyWarps) * a.w.row_stride;
  auto locate = [&](int s, Item& it) {  // first item of this warp at or after unit s
    it.u = INT_MAX;
    while (s < u_end) {
      const int rg = s / kta, e = min(u_end, (rg + 1) * kta);
      if (s + warp < e) {
        it.u = s + warp;
        it.seg_end = e;
        it.src = a.w.data + (static_cast<long long>(a.kb0) * kTilesPerHad + it.u - rg * kta) * a.w.row_stride +
                 static_cast<long long>(a.g0 + rg % a.groups) * kTilesPerHad * a.w.tile_stride;
        return;
      }
      s = e;
    }
  };
  auto advance = [&](Item& it) {
    it.u += kSkinnyWarps;
    it.src += item_step;
    if (it.u >= it.seg_end) locate(it.seg_end, it);
  };
  // Each lane copies 16-byte chunks lane, lane + 32, ... of an item (the 8 tiles' records, packed in shared memory).
  int copy_src[T::kCopyIters];
#pragma unroll
  for (int i = 0; i < T::kCopyIters; ++i) {
    const int c = lane + i * kWarp;
    copy_src[i] = (c / TB::kChunks16) * a.w.tile_stride + (c % TB::kChunks16) * 8;
  }
  auto issue_copy = [&](const Item& it, int slot) {
    if (it.u != INT_MAX) {
      unsigned char* dst = ring + slot * T::kItemBytes + lane * 16;
#pragma unroll
      for (int i = 0; i < T::kCopyIters; ++i)
        if ((T::kNT * TB::kChunks16) % kWarp == 0 || lane + i * kWarp < T::kNT * TB::kChunks16)
          cp_async16(dst + i * kWarp * 16, it.src + copy_src[i]);
    }
    cp_async_commit();  // empty groups keep the wait arithmetic uniform
  };

  LaneWindows<kBits2> lw;
  lw.init(lane);

  // Prologue: weights do not depend on the previous kernel, so start streaming them before waiting for it.
  Item pf;
  locate(u_begin, pf);
  for (int s = 0; s < T::kStages - 1; ++s) {
    issue_copy(pf, s);
    if (pf.u != INT_MAX) advance(pf);
  }
  griddep_wait();  // xh, rowsum parts and the zeroed workspace come from the input-transform kernel

  int slot = 0, pf_slot = T::kStages - 1;
  for (int seg = u_begin; seg < u_end;) {
    const int rg_seg = seg / kta;
    const int seg_end = min(u_end, (rg_seg + 1) * kta);
    const int chunk = rg_seg / a.groups, group = rg_seg % a.groups;
    float acc[T::kNT][kMT][4];
#pragma unroll
    for (int nt = 0; nt < T::kNT; ++nt)
#pragma unroll
      for (int rg = 0; rg < kMT; ++rg)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][rg][e] = 0.f;

    // Activation fragments: row (chunk*rows + 8*rg + lane/4), k = 16*kt + 2*(lane%4) + {0,1} and {8,9}. xh has
    // whole row chunks (rows past the input's are zero), so the loads need no predicates.
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(static_cast<const __half*>(a.xh) +
                                                           (chunk * T::kRows + g8) * xh_stride +
                                                           (seg - rg_seg * kta + warp) * kTile + 2 * c4);
    const long long rg_step = 8 * xh_stride / 2;       // uint32 between row groups
    constexpr int kXStep = kSkinnyWarps * kTile / 2;  // uint32 per item
    uint32_t xr_next[kMT][2];
    const int u_first = seg + warp;
    if (u_first < seg_end) {
#pragma unroll
      for (int rg = 0; rg < kMT; ++rg) xr_next[rg][0] = xp[rg * rg_step], xr_next[rg][1] = xp[rg * rg_step + 4];
    }
    for (int u = u_first; u < seg_end; u += kSkinnyWarps) {
      uint32_t xr[kMT][2];
#pragma unroll
      for (int rg = 0; rg < kMT; ++rg) xr[rg][0] = xr_next[rg][0], xr[rg][1] = xr_next[rg][1];
      xp += kXStep;
      if (u + kSkinnyWarps < seg_end) {
#pragma unroll
        for (int rg = 0; rg < kMT; ++rg) xr_next[rg][0] = xp[rg * rg_step], xr_next[rg][1] = xp[rg * rg_step + 4];
      }

      cp_async_wait<T::kStages - 2>();
      __syncwarp();
      issue_copy(pf, pf_slot);  // refills the slot consumed last iteration
      if (pf.u != INT_MAX) advance(pf);
      pf_slot = pf_slot + 1 == T::kStages ? 0 : pf_slot + 1;

      uint32_t b0[kMT][2], b1[kMT][2];  // dup: even / odd k of each pair; plain: b0 only
#pragma unroll
      for (int rg = 0; rg < kMT; ++rg) {
        if constexpr (kDup) {
          b0[rg][0] = __byte_perm(xr[rg][0], 0u, 0x1010);
          b0[rg][1] = __byte_perm(xr[rg][1], 0u, 0x1010);
          b1[rg][0] = __byte_perm(xr[rg][0], 0u, 0x3232);
          b1[rg][1] = __byte_perm(xr[rg][1], 0u, 0x3232);
        } else {
          b0[rg][0] = xr[rg][0];
          b0[rg][1] = xr[rg][1];
        }
      }
      const unsigned char* st = ring + slot * T::kItemBytes;
#pragma unroll
      for (int nt = 0; nt < T::kNT; ++nt) {
        uint32_t w[TB::kLoadWords];
#pragma unroll
        for (int i = 0; i < TB::kLoadWords; ++i) w[i] = lds32(st + nt * TB::kBytes + lw.word_byte[i]);
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

    // ---- segment epilogue: sum the warps' partials in shared memory (fixed order: deterministic) ----
    __syncthreads();  // the previous segment's epilogue is done with buf
#pragma unroll 1
    for (int round = 0; round < kSkinnyWarps; ++round) {
      if (warp == round) {
#pragma unroll
        for (int nt = 0; nt < T::kNT; ++nt)
#pragma unroll
          for (int rg = 0; rg < kMT; ++rg) {
            // C fragment: c0 (row 2c, col g), c1 (row 2c+1, col g), c2/c3 the same rows at col g+8
            float* p = buf + (rg * 8 + 2 * c4) * T::kBufStride + nt * kTile + g8;
            if (round == 0) {
              p[0] = acc[nt][rg][0], p[T::kBufStride] = acc[nt][rg][1];
              p[8] = acc[nt][rg][2], p[T::kBufStride + 8] = acc[nt][rg][3];
            } else {
              p[0] += acc[nt][rg][0], p[T::kBufStride] += acc[nt][rg][1];
              p[8] += acc[nt][rg][2], p[T::kBufStride + 8] += acc[nt][rg][3];
            }
          }
      }
      __syncthreads();
    }

    const int row0 = chunk * T::kRows;
    const bool whole = (seg % kta == 0) && (seg_end - seg == kta);
    bool finalize = whole;
    if (!whole) {
      const long long acc_stride = static_cast<long long>(a.groups) * kHadBlock;
      for (int i = threadIdx.x; i < T::kRows * (kHadBlock / 4); i += kSkinnyThreads) {
        const int r = i / (kHadBlock / 4), q = i % (kHadBlock / 4);
        if (row0 + r < a.rows) {
          const float* p = buf + r * T::kBufStride + 4 * q;
          red_add_f32x4(a.acc + (row0 + r) * acc_stride + group * kHadBlock + 4 * q, p[0], p[1], p[2], p[3]);
        }
      }
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) {
        const int done = atomicAdd(a.counters + chunk * a.groups + group, seg_end - seg) + (seg_end - seg);
        *last_flag = done == kta;
      }
      __syncthreads();
      finalize = *last_flag;
      if (finalize) {
        __threadfence();
        for (int i = threadIdx.x; i < T::kRows * (kHadBlock / 4); i += kSkinnyThreads) {
          const int r = i / (kHadBlock / 4), q = i % (kHadBlock / 4);
          if (row0 + r < a.rows) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(a.acc + (row0 + r) * acc_stride +
                                                                    group * kHadBlock) + q);
            float* p = buf + r * T::kBufStride + 4 * q;
            p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
          }
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
      for (int r = warp; r < T::kRows; r += kSkinnyWarps) {
        const int row = row0 + r;
        if (row >= a.rows) break;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = buf[r * T::kBufStride + 4 * lane + e];
        if constexpr (T::kAffineEpilogue) {
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
    seg = seg_end;
  }
}

// Host side of one instantiation: kernel pointer and dynamic shared memory.
struct SkinnyKernel {
  const void* fn;
  int smem;
};

template <int kBits2, bool kMul1, int kMT, bool kDup>
SkinnyKernel skinny_kernel_ref() {
  return {reinterpret_cast<const void*>(&skinny_kernel<kBits2, kMul1, kMT, kDup>),
          SkinnyTraits<kBits2, kMul1, kMT, kDup>::kSmemBytes};
}

// Per-family lookup (one definition per translation unit). dup: duplicated-activation codeword path.
SkinnyKernel skinny_kernel_mul1(int bits2, int mt, bool dup);
SkinnyKernel skinny_kernel_xcg(int bits2, int mt, bool dup);

}  // namespace exl3

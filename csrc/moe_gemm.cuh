// Grouped EXL3 GEMM for routed experts (steps 3 and 5 of moe.h): one block per (row chunk, 128-column group,
// projection). A row chunk is up to kRows pairs routed to one expert; the block streams that expert's tiles of the
// group one 128-row input block at a time through a shared-memory ring (cp.async), together with the chunk's
// activation rows of the same block, so each tile is decoded once for all rows of the chunk.
//
// * Warp w owns n-tile w of the group (16 output columns) over the whole K range: no cross-warp reduction, and the
//   accumulators are kRows / 2 floats per lane (kRows = 64 stays in registers).
// * Transposed product, as in the dense skinny kernel (skinny.cuh): the decoded 16x16 tile is the A operand (W^T) of
//   mma.m16n8k16 in its natural fragment order, eight activation rows are B. The plain (rounded-pair) form feeds Ŵ
//   itself, bit-exact, so one MMA per tile and 8 rows, and no affine epilogue for mul1.
// * Epilogue: the warps' sums go to shared memory, then one warp per row applies the output Hadamard and svh and
//   writes the row (gate/up outputs in the activation dtype, or router-weighted fp32 slots for the down projection).
//   Each output element is one fixed sequence of MMAs and butterflies: bitwise deterministic, whatever the chunk
//   layout the routing produced.
#pragma once

#include "exl3_decode.cuh"
#include "exl3_device.cuh"
#include "exl3_kernels.h"
#include "moe.h"

namespace exl3 {

constexpr int kMoeWarps = 8;  // one per n-tile of a 128-column group
constexpr int kMoeThreads = kMoeWarps * kWarp;
constexpr int kMoeXRowBytes = kHadBlock * 2 + 16;  // one activation row of a stage, padded: fragment reads hit 32 banks
constexpr int kMoeZStride = kHadBlock + 4;        // floats per row of the epilogue buffer
#ifndef EXL3_MOE_MAX_STAGES  // tuning (EXTRA_NVCC in bench/device_run.sh): most ring stages, 8/16-row chunks
#define EXL3_MOE_MAX_STAGES 4
#endif
#ifndef EXL3_MOE_WIDE_STAGES  // the same for 64-row chunks
#define EXL3_MOE_WIDE_STAGES 2
#endif
#ifndef EXL3_MOE_XDUP_STAGES  // the same for the chunks that read duplicated activations (moe.h moe_xdup)
#define EXL3_MOE_XDUP_STAGES 3
#endif
// A row in duplicated fragment order (moe.h moe_xdup) is 512 bytes a stage. Lane group g8 reads row g8 of a row group
// with one 16-byte load, 64 bytes per k-tile for its quad: a pitch of 64 mod 128 bytes puts rows 2i and 2i+1 on
// complementary halves of the 32 banks, so the 8 rows take the 4 wavefronts a warp's 512 bytes need at least.
constexpr int kMoeXDupRowBytes = kHadBlock * 4 + 64;

template <int kBits2, int kRows, bool kXDup = false>
struct MoeGemmTraits {
  using TB = TileBits<kBits2>;
  static constexpr int kTileBytes = kTilesPerHad * kTilesPerHad * TB::kBytes;  // 8 k-tiles x 8 n-tiles
  // kXDup (the kDup instantiations): the stage's activation rows are twice as wide. With four stages that costs a
  // resident block per SM at 4 bits (sm_90, by shared memory: 8-row chunks 5 -> 4, 16-row 4 -> 3); three keep
  // main's counts, and that is the form measured and adopted (bench/notes/serving-run-06.md "Sixth run").
  static constexpr int kXRowBytes = kXDup ? kMoeXDupRowBytes : kMoeXRowBytes;  // pitch of an activation row
  static constexpr int kXRowHalves = (kXDup ? 2 : 1) * kHadBlock;              // fp16 of a row per stage
  static constexpr int kXBytes = kRows * kXRowBytes;
  static constexpr int kStageBytes = kTileBytes + kXBytes;
  // Up to kMaxStages stages in flight, within 96 KB (under sm_12x's 99 KB per block); at least two. 64-row chunks
  // (prefill) keep two: at 25 KB a stage, a third cost a block per SM (2 -> 3 resident: 747 -> 629 µs per Qwen3 layer
  // at 1024 tokens on the H200, bench/notes/serving-run-04.md "Fourth run"); decode chunks keep up to four (no gain
  // from fewer). On sm_12x (100 KB of shared memory per SM) one 64-row block fits either way, so there this only
  // shortens the ring: not measured (no GB10 lent).
  static constexpr int kMaxStages =
      kRows >= 64 ? EXL3_MOE_WIDE_STAGES : kXDup ? EXL3_MOE_XDUP_STAGES : EXL3_MOE_MAX_STAGES;
  static constexpr int kStagesFit = 96 * 1024 / kStageBytes;
  static constexpr int kStages = kStagesFit > kMaxStages ? kMaxStages : kStagesFit < 2 ? 2 : kStagesFit;
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kZBytes = kRows * kMoeZStride * 4;
  static constexpr int kSmemBytes = (kRingBytes > kZBytes ? kRingBytes : kZBytes) + kRows * 4;
  static constexpr int kTileChunks = kTilesPerHad * kTilesPerHad * TB::kChunks16;
  static constexpr int kTileCopies = (kTileChunks + kMoeThreads - 1) / kMoeThreads;
  static constexpr int kXRowChunks = kXRowHalves * 2 / 16;
  static constexpr int kXChunks = kRows * kXRowChunks;
  static constexpr int kXCopies = (kXChunks + kMoeThreads - 1) / kMoeThreads;
  static_assert(kRows % 8 == 0, "rows come in MMA groups of 8");
  static_assert(kSmemBytes <= 99 * 1024, "shared memory per block (sm_12x)");
};

// kDup (3inst/mcg at decode sizes, as the dense skinny kernel does): a tile's codeword registers go to the tensor
// cores as they are, two fp16 halves summing exactly to the weight, against activations duplicated into both
// halves: two MMAs per tile instead of the four rounding steps of the pairs, which the issue-bound decode cannot
// afford. (mul1 codewords would need an affine epilogue with row sums; they take the rounded pairs.)
// The duplication is done by the transforms (moe.h moe_xdup), which write the kDup GEMMs' activation rows
// in the order of the four B operands a lane's two MMAs take per k-tile; the decode is bound by ALU-pipe issue, and
// this takes four byte permutes and a load per tile and row group off it. The same fp16 values: bit-identical.
// lds32 for 16 bytes (`smem` 16-byte aligned).
__device__ __forceinline__ uint4 lds128(const void* smem) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))));
  return v;
}

template <int kBits2, bool kMul1, int kRows>
__global__ void __launch_bounds__(kMoeThreads) moe_gemm_kernel(const MoeGemmArgs a) {
  constexpr bool kDup = !kMul1 && kRows <= 16;
  // The rounded-pair form takes its activation fragments through ldmatrix, four 32-bit fragments per instruction
  // instead of one: Nsight Compute found 64-row chunks waiting on these shared-memory loads, and ldmatrix took the
  // Qwen3 layer at 1024 tokens from 625 to 579 µs on the H200 (bench/notes/serving-run-05.md "Fifth run").
  constexpr bool kLdmatrix = !kDup && kRows % 16 == 0;
  static_assert(kDup == moe_xdup(kMul1 ? kCbMul1 : kCb3Inst, kRows), "the host writes duplicated rows for these");
  using T = MoeGemmTraits<kBits2, kRows, kDup>;
  using TB = typename T::TB;
  extern __shared__ __align__(16) unsigned char smem[];
  int* row_pair = reinterpret_cast<int*>(smem + (T::kRingBytes > T::kZBytes ? T::kRingBytes : T::kZBytes));
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g8 = lane >> 2, c4 = lane & 3;
  const int chunk = blockIdx.x;
  const int group = blockIdx.y % a.groups, proj = blockIdx.y / a.groups;
  const int split = blockIdx.z;  // this block's share of the K range (split-K at decode sizes)
  const int kb_begin = split * a.kb_count / a.splits, kb_end = (split + 1) * a.kb_count / a.splits;

  // The routing table comes from the routing kernel; xh from the kernel just before this one. When the routing is
  // older than that kernel (the down GEMM: routing, gather, gate/up GEMM, act transform, this), the block reads the
  // table and streams its first weight stages before waiting, so those loads overlap the previous kernel's tail.
  if (!a.table_early) griddep_wait();
  griddep_launch_dependents();
  if (chunk >= *a.num_chunks) return;
  const int expert = a.chunk_expert[chunk];
  const int slice = expert * a.projs + proj;
  if (a.keys && a.keys[slice] != a.want_key) return;
  const int start = a.chunk_start[chunk], count = a.chunk_count[chunk];
  if (threadIdx.x < kRows) row_pair[threadIdx.x] = threadIdx.x < count ? a.sorted_pairs[start + threadIdx.x] : -1;
  __syncthreads();

  // Per-thread copy offsets, fixed for the whole K loop (the stage base moves by one 128-row block per step).
  const int16_t* w_base = a.trellis + slice * a.slice_stride + static_cast<long long>(group) * kTilesPerHad * a.tile_stride;
  const long long w_step = kTilesPerHad * a.row_stride;
  int tile_src[T::kTileCopies];
  uint32_t tile_dst[T::kTileCopies];
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#pragma unroll
  for (int i = 0; i < T::kTileCopies; ++i) {
    const int c = threadIdx.x + i * kMoeThreads;
    const int t = c / TB::kChunks16, part = c % TB::kChunks16;  // t = kt * 8 + nt
    tile_src[i] = static_cast<int>((t / kTilesPerHad) * a.row_stride + (t % kTilesPerHad) * a.tile_stride) + part * 8;
    tile_dst[i] = ring + t * TB::kBytes + part * 16;
  }
  const __half* x_src[T::kXCopies];
  uint32_t x_dst[T::kXCopies];
#pragma unroll
  for (int i = 0; i < T::kXCopies; ++i) {
    const int c = threadIdx.x + i * kMoeThreads;
    const int row = c / T::kXRowChunks, part = c % T::kXRowChunks;
    const int pair = c < T::kXChunks ? row_pair[row] : -1;
    x_src[i] = pair >= 0 ? static_cast<const __half*>(a.xh) + pair * a.xh_row_stride + proj * a.xh_proj_stride + part * 8 : nullptr;
    x_dst[i] = ring + T::kTileBytes + row * T::kXRowBytes + part * 16;
  }
  auto issue_tiles = [&](int kb, int slot) {
    if (kb < kb_end) {
      const int16_t* w = w_base + kb * w_step;
      const uint32_t off = slot * T::kStageBytes;
#pragma unroll
      for (int i = 0; i < T::kTileCopies; ++i)
        if (T::kTileChunks % kMoeThreads == 0 || threadIdx.x + i * kMoeThreads < T::kTileChunks)
          cp_async16(tile_dst[i] + off, w + tile_src[i]);
    }
  };
  auto issue_x = [&](int kb, int slot) {
    if (kb < kb_end) {
#pragma unroll
      for (int i = 0; i < T::kXCopies; ++i)
        if (x_src[i]) cp_async16(x_dst[i] + slot * T::kStageBytes, x_src[i] + kb * T::kXRowHalves);
    }
  };

  const uint32_t mul = codebook_mul(a.codebook), add = codebook_add(a.codebook);
  LaneWindows<kBits2> lw;
  lw.init(lane);
  float acc[kRows / 8][4];
#pragma unroll
  for (int rg = 0; rg < kRows / 8; ++rg)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[rg][e] = 0.f;

  // Prologue: the first stages' weights (they depend on nothing), then, once the previous kernel is done, their
  // activations; one wait for all of it, after which every ring stage is one commit group (tiles + activations).
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) issue_tiles(kb_begin + s, s);
  if (a.table_early) griddep_wait();
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) issue_x(kb_begin + s, s);
  cp_async_commit();
  cp_async_wait<0>();
#pragma unroll
  for (int s = 0; s < T::kStages - 2; ++s) cp_async_commit();  // empty groups: the loop's wait counts stay uniform
  for (int kb = kb_begin, slot = 0; kb < kb_end; ++kb, slot = slot + 1 == T::kStages ? 0 : slot + 1) {
    cp_async_wait<T::kStages - 2>();
    __syncthreads();  // stage kb landed for every thread; the slot refilled below was consumed by all warps
    const int refill = slot == 0 ? T::kStages - 1 : slot - 1;
    issue_tiles(kb + T::kStages - 1, refill);
    issue_x(kb + T::kStages - 1, refill);
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
    const unsigned char* st = smem + slot * T::kStageBytes;
    const unsigned char* xs = st + T::kTileBytes + g8 * T::kXRowBytes + (kDup ? 16 : 4) * c4;
#pragma unroll
    for (int kt = 0; kt < kTilesPerHad; ++kt) {
      const unsigned char* tile = st + (kt * kTilesPerHad + warp) * TB::kBytes;
      uint32_t w[TB::kLoadWords];
#pragma unroll
      for (int i = 0; i < TB::kLoadWords; ++i) w[i] = lds32(tile + lw.word_byte[i]);
      // lane_codewords written out: exl3_decode.cuh says why, above it.
      uint32_t s[kLanePositions], cw[kLanePositions];
      lw.states(w, s);
#pragma unroll
      for (int j = 0; j < kLanePositions; ++j) cw[j] = codeword<kMul1>(s[j], mul, add);
      if constexpr (kDup) {
#pragma unroll
        for (int rg = 0; rg < kRows / 8; ++rg) {
          // The transform stored both MMAs' B operands, already duplicated, side by side (moe.cu
          // store_scaled_fp16_dup): one 16-byte load instead of two 4-byte loads and four byte permutes.
          const uint4 b = lds128(xs + rg * 8 * T::kXRowBytes + kt * kTile * 4);
          mma_16816(acc[rg], cw[0], cw[4], cw[2], cw[6], b.x, b.y);
          mma_16816(acc[rg], cw[1], cw[5], cw[3], cw[7], b.z, b.w);
        }
      } else {
        const uint32_t a0 = rounded_pair<kMul1>(cw[0], cw[1]), a1 = rounded_pair<kMul1>(cw[4], cw[5]);
        const uint32_t a2 = rounded_pair<kMul1>(cw[2], cw[3]), a3 = rounded_pair<kMul1>(cw[6], cw[7]);
        if constexpr (kLdmatrix) {
          // Two row groups' B fragments (both k halves) in one ldmatrix.x4: matrix m = row group rg + m / 2, k half
          // m % 2; lane l addresses row l % 8 of matrix l / 8 (rows 272 bytes apart: the 8 rows hit 32 banks).
          const uint32_t xl = ring + static_cast<uint32_t>(slot * T::kStageBytes + T::kTileBytes +
                                                           ((lane >> 4) * 8 + (lane & 7)) * kMoeXRowBytes +
                                                           ((lane >> 3) & 1) * 16 + kt * kTile * 2);
#pragma unroll
          for (int rg = 0; rg < kRows / 8; rg += 2) {
            uint32_t b[4];
            ldmatrix_x4(b, xl + rg * 8 * kMoeXRowBytes);
            mma_16816(acc[rg], a0, a1, a2, a3, b[0], b[1]);
            mma_16816(acc[rg + 1], a0, a1, a2, a3, b[2], b[3]);
          }
        } else {
#pragma unroll
          for (int rg = 0; rg < kRows / 8; ++rg) {
            const unsigned char* xr = xs + rg * 8 * kMoeXRowBytes + kt * kTile * 2;
            mma_16816(acc[rg], a0, a1, a2, a3, lds32(xr), lds32(xr + 16));
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the epilogue buffer

  // C fragment: c0/c1 = output column g8 of the n-tile, rows 2*c4 + {0,1} of the row group; c2/c3 column g8 + 8.
  float* z = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int rg = 0; rg < kRows / 8; ++rg) {
    float* p = z + (rg * 8 + 2 * c4) * kMoeZStride + warp * kTile + g8;
    p[0] = acc[rg][0], p[kMoeZStride] = acc[rg][1], p[8] = acc[rg][2], p[kMoeZStride + 8] = acc[rg][3];
  }
  __syncthreads();
  const int col = group * kHadBlock + 4 * lane;
  const __half* svh = static_cast<const __half*>(a.svh) + static_cast<long long>(slice) * a.n_padded + col;
  const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(svh));
  const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(svh + 2));
  const float sv[4] = {s01.x * kHadScale, s01.y * kHadScale, s23.x * kHadScale, s23.y * kHadScale};
  for (int r = warp; r < count; r += kMoeWarps) {
    const float4 q = *reinterpret_cast<const float4*>(z + r * kMoeZStride + 4 * lane);
    float v[4] = {q.x, q.y, q.z, q.w};
    fwht128_warp(v, lane);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] *= sv[e];
    const int pair = row_pair[r];
    const float w = a.pair_weight ? a.pair_weight[pair] : 1.f;
    // The output transform is linear: each K split writes H(its partial) * svh to its own slot, and the next
    // kernel adds the slots in split order.
    *reinterpret_cast<float4*>(static_cast<float*>(a.y) + pair * a.y_row_stride + split * a.y_split_stride +
                               static_cast<long long>(proj) * a.n_padded + col) =
        make_float4(v[0] * w, v[1] * w, v[2] * w, v[3] * w);
  }
}

struct MoeGemmKernel {
  const void* fn;
  int smem;
};

template <int kBits2, bool kMul1, int kRows>
MoeGemmKernel moe_gemm_kernel_ref() {
  constexpr bool kXDup = moe_xdup(kMul1 ? kCbMul1 : kCb3Inst, kRows);
  return {reinterpret_cast<const void*>(&moe_gemm_kernel<kBits2, kMul1, kRows>), MoeGemmTraits<kBits2, kRows, kXDup>::kSmemBytes};
}

// Per-family lookup (one definition per translation unit); {nullptr, 0} for widths or row sizes not built.
MoeGemmKernel moe_gemm_kernel_mul1(int bits2, int rows);
MoeGemmKernel moe_gemm_kernel_3inst_mcg(int bits2, int rows);

// Row-chunk sizes with instantiations (moe_rows_per_chunk picks among them).
#define EXL3_MOE_DISPATCH_ROWS(rows, F)                 \
  switch (rows) {                                      \
    case 8: F(std::integral_constant<int, 8>{}); break;   \
    case 16: F(std::integral_constant<int, 16>{}); break; \
    case 64: F(std::integral_constant<int, 64>{}); break; \
    default: break;                                    \
  }

}  // namespace exl3

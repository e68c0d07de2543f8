// EXL3 trellis decode: the one place that knows the bit layout and the codebooks.
//
// Written from docs/format.md (our own restatement of the format; no ExLlamaV3 code).
// Section numbers below refer to that document. Every kernel includes this header; no other file names a
// format constant. Plain CUDA C++: no torch headers.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include "exl3_kernels.h"

#if defined(__CUDACC__)
#define EXL3_HD __host__ __device__ __forceinline__
#define EXL3_HDC __host__ __device__ constexpr
#else
#define EXL3_HD inline
#define EXL3_HDC constexpr
#endif

namespace exl3 {

// --- §1.3 / §1.2: geometry --------------------------------------------------------------------------------
constexpr int kTile = 16;                 // 16x16 weight tiles
constexpr int kTileWeights = kTile * kTile;
constexpr int kHadBlock = 128;            // Hadamard block on both sides; both dims padded to it
constexpr int kTilesPerHad = kHadBlock / kTile;
constexpr int kStateBits = 16;            // §1.5: 16-bit trellis state per weight
constexpr int kLanePositions = 8;         // §1.4: lane L of a warp owns bitstream positions 8L .. 8L+7

// --- §2: codebooks (exl3::Codebook, the index, is in exl3_kernels.h) --------------------------------------
constexpr uint32_t k3InstMul = 89226354u;   // §2.1: y = state * a + b
constexpr uint32_t k3InstAdd = 64248484u;
constexpr uint32_t kMcgMul = 0xCBAC1FEDu;    // §2.2: y = state * a
constexpr uint32_t kMul1Mul = 0x83DCD12Du;   // §2.3: y = state * a, value from the byte sum of y
constexpr uint32_t kHalfPairMask = 0x8FFF8FFFu;  // §2.1/§2.2: (y & mask) ^ xor = two fp16 halves, value = lo + hi
constexpr uint32_t kHalfPairXor = 0x3B603B60u;
constexpr uint32_t kByteOnes = 0x01010101u;  // dp4a with this sums the four bytes
// §2.3: mul1 value = fp16((1024 + bytesum) * 887/131072 - 1329/128), one rounding. fp16 0x6400 = 1024.0 and the
// byte sum is <= 1020, so (0x6400 + bytesum) read as fp16 is exactly 1024 + bytesum.
constexpr uint32_t kMul1Base = 0x6400u;
constexpr float kMul1InvScale = 887.0f / 131072.0f;  // exact in fp16 (0x1EEE)
constexpr float kMul1Bias = -1329.0f / 128.0f;        // exact in fp16 (0xC931)
constexpr uint32_t kMul1InvScaleHalf2 = 0x1EEE1EEEu;
constexpr uint32_t kMul1BiasHalf2 = 0xC931C931u;

// Multiplier/addend of the two affine-hash codebooks; mul1 is handled by its own code path.
EXL3_HD uint32_t codebook_mul(int cb) { return cb == kCb3Inst ? k3InstMul : cb == kCbMcg ? kMcgMul : kMul1Mul; }
EXL3_HD uint32_t codebook_add(int cb) { return cb == kCb3Inst ? k3InstAdd : 0u; }

// --- bit helpers: hardware instructions on the device, plain C++ on the host (tests/kernels/csrc/test_csrc_build.py runs the
// decoder on the CPU against the Python reference) -----------------------------------------------------------

// Upper 32 bits of (hi:lo) << (s & 31).
EXL3_HD uint32_t funnel_l(uint32_t lo, uint32_t hi, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(lo, hi, s);
#else
  s &= 31;
  return s ? (hi << s) | (lo >> (32 - s)) : hi;
#endif
}
// PRMT without sign modes: byte i of the result is byte (sel >> 4i) & 7 of (y:x).
EXL3_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, sel);
#else
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}
// v * m as an instruction the compiler cannot fold into neighbouring shifts (it runs on the FMA pipe).
template <uint32_t kM>
EXL3_HD uint32_t mul_opaque(uint32_t v) {
#if defined(__CUDA_ARCH__)
  asm("mul.lo.u32 %0, %1, %2;" : "=r"(v) : "r"(v), "n"(kM));
  return v;
#else
  return v * kM;
#endif
}
// v << kS on the ALU pipe (a funnel shift: ptxas turns plain shifts into IMAD where it likes).
template <int kS>
EXL3_HD uint32_t shl_alu(uint32_t v) {
#if defined(__CUDA_ARCH__)
  asm("shf.l.wrap.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(0u), "r"(v), "n"(kS));
  return v;
#else
  return v << kS;
#endif
}
// Sum of the four bytes of y, plus c.
EXL3_HD uint32_t byte_sum(uint32_t y, uint32_t c) {
#if defined(__CUDA_ARCH__)
  return __dp4a(y, kByteOnes, c);
#else
  return (y & 0xFF) + ((y >> 8) & 0xFF) + ((y >> 16) & 0xFF) + (y >> 24) + c;
#endif
}
EXL3_HD uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {  // (a & b) ^ c in one LOP3
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return (a & b) ^ c;
#endif
}

// --- §1.5 / §1.8: the bitstream of one tile, as seen by one lane ------------------------------------------
// Bit widths are carried as kBits2 = 2 * bits: 2..16 even for integer widths, 3/5/7 for 1.5/2.5/3.5 (mul1 only).
// A tile is a tail-biting ring of 256*bits bits, stored as 4*kBits2 little-endian uint32 words whose bits run
// MSB first. Position t's state is the 16 ring bits ending where its symbol ends.
namespace detail {
// Symbol width of lane-local position j (a lane starts at an even position, so parity is j's parity).
EXL3_HDC int symbol_width(int bits2, int j) { return (bits2 & 1) ? bits2 / 2 + (j & 1) : bits2 / 2; }
// Ring offset (relative to the lane's first symbol) where position j's symbol ends.
EXL3_HDC int symbol_end(int bits2, int j) {
  return j < 0 ? 0 : symbol_end(bits2, j - 1) + symbol_width(bits2, j);
}
// Ring bit where lane L's first window starts (the windows of a lane cover one contiguous span of the ring).
EXL3_HDC int region_start(int bits2, int lane) {
  return ((lane * 4 * bits2 + symbol_end(bits2, 0) - kStateBits) % (128 * bits2) + 128 * bits2) % (128 * bits2);
}
EXL3_HDC int max_phase(int bits2) {
  int m = 0;
  for (int lane = 0; lane < 32; ++lane) m = region_start(bits2, lane) % 32 > m ? region_start(bits2, lane) % 32 : m;
  return m;
}
}  // namespace detail

template <int kBits2>
struct TileBits {
  static_assert(kBits2 >= 2 && kBits2 <= 16, "bits must be 1..8");
  static constexpr int kRingBits = 128 * kBits2;         // 256 * bits
  static constexpr int kWords32 = kRingBits / 32;         // uint32 words per tile
  static constexpr int kBytes = kRingBits / 8;            // = 16 * kBits2: always a whole number of 16-byte chunks
  static constexpr int kChunks16 = kBytes / 16;
  static constexpr int kLaneBits = 4 * kBits2;            // ring bits covered by one lane's 8 symbols
  // The lane's bits of interest: from the start of its first window to the end of its last symbol.
  static constexpr int kSpan = detail::symbol_end(kBits2, 7) - detail::symbol_end(kBits2, 0) + kStateBits;
  static constexpr int kUWords = (kSpan + 31) / 32;       // normalized 32-bit words holding the span
  // Words a lane must read: enough for the worst phase. Lanes with a smaller phase read one harmless extra word.
  static constexpr int kLoadWords = (detail::max_phase(kBits2) + kSpan + 31) / 32;
  static_assert(kLoadWords <= 4, "span must fit four words");
  // Offset of position j's window inside the span.
  EXL3_HDC static int window_offset(int j) { return detail::symbol_end(kBits2, j) - detail::symbol_end(kBits2, 0); }
};

// Per-lane decoder state, computed once per kernel: which words of a tile record this lane reads (byte offsets,
// wrapping around the ring) and how far its span is shifted inside them.
// kShiftOnAlu: window shifts as ALU funnel shifts instead of FMA-pipe multiplies (for decoders whose FMA pipe is
// the busier one).
template <int kBits2, bool kShiftOnAlu = false>
struct LaneWindows {
  using TB = TileBits<kBits2>;
  // 4- and 8-bit lanes all start at the same bit phase (4*bits*lane is a multiple of 32), so the windows can be
  // cut straight from the loaded words at compile-time offsets. Other widths first shift the span to bit 0.
  static constexpr bool kConstPhase = kBits2 % 8 == 0;
  static constexpr int kPhase0 = detail::region_start(kBits2, 0) % 32;
  uint32_t word_byte[TB::kLoadWords];
  uint32_t shift;

  EXL3_HD void init(int lane) {
    const int start = detail::region_start(kBits2, lane);
    shift = start % 32;
#pragma unroll
    for (int i = 0; i < TB::kLoadWords; ++i) word_byte[i] = ((start / 32 + i) % TB::kWords32) * 4;
  }

  // The 8 states of this lane's positions from the words it loaded (w[i] = word at word_byte[i]).
  EXL3_HD void states(const uint32_t (&w)[TB::kLoadWords], uint32_t (&s)[kLanePositions]) const {
    if constexpr (kConstPhase) {
      all_windows<kPhase0>(w, s, std::make_integer_sequence<int, kLanePositions>{});
    } else {
      uint32_t u[TB::kUWords];
#pragma unroll
      for (int i = 0; i < TB::kUWords; ++i)  // u[i] = span bits [32i, 32i + 32), MSB first
        u[i] = funnel_l(i + 1 < TB::kLoadWords ? w[i + 1] : 0u, w[i], shift);
      all_windows<0>(u, s, std::make_integer_sequence<int, kLanePositions>{});
    }
  }

 private:
  template <int kBase, int kN, int... J>
  EXL3_HD static void all_windows(const uint32_t (&u)[kN], uint32_t (&s)[kLanePositions],
                                                     std::integer_sequence<int, J...>) {
    ((s[J] = window<kBase + TB::window_offset(J)>(u)), ...);
  }

  // 16 bits starting at bit kOff (MSB first) of the words u; offsets are compile-time. Integer issue is the
  // bottleneck of every decoder here, so each window costs one ALU op where possible: a right shift (window at the
  // top of a 32-bit view), a mask (at the bottom) or a byte permute (byte-aligned inside). Other offsets first shift
  // the view left by kOff % 8 (a multiply on the FMA pipe, or an ALU shift, see kShiftOnAlu); windows that straddle two
  // words use the view [16, 48) of the pair, built with one byte permute.
  template <int kOff, int kN>
  EXL3_HD static uint32_t window(const uint32_t (&u)[kN]) {
    constexpr int i = kOff / 32, r = kOff % 32;
    if constexpr (r == 16) {
      return u[i] & 0xFFFFu;
    } else if constexpr (r < 16) {
      return in_view<r>(u[i]);
    } else {
      static_assert(i + 1 < kN, "a straddling window needs the next word");
      return in_view<r - 16>(byte_perm(u[i], u[i + 1], 0x1076));  // (u[i] << 16) | (u[i+1] >> 16)
    }
  }

  template <int kR>  // 0 <= kR < 16: bits [kR, kR + 16) of v
  EXL3_HD static uint32_t in_view(uint32_t v) {
    constexpr int kShift = kR % 8, kByte = kR - kShift;
    // Opaque multiply: the compiler would otherwise fold shift-left + shift-right into shift + mask (two ALU ops).
    if constexpr (kShift != 0 && kShiftOnAlu) v = shl_alu<kShift>(v);
    else if constexpr (kShift != 0) v = mul_opaque<1u << kShift>(v);
    if constexpr (kByte == 0) return v >> 16;
    else return byte_perm(v, 0u, 0x4421);  // bytes 2..1: bits [8, 24)
  }
};

// --- §2: state -> value ------------------------------------------------------------------------------------
// "Codeword" form: a 32-bit register whose two fp16 halves sum *exactly* to the codebook value before its final
// fp16 rounding. 3inst/mcg: the masked hash (lo + hi = value). mul1: fp16(1024 + bytesum) in the low half and 0
// in the high half; the affine step (x * kMul1InvScale + kMul1Bias) is applied by the caller (see below).
// Kernels that feed tensor cores with a duplicated activation use this form directly: one weight per register.
template <bool kMul1>
EXL3_HD uint32_t codeword(uint32_t state, uint32_t mul, uint32_t add) {
  if constexpr (kMul1) return byte_sum(state * kMul1Mul, kMul1Base);
  else return and_xor(state * mul + add, kHalfPairMask, kHalfPairXor);
}

// The 8 codewords of this lane's positions from the words it loaded (w[i] = word at lw.word_byte[i]): the decode
// step of every kernel. What becomes of the codewords (tensor-core operands as they are, or rounded pairs) is the
// caller's. moe_gemm.cuh, panel.cuh and skinny.cuh write these lines out instead: called from there, the helper
// changed their SASS (identical PTX instructions for skinny, registers numbered differently; ptxas then gave some
// sm_90a skinny instances 2-3 registers more or fewer).
template <bool kMul1, int kBits2, bool kShiftOnAlu>
EXL3_HD void lane_codewords(const LaneWindows<kBits2, kShiftOnAlu>& lw,
                            const uint32_t (&w)[TileBits<kBits2>::kLoadWords], uint32_t mul, uint32_t add,
                            uint32_t (&cw)[kLanePositions]) {
  uint32_t s[kLanePositions];
  lw.states(w, s);
#pragma unroll
  for (int j = 0; j < kLanePositions; ++j) cw[j] = codeword<kMul1>(s[j], mul, add);
}

// Bit-exact Ŵ: two codewords (positions a, b) -> half2 (a in the low half), rounded exactly like the reference.
// 3inst/mcg: rn16(lo + hi) is one HADD (the exact sum fits 15 bits, §2.2). mul1: one HFMA with exact constants.
#if defined(__CUDACC__)
template <bool kMul1>
__device__ __forceinline__ uint32_t rounded_pair(uint32_t cw_a, uint32_t cw_b) {
  uint32_t r;
  if constexpr (kMul1) {
    const uint32_t x = __byte_perm(cw_a, cw_b, 0x5410);
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(kMul1InvScaleHalf2), "r"(kMul1BiasHalf2));
  } else {
    const uint32_t lo = __byte_perm(cw_a, cw_b, 0x5410), hi = __byte_perm(cw_a, cw_b, 0x7632);
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(lo), "r"(hi));
  }
  return r;
}
#endif

// §1.4: bitstream position (lane L, j) -> (row k, column n) inside the tile: mma.m16n8k16 fragment order.
EXL3_HDC int tile_row(int lane, int j) { return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1); }
EXL3_HDC int tile_col(int lane, int j) { return (lane >> 2) + 8 * ((j >> 2) & 1); }

// Runtime bit width -> kBits2 dispatch. F is called as f(std::integral_constant<int, kBits2>{}).
#define EXL3_DISPATCH_BITS2(bits2, F)                                          \
  switch (bits2) {                                                             \
    case 2: F(std::integral_constant<int, 2>{}); break;                        \
    case 3: F(std::integral_constant<int, 3>{}); break;                        \
    case 4: F(std::integral_constant<int, 4>{}); break;                        \
    case 5: F(std::integral_constant<int, 5>{}); break;                        \
    case 6: F(std::integral_constant<int, 6>{}); break;                        \
    case 7: F(std::integral_constant<int, 7>{}); break;                        \
    case 8: F(std::integral_constant<int, 8>{}); break;                        \
    case 10: F(std::integral_constant<int, 10>{}); break;                      \
    case 12: F(std::integral_constant<int, 12>{}); break;                      \
    case 14: F(std::integral_constant<int, 14>{}); break;                      \
    case 16: F(std::integral_constant<int, 16>{}); break;                      \
    default: break;                                                            \
  }

}  // namespace exl3

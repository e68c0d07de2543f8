// Runs the kernels' lane decoder (csrc/exl3_decode.cuh) on the CPU: reads tiles, writes every lane's states and
// codewords. tests/kernels/csrc/test_csrc_build.py compares them with the Python reference. No GPU needed.
//
// stdin:  int32 bits2, int32 codebook, int32 tiles, then tiles * 8 * bits2 int16 words (tile records)
// stdout: for each tile, lane 0..31, position j 0..7: uint32 state, uint32 codeword
#include <cstdio>
#include <vector>

#include "exl3_decode.cuh"

namespace {

template <int kBits2>
int run(int codebook, int tiles, const std::vector<int16_t>& data) {
  using TB = exl3::TileBits<kBits2>;
  std::vector<uint32_t> out;
  out.reserve(static_cast<size_t>(tiles) * 32 * 8 * 2);
  const uint32_t mul = exl3::codebook_mul(codebook), add = exl3::codebook_add(codebook);
  for (int t = 0; t < tiles; ++t) {
    const unsigned char* rec = reinterpret_cast<const unsigned char*>(data.data() + static_cast<size_t>(t) * TB::kBytes / 2);
    for (int lane = 0; lane < 32; ++lane) {
      exl3::LaneWindows<kBits2> lw;
      lw.init(lane);
      uint32_t w[TB::kLoadWords], s[exl3::kLanePositions];
      for (int i = 0; i < TB::kLoadWords; ++i) {
        const unsigned char* p = rec + lw.word_byte[i];
        w[i] = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
      }
      lw.states(w, s);
      uint32_t cw[exl3::kLanePositions];  // through the kernels' helper, not codeword() per state
      if (codebook == exl3::kCbMul1) exl3::lane_codewords<true>(lw, w, mul, add, cw);
      else exl3::lane_codewords<false>(lw, w, mul, add, cw);
      for (int j = 0; j < exl3::kLanePositions; ++j) {
        out.push_back(s[j]);
        out.push_back(cw[j]);
      }
    }
  }
  fwrite(out.data(), sizeof(uint32_t), out.size(), stdout);
  return 0;
}

}  // namespace

int main() {
  int32_t hdr[3];
  if (fread(hdr, sizeof(int32_t), 3, stdin) != 3) return 2;
  const int bits2 = hdr[0], codebook = hdr[1], tiles = hdr[2];
  std::vector<int16_t> data(static_cast<size_t>(tiles) * 8 * bits2);
  if (fread(data.data(), sizeof(int16_t), data.size(), stdin) != data.size()) return 2;
  int rc = 3;
  auto go = [&](auto b2) { rc = run<decltype(b2)::value>(codebook, tiles, data); };
  EXL3_DISPATCH_BITS2(bits2, go)
  return rc;
}

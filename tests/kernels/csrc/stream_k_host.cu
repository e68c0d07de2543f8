// Host check of the GEMM kernels' stream-K bookkeeping: the device's division-free forms (floor_muldiv for the
// block ranges, block_of_unit_dev for a group's first and last block) against the exact 64-bit integer forms the
// host plans with (block_of_unit sizes the split-K partial slots: a device answer off by one would write past
// them). Prints the first mismatch and exits 1; prints "ok <checks>" otherwise.
#include <cstdio>

#include "stream_k.cuh"

int main() {
  long long checks = 0;
  const int grids[] = {1, 2, 7, 96, 132, 264, 396, 528, 1056, 65535};
  const long long unit_counts[] = {1, 2, 16, 255, 256, 1000, 28672, 114688, 1 << 20, (1LL << 31) - 1};
  for (const long long units : unit_counts)
    for (const int grid : grids) {
      if (grid > units) continue;
      for (int b = 0; b <= grid; ++b) {  // block ranges [floor(b * units / grid), ...)
        ++checks;
        const long long exact = static_cast<long long>(b) * units / grid;
        if (exl3::floor_muldiv(b, static_cast<int>(units), grid) != exact) {
          std::printf("floor_muldiv(%d, %lld, %d) != %lld\n", b, units, grid, exact);
          return 1;
        }
      }
      const long long step = units / 4099 + 1;
      for (long long u = 0; u < units; u += (u % 3 == 0 ? 1 : step)) {
        ++checks;
        const int exact = exl3::block_of_unit(u, units, grid);
        const int fast = exl3::block_of_unit_dev(static_cast<int>(u), static_cast<int>(units), grid);
        if (exact != fast) {
          std::printf("block_of_unit(%lld, %lld, %d): exact %d, division-free %d\n", u, units, grid, exact, fast);
          return 1;
        }
      }
    }
  std::printf("ok %lld\n", checks);
  return 0;
}

// Host check of exl3::FastDiv (division by a runtime constant in the skinny kernel's unit bookkeeping): every
// divisor in a spread of sizes against plain division, over small numerators, a stride through [0, 2^31) and the
// top of the range. Prints the first mismatch and exits 1; prints "ok <checks>" otherwise.
#include <cstdio>
#include <vector>

#include "exl3_kernels.h"

int main() {
  std::vector<int> divisors;
  for (int d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (long long d = 4097; d < (1LL << 31); d = d * 3 / 2 + 7) divisors.push_back(static_cast<int>(d));
  divisors.push_back(0x7FFFFFFF);
  long long checks = 0;
  for (const int d : divisors) {
    const exl3::FastDiv f = exl3::make_fast_div(d);
    auto check = [&](long long n) {
      ++checks;
      const int q = exl3::fast_div(static_cast<int>(n), f), r = exl3::fast_mod(static_cast<int>(n), f);
      if (q != n / d || r != n % d) {
        std::printf("mismatch: %lld / %d = %d rem %d, fast_div gave %d rem %d\n", n, d, static_cast<int>(n / d),
                    static_cast<int>(n % d), q, r);
        return false;
      }
      return true;
    };
    for (long long n = 0; n < 3000; ++n)
      if (!check(n)) return 1;
    for (long long n = 0; n < (1LL << 31); n += 9973 * 1009)
      if (!check(n)) return 1;
    for (long long n = (1LL << 31) - 3000; n < (1LL << 31); ++n)
      if (!check(n)) return 1;
    for (long long k = 1; k <= 64 && k * d < (1LL << 31); ++k)  // multiples and their neighbours
      for (long long n = k * d - 1; n <= k * d + 1 && n < (1LL << 31); ++n)
        if (!check(n)) return 1;
  }
  std::printf("ok %lld\n", checks);
  return 0;
}

// Runs csrc/planner.cpp's plan_linear_path on the CPU: tests/kernels/csrc/test_csrc_build.py feeds it shapes.
//
// stdin, one case per line: arch_major l2_bytes rows w_prime_bytes active_cols fits_skinny fits_panel
// stdout, one line per case: the chosen exl3::Path value, then the kernels asked about ("s", "p", both or "-")
#include <cstdio>
#include <string>

#include "planner.h"

int main() {
  long long major, l2, rows, wbytes, cols;
  int fs, fp;
  while (std::scanf("%lld %lld %lld %lld %lld %d %d", &major, &l2, &rows, &wbytes, &cols, &fs, &fp) == 7) {
    std::string asked;
    const exl3::LinearShape s{rows, wbytes, cols, static_cast<int>(major), l2};
    const exl3::Path p = exl3::plan_linear_path(s, [&](bool panel) {
      asked += panel ? "p" : "s";
      return panel ? fp != 0 : fs != 0;
    });
    std::printf("%d %s\n", static_cast<int>(p), asked.empty() ? "-" : asked.c_str());
  }
  return 0;
}

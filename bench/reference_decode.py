"""Decode rate of the torch reference on ONE CPU core: trellis -> Ŵ (fp16), weights per second.

Target (foundation issue): >= 20 M weights/s. Shape 4096x14336 (58.7 M weights), every codebook, several bit
widths; median of 5 runs after a warm-up. Writes bench/results/<cpu>-reference-decode.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from vllm_exl3.format.reference import decode_rotated
from vllm_exl3.dev.synthetic import random_weights


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="4096x14336")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/<cpu>-reference-decode.json)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    k, n = map(int, args.shape.split("x"))
    rows = []
    for codebook, widths in (("3inst", (2, 4)), ("mcg", (2, 3, 4)), ("mul1", (2, 2.5, 3.5, 4, 6))):
        for bits in widths:
            w = random_weights(k, n, bits, codebook, seed=int(bits * 10))
            decode_rotated(w.trellis[:4], codebook)  # warm-up: tables and caches
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                decode_rotated(w.trellis, codebook)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            rows.append({"codebook": codebook, "bits": bits, "seconds": med, "mweights_per_s": k * n / med / 1e6})
            print(f"{codebook:5s} {bits:>4} bits  {med * 1e3:8.1f} ms  {k * n / med / 1e6:7.1f} M weights/s")
    result = {"cpu": cpu_name(), "threads": 1, "torch": torch.__version__, "shape": [k, n], "rows": rows,
              "min_mweights_per_s": min(r["mweights_per_s"] for r in rows)}
    slug = re.sub(r"[^a-z0-9]+", "-", result["cpu"].lower()).strip("-")[:40]
    out = Path(args.out or Path(__file__).parent / "results" / f"{slug}-reference-decode.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"slowest {result['min_mweights_per_s']:.1f} M weights/s on {result['cpu']} -> {out}")


if __name__ == "__main__":
    main()

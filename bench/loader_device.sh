#!/usr/bin/env bash
# Issue 6 on the GPU machine, from the repo root: `bash bench/loader_device.sh` (~120 s, under 150 s).
# A generated 2 GB pack on the repo's disk (not /tmp: tmpfs refuses O_DIRECT and has no cache to drop), checked
# byte-identical on cuda:0, then 3 rounds of back-to-back pairs (3 raw reads, loader) at 1/8/16 workers,
# O_DIRECT and buffered.
# JSON to $OUT/h200-machine-loader.json (bench/results/ without $OUT); the summary is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
PYTHONPATH=plugin exec python3 bench/loader.py --size-gb 2 --workers 1,8,16 --modes direct,buffered --repeats 3 \
    --budget-s 115 --machine h200-machine --out "$out/h200-machine-loader.json"

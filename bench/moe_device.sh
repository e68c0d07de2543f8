#!/usr/bin/env bash
# The native routed-expert kernels on the GPU machine's own torch, in one device call (no vLLM staging): build
# vllm_exl3.kernels._C (bench/device_run.sh), the MoE GPU tests, then where one layer call's time goes:
#   profile   per-kernel device times (bench/moe.py --profile) with PDL off, so that no kernel's time includes its
#             wait for the one before it (with PDL on, a kernel starts early and waits inside)
#   quick     bench/moe.py --quick on the Qwen3 and GLM-4.5-Air shapes, 4-bit (the build's table)
#   variants  for each NAME:FLAGS of VARIANTS (FLAGS: nvcc defines, comma-separated), the library rebuilt with
#             them, the MoE GPU tests and the same quick table: each variant against the default, in one call
#             (e.g. VARIANTS="stages4:-DEXL3_MOE_XDUP_STAGES=4"); the default library is put back at the end
#   ncu       Nsight Compute on the grouped GEMM at each of NCU_TOKENS (occupancy, issue, stalls)
# STEPS (default tests,profile,quick,ncu); JSON results under $OUT, every log in $OUT/logs.tgz (the device tool
# returns at most 8 files). EXTRA_NVCC builds a variant for all of it (bench/device_run.sh).
set -uo pipefail
OUT=${OUT:-/tmp/vllm-exl3-out}
STEPS=${STEPS:-tests,profile,quick,ncu}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/plugin"
t0=$(date +%s)
OUT=/tmp/our-build MAX_JOBS=${MAX_JOBS:-14} bash bench/device_run.sh none > "$OUT/build.log" 2>&1
grep -E "build.*rc=|sm_" "$OUT/build.log" | head -5
if has tests; then
  VLLM_EXL3_REQUIRE_NATIVE=1 VLLM_EXL3_TEST_REPORT_MOE="$OUT/test_bounds_moe.json" timeout 240 \
    python3 -m pytest -m gpu tests/kernels/gpu/test_moe.py -q -p no:cacheprovider --timeout 200 > "$OUT/tests_moe.log" 2>&1
  echo "MoE tests rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests_moe.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests_moe.log" | head -20
fi
if has profile; then
  VLLM_EXL3_PDL=0 timeout 120 python3 bench/moe.py --profile > "$OUT/moe-profile-pdl-off.jsonl" 2>&1
  echo "profile (PDL off) rc=$? at $(( $(date +%s) - t0 )) s"
fi
LAYERS=qwen3-30b-a3b:4,glm-4.5-air:4
if has quick; then
  timeout 120 python3 bench/moe.py --quick --layers $LAYERS --out "$OUT/moe-quick.json" > "$OUT/moe-quick.log" 2>&1
  echo "moe quick rc=$?:"; grep -E "^(qwen3|glm)" "$OUT/moe-quick.log"
fi
if has variants; then  # each NAME:FLAGS rebuilt here, then measured as bench/gpu/variants.sh measures a library
  for v in ${VARIANTS:-}; do
    name=${v%%:*} flags=${v#*:}
    OUT=/tmp/our-build-$name EXTRA_NVCC="${flags//,/ }" MAX_JOBS=${MAX_JOBS:-14} bash bench/device_run.sh none \
      > "$OUT/build-$name.log" 2>&1
    echo "variant $name: $(grep -E "build.*rc=" "$OUT/build-$name.log" | tail -1)"
    OUT=$OUT LAYERS=$LAYERS bash bench/gpu/variants.sh measure "$name" "${flags//,/ }"
  done
  [ -n "${VARIANTS:-}" ] && OUT=/tmp/our-build MAX_JOBS=${MAX_JOBS:-14} bash bench/device_run.sh none > /dev/null 2>&1
fi
if has ncu; then
  for tokens in ${NCU_TOKENS:-8 1024}; do
    timeout 200 ncu --clock-control none -k regex:moe_gemm_kernel --launch-skip 4 --launch-count 1 --set full \
      -f -o "/tmp/ncu_moe_$tokens" python3 bench/moe.py --ncu-tokens "$tokens" > "$OUT/ncu_moe_$tokens.log" 2>&1
    echo "ncu $tokens tokens rc=$?"
    ncu -i "/tmp/ncu_moe_$tokens.ncu-rep" --print-details all > "$OUT/ncu_moe_${tokens}_details.txt" 2>&1
    grep -E "Duration|Executed Instructions  |Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|No Eligible|Warp Cycles Per Issued|Memory Throughput|Compute \(SM\)" \
      "$OUT/ncu_moe_${tokens}_details.txt" | head -24
  done
fi
echo "done at $(( $(date +%s) - t0 )) s"
( cd "$OUT" && tar czf /tmp/moe-device-logs.tgz --exclude='*.json' --exclude='*.jsonl' . \
  && find . -maxdepth 1 -type f ! -name '*.json' ! -name '*.jsonl' -delete && mv /tmp/moe-device-logs.tgz logs.tgz )

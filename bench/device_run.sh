#!/usr/bin/env bash
# Everything one GPU-machine call does, in order: (optionally) start ExLlamaV3's JIT build in the background, build
# vllm_exl3._C, check its SASS, run the correctness harness, benchmark. Logs and JSON go to $OUT; a short table
# comes last on stdout.
#
#   bash bench/device_run.sh [tests|bench|all] [extra bench args...]      (carry: [".whl"] for ExLlamaV3)
#
# EXL=1 benchmarks ExLlamaV3 too (wheels from .whl, see ../shared/docs/h200-baseline.md; ~250 s JIT build, started
# first so it overlaps our build and tests).
set -uo pipefail
MODE=${1:-all}
shift || true
OUT=${OUT:-/tmp/vllm-exl3-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/plugin"
ARCH=${TORCH_CUDA_ARCH_LIST:-9.0a}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

EXL_SITE=/tmp/exl/site
if [ "${EXL:-0}" = 1 ]; then
  export TORCH_EXTENSIONS_DIR=/tmp/exl/ext
  [ -d $EXL_SITE/exllamav3 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $EXL_SITE .whl/*.whl
  ( t0=$(date +%s); PYTHONPATH=$EXL_SITE TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=10 python3 -c "import exllamav3.ext" \
      > "$OUT/exl_build.log" 2>&1; echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/exl_build.log" ) &
  EXL_PID=$!
fi

t0=$(date +%s)
# Built through torch's JIT loader with setup.py's own sources and flags (independent of the image's setuptools);
# the library lands where `import vllm_exl3._C` finds it.
TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=${MAX_JOBS:-8} python3 - > "$OUT/build.log" 2>&1 <<'PY'
import os, shutil, sys, sysconfig
sys.path.insert(0, ".")
import setup
from torch.utils.cpp_extension import load
a = setup.extension_args(os.environ["TORCH_CUDA_ARCH_LIST"])
os.makedirs("/tmp/vx-build", exist_ok=True)
load(name="_C", sources=a["sources"], extra_include_paths=a["include_dirs"], extra_cflags=a["cxx"],
     extra_cuda_cflags=a["nvcc"], extra_ldflags=["-lcublas"], build_directory="/tmp/vx-build",
     is_python_module=True, verbose=True)
shutil.copy("/tmp/vx-build/_C.so", "plugin/vllm_exl3/_C" + sysconfig.get_config_var("EXT_SUFFIX"))
PY
rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
if [ $rc != 0 ]; then grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1; fi
SO=$(ls plugin/vllm_exl3/_C*.so)
python3 tools/check-cubins "$SO" sm_${ARCH//./} | tee -a "$OUT/build.log"
python3 -m vllm_exl3.cli info 2>&1 | tail -12

if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  t0=$(date +%s)
  # The exllamav3 backend test runs after its JIT build (below); here it would only wait on the build's lock.
  VLLM_EXL3_REQUIRE_NATIVE=1 VLLM_EXL3_TEST_REPORT="$OUT/test_bounds.json" PYTHONPATH="$PWD/plugin" \
    timeout 420 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --timeout 300 -k "not exllamav3" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  [ -f "$OUT/test_bounds.json" ] && tr -d '\n' < "$OUT/test_bounds.json" | head -c 2000 && echo
fi

if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  BENCH_ARGS=("$@")
  if [ "${EXL:-0}" = 1 ]; then
    wait "$EXL_PID"; tail -2 "$OUT/exl_build.log"
    BENCH_ARGS+=(--exllamav3)
    PYTHONPATH="$PWD/plugin:$EXL_SITE" timeout 300 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
      -k exllamav3 > "$OUT/tests_exllamav3.log" 2>&1
    echo "exllamav3 backend test rc=$?"; tail -1 "$OUT/tests_exllamav3.log"
  fi
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
  PYTHONPATH="$PWD/plugin:$EXL_SITE" python3 bench/kernels.py --out "$OUT/$GPU-kernels.json" "${BENCH_ARGS[@]}" \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  grep -v "^{" "$OUT/bench.log" | tail -70
fi

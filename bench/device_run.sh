#!/usr/bin/env bash
# Everything one GPU-machine call does, in order: (optionally) start ExLlamaV3's JIT build in the background, build
# vllm_exl3.kernels._C, check its SASS, run the correctness harness, benchmark. Logs and JSON go to $OUT; a short table
# comes last on stdout.
#
#   bash bench/device_run.sh [tests,bench,ncu | all] [extra bench args...]
#   (ncu: NCU_TARGETS="K,N,BITS,CB,ROWS ...", NCU_KERNEL=panel_kernel for 17-64 rows;
#   VARIANTS="name:-DFLAG=1,-DOTHER=2,ENV=1 ..." rebuilds and re-times,
#   VARIANT_ARGS="--trace 4096,14336,4,mul1,1" adds bench arguments to those runs)      (carry: [".whl"] for ExLlamaV3)
#
# EXL=1 benchmarks ExLlamaV3 too (wheels from .whl, see bench/NOTES.md "Method"; ~250 s JIT build, started
# first so it overlaps our build and tests).
set -uo pipefail
MODE=${1:-all}
shift || true
[ "$MODE" = all ] && MODE=tests,bench
has() { [[ ",$MODE," == *",$1,"* ]]; }
OUT=${OUT:-/tmp/vllm-exl3-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/plugin"
ARCH=${TORCH_CUDA_ARCH_LIST:-9.0a}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

EXL_SITE=/tmp/exl/site
if [ "${EXL:-0}" = 1 ]; then
  # Every process that imports exllamav3 must see the same arch list as its JIT build: torch hashes the flags, and a
  # test or bench process with another list rebuilds (430 s) or waits on the build lock (lost a device session).
  # ExLlamaV3's JIT build takes the plain arch (9.0 for our 9.0a, 12.1 on a DGX Spark).
  export TORCH_EXTENSIONS_DIR=/tmp/exl/ext TORCH_CUDA_ARCH_LIST_EXL=${ARCH%a}
  [ -d $EXL_SITE/exllamav3 ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target $EXL_SITE .whl/*.whl
  ( t0=$(date +%s); PYTHONPATH=$EXL_SITE TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST_EXL MAX_JOBS=${EXL_JOBS:-14} python3 -c "import exllamav3.ext" \
      > "$OUT/exl_build.log" 2>&1; echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/exl_build.log" ) &
  EXL_PID=$!
fi

# Built through torch's JIT loader with setup.py's own sources and flags (independent of the image's setuptools);
# the library lands where `import vllm_exl3.kernels._C` finds it. build DIR [extra nvcc flags...]
build() {
  local dir=$1 t0; shift
  t0=$(date +%s)
  # The system compiler, not the GPU image's CXX/CC wrappers (/opt/gcc): a library they link carries its own static
  # libstdc++, whose streams crash the first TORCH_CHECK message built in it (bench/notes/serving-run-16.md
  # "Sixteenth run": a refusal segfaulted on torch 2.11 and 2.14 alike; /usr/bin/g++ builds pass).
  CXX=${KERNEL_CXX:-/usr/bin/g++} CC=${KERNEL_CC:-/usr/bin/gcc} \
  TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=${MAX_JOBS:-8} BUILD_DIR="$dir" EXTRA_NVCC="$*" python3 - \
    > "$OUT/build$(basename "$dir").log" 2>&1 <<'PY'
import os, shutil, sys, sysconfig
sys.path.insert(0, ".")
import setup
from torch.utils.cpp_extension import load
a = setup.extension_args(os.environ["TORCH_CUDA_ARCH_LIST"])
d = os.environ["BUILD_DIR"]
os.makedirs(d, exist_ok=True)
load(name="_C", sources=a["sources"], extra_include_paths=a["include_dirs"], extra_cflags=a["cxx"],
     extra_cuda_cflags=a["nvcc"] + os.environ["EXTRA_NVCC"].split(), extra_ldflags=["-lcublas"], build_directory=d,
     is_python_module=True, verbose=True)
shutil.copy(os.path.join(d, "_C.so"), "plugin/vllm_exl3/kernels/_C" + sysconfig.get_config_var("EXT_SUFFIX"))
PY
  local rc=$?
  echo "build $dir ${*:-(default flags)}: rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ $rc != 0 ]; then grep -E "error|Error" "$OUT/build$(basename "$dir").log" | head -40; exit 1; fi
  if ! ldd "$dir/_C.so" | grep -q 'libstdc++\.so'; then
    echo "build $dir: _C.so does not load libstdc++.so (a static copy linked in by the compiler); its error messages" \
         "would crash the process. Set KERNEL_CXX/KERNEL_CC to a compiler that links it dynamically."
    exit 1
  fi
}
# One build directory per set of extra flags: a variant with the default flags reuses the first build.
build_dir() { echo "/tmp/vx-build-$(echo "$*" | md5sum | cut -c1-8)"; }
read -ra EXTRA <<< "${EXTRA_NVCC:-}"  # extra nvcc flags for the main build (a tuning variant)
build "$(build_dir "${EXTRA[@]}")" "${EXTRA[@]}"
SO=$(ls plugin/vllm_exl3/kernels/_C*.so)
python3 tools/check-cubins "$SO" "sm_${ARCH//./}" | tee -a "$OUT/build.log"
python3 -m vllm_exl3.cli info 2>&1 | tail -12

if has tests; then
  t0=$(date +%s)
  # The exllamav3 backend test runs after its JIT build (below); here it would only wait on the build's lock.
  VLLM_EXL3_REQUIRE_NATIVE=1 VLLM_EXL3_TEST_REPORT="$OUT/test_bounds.json" PYTHONPATH="$PWD/plugin" \
    timeout 420 python3 -m pytest -m gpu tests/kernels/gpu -q -p no:cacheprovider --timeout 300 -k "not exllamav3" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  [ -f "$OUT/test_bounds.json" ] && tr -d '\n' < "$OUT/test_bounds.json" | head -c 2000 && echo
fi

if has ncu; then
  # Nsight Compute on the skinny kernel of each target (K,N,BITS,CB,ROWS): the full section set with SASS-level
  # source counters (stall reasons per instruction), printed as text for reading here.
  for t in ${NCU_TARGETS:-4096,14336,4,mul1,1}; do
    tag=$(echo "$t" | tr ',' '_')
    timeout 240 ncu --clock-control none -k "regex:${NCU_KERNEL:-skinny_kernel}" --launch-skip 2 --launch-count 1 --set full \
      --import-source yes -f -o "/tmp/ncu_$tag" python3 bench/kernels.py --ncu-target "$t" > "$OUT/ncu_$tag.log" 2>&1
    echo "ncu $t rc=$?"
    ncu -i "/tmp/ncu_$tag.ncu-rep" --print-details all > "$OUT/ncu_${tag}_details.txt" 2>&1
    ncu -i "/tmp/ncu_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${tag}_sass.csv" 2>&1
    grep -E "Duration|Executed Instructions  |Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Registers Per|No Eligible|Warp Cycles Per Issued" \
      "$OUT/ncu_${tag}_details.txt" | head -14
  done
fi

if has bench; then
  BENCH_ARGS=("$@")
  EXL_OK=0
  if [ "${EXL:-0}" = 1 ]; then
    # A build still running after EXL_WAIT_S (from the script's start) is given up: our own table still comes back
    # inside the device call's limit.
    while kill -0 "$EXL_PID" 2>/dev/null && (( SECONDS < ${EXL_WAIT_S:-420} )); do sleep 2; done
    if kill -0 "$EXL_PID" 2>/dev/null; then
      pkill -P "$EXL_PID"; kill -- "$EXL_PID"; echo "ExLlamaV3 build not done after ${EXL_WAIT_S:-420} s: benchmarking without it"
    else
      tail -2 "$OUT/exl_build.log"; BENCH_ARGS+=(--exllamav3); EXL_OK=1
    fi
  fi
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
  PYTHONPATH="$PWD/plugin:$EXL_SITE" TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST_EXL:-$ARCH} \
    python3 bench/kernels.py --out "$OUT/$GPU-kernels.json" "${BENCH_ARGS[@]}" \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  grep -v "^{" "$OUT/bench.log" | tail -70
  if [ "$EXL_OK" = 1 ]; then  # after the table, so a slow test cannot cost it
    PYTHONPATH="$PWD/plugin:$EXL_SITE" TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST_EXL timeout 120 \
      python3 -m pytest -m gpu tests/kernels/gpu -q -p no:cacheprovider \
      -k exllamav3 > "$OUT/tests_exllamav3.log" 2>&1
    echo "exllamav3 backend test rc=$?"; tail -1 "$OUT/tests_exllamav3.log"
  fi
fi

# VARIANTS="name:-DFLAG=1 name2:-DFLAG=2,ENV_VAR=0": rebuild with extra nvcc flags (items starting with -) and time
# the quick table for each, with the other items (VAR=VALUE) in the bench's environment (tuning).
for v in ${VARIANTS:-}; do
  name=${v%%:*}; flags=${v#*:}
  extra=(); envs=()
  for item in ${flags//,/ }; do
    if [[ $item == -* ]]; then extra+=("$item"); else envs+=("$item"); fi
  done
  build "$(build_dir "${extra[@]}")" "${extra[@]}"
  read -ra vargs <<< "${VARIANT_ARGS:-}"
  env "${envs[@]}" python3 bench/kernels.py --quick --iters 30 "${vargs[@]}" --out "$OUT/variant-$name.json" \
    > "$OUT/variant-$name.log" 2>&1
  echo "variant $name ${envs[*]} rc=$?"; grep -v "^{" "$OUT/variant-$name.log" | tail -20
done

# The device returns at most 8 files: everything but the results JSON travels as one archive.
( cd "$OUT" && tar czf /tmp/logs.tgz --exclude='*-kernels.json' . \
    && find . -maxdepth 1 -type f ! -name '*-kernels.json' -delete && mv /tmp/logs.tgz . )

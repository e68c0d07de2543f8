#!/usr/bin/env bash
# One kernel library against another, on the GPU machine: the MoE GPU tests, then bench/moe.py --quick on LAYERS
# (default the Qwen3 and GLM-4.5-Air shapes, 4-bit). A variant is adopted only if its tests pass and its table beats
# the default's from the same call.
#   bash bench/gpu/variants.sh                      after `source /tmp/vgpu/device.sh env`: each carried library
#                                                   (.vgpu/ext, then .vgpu/ext-NAME, built here by
#                                                   `bench/gpu/vgpu ext NAME "FLAGS"`) in turn; the default is put
#                                                   back at the end. Carry [".vgpu/ext", ".vgpu/ext-NAME", ...]
#   bash bench/gpu/variants.sh measure NAME FLAGS   only the library installed now (bench/moe_device.sh, which
#                                                   builds each variant on the machine)
# Results: $OUT/moe-quick-NAME.json and a line per library in $OUT/variants.jsonl (flags, test summary); logs in
# $LOGS (default: a folder packed into $OUT/variants-logs.tgz).
set -uo pipefail
OUT=${OUT:-/tmp/vgpu-out}
LAYERS=${LAYERS:-qwen3-30b-a3b:4,glm-4.5-air:4}
mkdir -p "$OUT"

measure() {  # NAME FLAGS: the library that `import vllm_exl3.kernels._C` finds now
  local name=$1 flags=$2 rc summary
  VLLM_EXL3_REQUIRE_NATIVE=1 timeout 240 python3 -m pytest -m gpu tests/kernels/gpu/test_moe.py -q -p no:cacheprovider \
    --timeout 200 > "$LOGS/tests-$name.log" 2>&1
  rc=$?
  summary=$(tail -1 "$LOGS/tests-$name.log")
  echo "$name (${flags:-default flags}): MoE tests rc=$rc: $summary"
  grep -E "^(FAILED|ERROR)" "$LOGS/tests-$name.log" | head -10
  timeout 150 python3 bench/moe.py --quick --layers "$LAYERS" --out "$OUT/moe-quick-$name.json" \
    > "$LOGS/quick-$name.log" 2>&1
  grep -E "^(qwen3|glm)" "$LOGS/quick-$name.log"
  python3 -c "import json, sys; print(json.dumps(dict(zip(('name', 'flags', 'tests_rc', 'tests'), sys.argv[1:]))))" \
    "$name" "$flags" "$rc" "$summary" >> "$OUT/variants.jsonl"
}

if [ "${1:-}" = measure ]; then
  LOGS=${LOGS:-$OUT}
  measure "$2" "${3:-}"
  exit 0
fi
LOGS=${LOGS:-$(mktemp -d)}
LIB=plugin/vllm_exl3/kernels/_C.abi3.so
use_library() { python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.decompress(open(sys.argv[1], 'rb').read()))" \
  "$1/_C.abi3.so.xz" "$LIB"; }
for dir in .vgpu/ext .vgpu/ext-*; do
  [ -f "$dir/_C.abi3.so.xz" ] || continue
  name=${dir#.vgpu/ext}
  name=${name#-}
  use_library "$dir"
  measure "${name:-default}" "$(cat "$dir/flags.txt" 2>/dev/null)"
done
use_library .vgpu/ext
tar czf "$OUT/variants-logs.tgz" -C "$LOGS" .

#!/usr/bin/env bash
# On the GPU machine, after `source /tmp/vgpu/device.sh env`: the kernel library of each carried variant
# (.vgpu/ext-NAME, built here by `bench/gpu/vgpu ext NAME "FLAGS"`) and the default one (.vgpu/ext), one after the
# other in one call: the MoE GPU tests, then bench/moe.py --quick on LAYERS (default the Qwen3 and GLM-4.5-Air
# shapes, 4-bit). A variant is adopted only if its tests pass and its table beats the default's from the same call.
# Results: $OUT/moe-quick-NAME.json, $OUT/variants.jsonl (flags and test summary per library), logs in
# $OUT/variants-logs.tgz. The default library is put back at the end. Carry [".vgpu/ext", ".vgpu/ext-NAME", ...].
set -uo pipefail
OUT=${OUT:-/tmp/vgpu-out}
LAYERS=${LAYERS:-qwen3-30b-a3b:4,glm-4.5-air:4}
LIB=plugin/vllm_exl3/kernels/_C.abi3.so
mkdir -p "$OUT"
logs=$(mktemp -d)
use_library() { python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.decompress(open(sys.argv[1], 'rb').read()))" \
  "$1/_C.abi3.so.xz" "$LIB"; }
for dir in .vgpu/ext .vgpu/ext-*; do
  [ -f "$dir/_C.abi3.so.xz" ] || continue
  name=${dir#.vgpu/ext}
  name=${name#-}
  name=${name:-default}
  flags=$(cat "$dir/flags.txt" 2>/dev/null)
  use_library "$dir"
  VLLM_EXL3_REQUIRE_NATIVE=1 timeout 240 python3 -m pytest -m gpu tests/kernels/gpu/test_moe.py -q -p no:cacheprovider \
    --timeout 200 > "$logs/tests-$name.log" 2>&1
  rc=$?
  summary=$(tail -1 "$logs/tests-$name.log")
  echo "$name (${flags:-default flags}): MoE tests rc=$rc: $summary"
  grep -E "^(FAILED|ERROR)" "$logs/tests-$name.log" | head -10
  timeout 150 python3 bench/moe.py --quick --layers "$LAYERS" --out "$OUT/moe-quick-$name.json" \
    > "$logs/quick-$name.log" 2>&1
  grep -E "^(qwen3|glm)" "$logs/quick-$name.log"
  python3 -c "import json, sys; print(json.dumps(dict(zip(('name', 'flags', 'tests_rc', 'tests'), sys.argv[1:]))))" \
    "$name" "$flags" "$rc" "$summary" >> "$OUT/variants.jsonl"
done
use_library .vgpu/ext
tar czf "$OUT/variants-logs.tgz" -C "$logs" .

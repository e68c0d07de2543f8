#!/usr/bin/env bash
# The exllamav3 backend's routed experts on the GPU machine, in one call (carry: [".whl"], ExLlamaV3 1.6.5 and its
# deps as wheels, bench/NOTES.md "Method"):
#   1. ExLlamaV3's JIT build in the background while ours builds; meanwhile the parity gate's cost
#      (bench/parity_cost.py) and a subset of the native MoE tests (`parity`), or the whole native GPU suite (`suite`);
#   2. the exllamav3 backend's GPU tests (its MoE tests, the fixture models' logits, the dense test) beside the
#      conversion of a 1-layer Qwen3-30B-A3B-shaped model by ExLlamaV3's own converter at BITS (default 4) bits;
#   3. bench/moe_exllamav3.py on that pack: native vs the exllamav3 backend vs ExLlamaV3's BlockSparseMLP (skipped
#      once BUDGET_S seconds are used); `graphbench`: bench/moe.py --backend exllamav3 (random trellis, no pack:
#      the backend's eager route and its capturable routes in a CUDA graph).
# STEPS (default parity,tests,bench); results and logs under $OUT. Rerun on a warm machine reuses /tmp.
set -uo pipefail
OUT=${OUT:-/tmp/vllm-exl3-out}
STEPS=${STEPS:-parity,tests,bench}
BITS=${BITS:-4}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
EXL_SITE=/tmp/exl/site
export TORCH_EXTENSIONS_DIR=/tmp/exl/ext
EXL_ENV=(env "PYTHONPATH=$PWD/plugin:$EXL_SITE" TORCH_CUDA_ARCH_LIST=9.0)  # one arch list for every exllamav3 import
[ -d $EXL_SITE/exllamav3 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $EXL_SITE .whl/*.whl
rm -f "$TORCH_EXTENSIONS_DIR"/*/lock
( t0=$(date +%s); "${EXL_ENV[@]}" MAX_JOBS="${EXL_JOBS:-12}" python3 -c "import exllamav3.ext" \
    > "$OUT/exl_build.log" 2>&1; echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/exl_build.log" ) &
EXL_PID=$!
if has parity || has suite; then  # our extension: the native side of the comparisons
  OUT=/tmp/our-build MAX_JOBS=4 bash bench/device_run.sh none > "$OUT/our_build.log" 2>&1
  grep -E "build.*rc=" "$OUT/our_build.log"
fi
if has parity; then
  PYTHONPATH="$PWD/plugin" timeout 120 python3 bench/parity_cost.py --out "$OUT/h200-parity-cost.json" \
    > "$OUT/parity_cost.log" 2>&1
  echo "parity cost rc=$?"; tail -1 "$OUT/parity_cost.log"
  VLLM_EXL3_REQUIRE_NATIVE=1 PYTHONPATH="$PWD/plugin" timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/gpu/test_moe.py -k "graph or tensor_parallel or expert_parallel or custom_op or activations" \
    > "$OUT/native_moe_tests.log" 2>&1
  echo "native moe subset rc=$?"; tail -1 "$OUT/native_moe_tests.log"
fi
if has suite; then  # ExLlamaV3's tests run after its build (below): here they would wait on its lock
  VLLM_EXL3_REQUIRE_NATIVE=1 PYTHONPATH="$PWD/plugin" timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/gpu -k "not exllamav3" > "$OUT/native_suite.log" 2>&1
  echo "native GPU suite rc=$?"; tail -1 "$OUT/native_suite.log"; grep -E "^(FAILED|ERROR)" "$OUT/native_suite.log" | head
fi
SRC=/tmp/moe-src DST=/tmp/moe-exl3-b$BITS
[ -f $SRC/config.json ] || python3 - <<'PY' > "$OUT/src_model.log" 2>&1
import json, shutil, torch, transformers
cfg = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                  num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                  vocab_size=2048, num_hidden_layers=1, norm_topk_prob=True)
torch.manual_seed(0)
transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/moe-src")
c = json.load(open("/tmp/moe-src/config.json")); c["num_experts"] = 128
json.dump(c, open("/tmp/moe-src/config.json", "w"), indent=1)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"tests/fixtures/exl3/qwen3moe-a-exl3-mcg-b3/{f}", f"/tmp/moe-src/{f}")
print("source model written")
PY
wait $EXL_PID
tail -1 "$OUT/exl_build.log"
CONV_PID=
if has bench && [ ! -f "$DST/config.json" ]; then
  ( t0=$SECONDS; "${EXL_ENV[@]}" timeout 240 python3 -m exllamav3.conversion.convert_model -i $SRC -o "$DST" \
      -w "/tmp/moe-work-b$BITS" -b "$BITS" -cr 16 -cc 256 > "$OUT/convert_b$BITS.log" 2>&1
    echo "convert rc=$? in $(( SECONDS - t0 )) s" >> "$OUT/convert_b$BITS.log" ) &
  CONV_PID=$!
fi
if has tests; then
  t0=$SECONDS
  "${EXL_ENV[@]}" VLLM_EXL3_REQUIRE_EXLLAMAV3=1 timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/gpu/test_moe_exllamav3.py tests/kernels/gpu/test_model_native.py -k "${TEST_K:-exllamav3}" -s -rf \
    tests/kernels/gpu/test_native.py > "$OUT/exl_moe_tests.log" 2>&1
  echo "exllamav3 moe tests rc=$? in $(( SECONDS - t0 )) s"
  grep -E "passed|failed|error" "$OUT/exl_moe_tests.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/exl_moe_tests.log" | head -30
fi
[ -n "$CONV_PID" ] && wait $CONV_PID
if has graphbench; then
  "${EXL_ENV[@]}" timeout "${BENCH_TIMEOUT:-200}" python3 bench/moe.py --backend exllamav3 \
    --layers "qwen3-30b-a3b:$BITS" --out "$OUT/h200-moe-exllamav3-backend-routes.json" > "$OUT/graphbench.log" 2>&1
  echo "graphbench rc=$?"; grep -v "^{" "$OUT/graphbench.log" | tail -13
fi
if has bench && (( SECONDS > ${BUDGET_S:-480} )); then echo "bench skipped: ${SECONDS} s used"
elif has bench; then
  tail -1 "$OUT/convert_b$BITS.log" 2>/dev/null
  "${EXL_ENV[@]}" timeout "${BENCH_TIMEOUT:-200}" python3 bench/moe_exllamav3.py --pack "$DST" \
    --label "qwen3-30b-a3b-${BITS}b" --out "$OUT/h200-moe-exllamav3-backend-b$BITS.json" > "$OUT/bench_b$BITS.log" 2>&1
  echo "bench rc=$?"; grep -v "^{" "$OUT/bench_b$BITS.log" | tail -14
fi
( cd "$OUT" && tar czf /tmp/logs.tgz --exclude='*.json' . && find . -maxdepth 1 -type f ! -name '*.json' -delete \
  && mv /tmp/logs.tgz . )

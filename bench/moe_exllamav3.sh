#!/usr/bin/env bash
# The MoE side-by-side on the GPU machine, in one call (carry: [".whl"], ExLlamaV3 1.6.5 and its deps as wheels):
# ExLlamaV3's JIT build in the background while ours builds; a 1-layer Qwen3-30B-A3B-shaped model (transformers,
# random bf16 weights, the fixture tokenizer) converted by ExLlamaV3's own converter at 4 bits, then 2 bits if time
# is left; bench/moe_exllamav3.py on each pack. Results and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/vllm-exl3-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
EXL_SITE=/tmp/exl/site
export TORCH_EXTENSIONS_DIR=/tmp/exl/ext
[ -d $EXL_SITE/exllamav3 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $EXL_SITE .whl/*.whl
rm -f "$TORCH_EXTENSIONS_DIR"/*/lock
( t0=$(date +%s); PYTHONPATH=$EXL_SITE TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${EXL_JOBS:-13} python3 -c "import exllamav3.ext" \
    > "$OUT/exl_build.log" 2>&1; echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/exl_build.log" ) &
EXL_PID=$!
OUT=/tmp/our-build MAX_JOBS=3 bash bench/device_run.sh none > "$OUT/our_build.log" 2>&1
grep -E "build.*rc=" "$OUT/our_build.log"
SRC=/tmp/moe-src
[ -f $SRC/config.json ] || python3 - <<'PY' > "$OUT/src_model.log" 2>&1
import json, shutil, torch, transformers
cfg = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                  num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                  vocab_size=2048, num_hidden_layers=1, norm_topk_prob=True)
torch.manual_seed(0)
model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained("/tmp/moe-src")
c = json.load(open("/tmp/moe-src/config.json")); c["num_experts"] = 128
json.dump(c, open("/tmp/moe-src/config.json", "w"), indent=1)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"tests/fixtures/exl3/qwen3moe-a-exl3-mcg-b3/{f}", f"/tmp/moe-src/{f}")
print("source model written")
PY
tail -1 "$OUT/src_model.log"
wait $EXL_PID
tail -1 "$OUT/exl_build.log"
for bits in 4 2; do
  if (( SECONDS > ${BUDGET_S:-420} )); then echo "skipping ${bits}-bit: ${SECONDS}s used"; continue; fi
  DST=/tmp/moe-exl3-b$bits
  t0=$SECONDS
  [ -f $DST/config.json ] || PYTHONPATH=$EXL_SITE TORCH_CUDA_ARCH_LIST=9.0 timeout 240 python3 -m exllamav3.conversion.convert_model \
      -i $SRC -o $DST -w /tmp/moe-work-b$bits -b $bits -cr 16 -cc 256 > "$OUT/convert_b$bits.log" 2>&1
  echo "convert ${bits}-bit rc=$? in $(( SECONDS - t0 )) s"; tail -2 "$OUT/convert_b$bits.log"
  PYTHONPATH="$PWD/plugin:$EXL_SITE" TORCH_CUDA_ARCH_LIST=9.0 timeout 150 python3 bench/moe_exllamav3.py --pack $DST \
      --label qwen3-30b-a3b-${bits}b --out "$OUT/h200-moe-exllamav3-b$bits.json" > "$OUT/bench_b$bits.log" 2>&1
  echo "bench ${bits}-bit rc=$?"; grep -v "^{" "$OUT/bench_b$bits.log" | tail -14
done
( cd "$OUT" && tar czf /tmp/moe-logs.tgz --exclude='*.json' . && find . -maxdepth 1 -type f ! -name '*.json' -delete && mv /tmp/moe-logs.tgz . )

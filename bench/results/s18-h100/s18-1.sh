#!/usr/bin/env bash
# Call 1 (eighteenth run): ExLlamaV3-made held-out packs (geometry b of all seven families, ERNIE/gpt-oss geometry a
# from the fixed sources) by tools/exl3-packs in the staged env, in the background; the 48-layer 4-bit pack written
# in the background; the native GPU kernel suite (with the new K-split rule's test) and bench/moe.py --quick (run.py's
# kernels step); once the packs are made, the rule's own picks beside the split table (--splits 0x0).
source /tmp/vgpu/device.sh env || exit 3
T0=$(date +%s); el() { echo "$(( $(date +%s) - T0 )) s"; }
python3 -c "import lzma;open('plugin/vllm_exl3/kernels/_C.abi3.so','wb').write(lzma.decompress(open('.vgpu/ext/_C.abi3.so.xz','rb').read()))"
mkdir -p $OUT/moe $OUT/packs
timeout 40 python3 bench/gpu/run.py --steps setup,exlbuild --budget 35 >/dev/null 2>&1   # installs the prebuilt ExLlamaV3 extension
ls /tmp/vgpu-run/exl-prebuilt/
export EXL=/tmp/exlp; mkdir -p $EXL/out; ln -sfn /tmp/vgpu/site $EXL/site
( export OUT=$EXL/out PYTHONPATH=/tmp/vgpu-run/exl-prebuilt:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/vgpu-run/exl-ext TORCH_CUDA_ARCH_LIST=9.0
  VARIANTS=ab timeout 150 python3 tools/exl3-packs/families.py make ernie45moe,gptoss > $EXL/make1.log 2>&1
  VARIANTS=b timeout 300 python3 tools/exl3-packs/families.py make mixtral,minimaxm2,qwen3next,qwen35moe,glm4moelite > $EXL/make2.log 2>&1
  echo done > $EXL/made ) &
MK=$!
timeout 250 python3 bench/gpu/run.py --steps kernels,packs --kernels native --packs qwen3-30b-a3b-4b --budget 240
echo "run.py rc=$? at $(el)"
wait $MK; echo "packs made at $(el)"; grep -v Warning $EXL/make1.log $EXL/make2.log | tail -25
timeout 60 python3 bench/moe.py --quick --tokens 1,2,3,4,5,6,8 --splits 0x0 \
  --layers qwen3-30b-a3b:4,glm-4.5-air:4,qwen3-30b-a3b:2 --out $OUT/moe/rule.json > $OUT/moe/rule.log 2>&1
echo "rule bench rc=$? at $(el)"; tail -25 $OUT/moe/rule.log
cp $EXL/out/golden.log $EXL/out/status-*.json $OUT/packs/ 2>/dev/null
for d in $EXL/work/arch/a/* $EXL/work/arch/b/*; do
  [ -f "$d/golden/meta.json" ] || continue
  tar -C "$(dirname "$d")" -czf "$OUT/packs/$(basename "$d").tgz" --exclude 'recon_*' "$(basename "$d")"
done
ls -la $OUT/packs; du -sh $OUT; cat /tmp/vgpu-run/results/packs.log 2>/dev/null | tail -2

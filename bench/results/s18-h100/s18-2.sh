#!/usr/bin/env bash
# Call 2 (eighteenth run): the 48-layer 4-bit pack served by this tree (the new K-split rule) and by the sixteenth
# run's build (main at 850508c) side by side (boot group 1), then vLLM's GPTQ 4-bit (group 2); c1-c5, 8, 32, 64 and
# prefill 2k / 8k (plan-x.toml).
source /tmp/vgpu/device.sh env || exit 3
T0=$(date +%s); el() { echo "$(( $(date +%s) - T0 )) s"; }
python3 -c "import lzma;open('plugin/vllm_exl3/kernels/_C.abi3.so','wb').write(lzma.decompress(open('.vgpu/ext/_C.abi3.so.xz','rb').read()))"
rm -rf /tmp/plugin-s16 && cp -r .vgpu/s16/plugin /tmp/plugin-s16
python3 -c "import lzma;open('/tmp/plugin-s16/vllm_exl3/kernels/_C.abi3.so','wb').write(lzma.decompress(open('.vgpu/s16/_C.abi3.so.xz','rb').read()))"
sed "s|@S16@|/tmp/plugin-s16:$PYTHONPATH|" .vgpu/calls/plan-x.toml > /tmp/plan-x.toml
# an H200 (139 GiB) holds all three 4-bit servers side by side: one boot instead of two
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$mem" -gt 100000 ] && sed -i 's/^boot-group = 2/boot-group = 1/' /tmp/plan-x.toml
grep -c "boot-group = 1" /tmp/plan-x.toml
mkdir -p $OUT/kernels
VLLM_EXL3_REQUIRE_NATIVE=1 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 50 tests/kernels/gpu/test_moe.py \
  tests/kernels/gpu/test_native.py -k "split or trace" > $OUT/kernels/split-trace.log 2>&1; echo "split/trace tests rc=$?"; tail -3 $OUT/kernels/split-trace.log
cat /tmp/vgpu-run/results/packs.log 2>/dev/null | tail -2; ls /tmp/vgpu-run/packs/qwen3-30b-a3b-4b/done.json
VGPU_PLAN=/tmp/plan-x.toml timeout ${LIMIT:-585} python3 bench/gpu/run.py --steps serve --budget ${BUDGET:-570}
echo "run.py rc=$? at $(el)"

#!/usr/bin/env bash
# On the GPU machine (bench/gpu/vgpu prepared the chunks):
#   bash .vgpu/cNN/device.sh stage      keep this call's chunk in /tmp/vgpu (one call per chunk folder); the folder
#                                       .vgpu/exl (bench/gpu/vgpu exl) holds ExLlamaV3's extension instead, kept in
#                                       /tmp/vgpu/exl for run.py (bench/gpu/exl_prebuilt.py)
#   source /tmp/vgpu/device.sh env      once all chunks are there: unpack (first time only), then export PYTHONPATH etc.
#                                       so that python3 imports the staged torch + vLLM, and vLLM finds the plugin from
#                                       ./plugin through its entry point (a dist-info written beside the staged tree)
S=/tmp/vgpu/site
case "${1:-}" in
stage)
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  mkdir -p /tmp/vgpu/parts /tmp/vgpu/exl && cp "$here"/device.sh /tmp/vgpu/
  if [ -f "$here"/exllamav3_ext.json ]; then
    cp "$here"/exllamav3_ext.* /tmp/vgpu/exl/
    echo "vgpu: ExLlamaV3's extension staged ($(du -sh /tmp/vgpu/exl | cut -f1))"
  else
    cp "$here"/part-* /tmp/vgpu/parts/
    echo "vgpu: $(find /tmp/vgpu/parts -name 'part-*' | wc -l) chunks staged ($(du -sh /tmp/vgpu/parts | cut -f1))"
  fi ;;
env)
  if [ ! -d $S/vllm ]; then
    mkdir -p $S
    if ! cat /tmp/vgpu/parts/part-* | gzip -dc | tar -x -C $S; then
      echo "vgpu: unpack failed (a chunk missing?)"
      rm -rf $S
      return 1
    fi
  fi
  plug=$S/vllm_exl3_checkout-0.dist-info
  mkdir -p $plug
  printf 'Metadata-Version: 2.1\nName: vllm-exl3-checkout\nVersion: 0\n' > $plug/METADATA
  printf '[vllm.general_plugins]\nexl3 = vllm_exl3:register\n[console_scripts]\nvllm-exl3 = vllm_exl3.cli:main\n' \
    > $plug/entry_points.txt
  # FlashInfer's JIT sources are stripped from the staged tree, so its sampler cannot build: vLLM's own sampler.
  export PYTHONPATH=$S:$PWD/plugin${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
  export PATH=$S/bin:$PATH
  python3 -c "import torch, vllm; print('vgpu: torch', torch.__version__, 'vllm', vllm.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1 ;;
*) echo "usage: device.sh stage | source device.sh env"; exit 2 ;;
esac

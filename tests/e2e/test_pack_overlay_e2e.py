"""End to end on vLLM's CPU build: an overlay (EXL3 routed experts + unquantized dense layers) served."""

from __future__ import annotations

import math

import pytest

from support.fixtures import pack_dir
from support.packs import copy_pack, dequantized_model
from support.servers import vllm_server
from vllm_exl3.format import packtools

pytestmark = pytest.mark.e2e


def test_overlay_of_exl3_experts_on_unquantized_dense_layers_serves(tmp_path):
    experts = copy_pack(pack_dir("qwen3moe-a-exl3-mcg-b3"), tmp_path / "experts")
    dense = dequantized_model(pack_dir("qwen3moe-a-exl3-mul1-b4"), tmp_path / "dense")
    out = tmp_path / "overlay"
    packtools.overlay(experts, dense, out)
    with vllm_server(out, tmp_path, "--dtype", "float32", "--enforce-eager") as server:
        r = server.post("/v1/completions", prompt="The history of the city begins", max_tokens=8, temperature=0,
                        logprobs=1)
        assert server.proc.poll() is None
    choice = r["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    assert all(math.isfinite(lp) for lp in choice["logprobs"]["token_logprobs"])
    log = server.log.read_text()
    assert "moe:mcg:3b:cpu -> torch" in log

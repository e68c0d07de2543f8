"""The Python copies of the MoE op's limits (kernels/backends/native_moe_limits.py, the one place Python writes them)
agree with csrc/moe.h and csrc/moe_planner.h (read from the source: no build, no GPU), and the places that size the
op's workspace use them: the native backend's reservation at load when vLLM gives no token budget, and the
appliance's memory plan."""

from __future__ import annotations

import re
import types
from pathlib import Path

import torch

from vllm_exl3.appliance import memory_plan
from vllm_exl3.dev.synthetic import expert_stack, random_weights
from vllm_exl3.kernels.backends import native_moe
from vllm_exl3.kernels.backends.native_moe_limits import MAX_LOCAL_EXPERTS, MOE_CHUNK_TOKENS
from vllm_exl3.kernels.interface import MoECall

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def cpp_constant(file: str, name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", (CSRC / file).read_text())
    assert m, f"{name} not found in csrc/{file}"
    return int(m.group(1))


def test_python_limits_match_csrc():
    assert MAX_LOCAL_EXPERTS == cpp_constant("moe.h", "kMoeMaxExperts")
    assert MOE_CHUNK_TOKENS == cpp_constant("moe_planner.h", "kMoeChunkTokens")
    for other in ("moe.h", "moe_bindings.cpp"):  # one C++ copy: moe_planner.h's
        assert "kMoeChunkTokens = " not in (CSRC / other).read_text()


def test_the_memory_plan_sizes_one_chunk():
    assert memory_plan.MOE_CHUNK_TOKENS is MOE_CHUNK_TOKENS


def test_native_binding_reserves_one_chunk_without_a_token_budget(monkeypatch):
    """A native binding without vLLM's max_tokens reserves the workspace for one whole chunk (the op's own cap)."""
    reserved = []
    fake_ops = types.SimpleNamespace(
        moe_prepare=lambda words, codebook: None,
        moe_expert_keys=lambda words, codebooks: torch.zeros(len(words), dtype=torch.int32),
        moe_plan=lambda words, codebooks: [],
        moe_reserve=lambda device, tokens, *rest: reserved.append(tokens) or 0)
    monkeypatch.setattr(torch.ops, "vllm_exl3", fake_ops, raising=False)
    weights = [[random_weights(128, 128, 2, "mcg", seed=3 * e + p) for p in range(3)] for e in range(2)]
    stack = expert_stack(weights, [0, 1])
    native_moe.BoundNativeMoE(stack, MoECall("silu", top_k=2))
    native_moe.BoundNativeMoE(stack, MoECall("silu", top_k=2, max_tokens=96))
    assert reserved == [MOE_CHUNK_TOKENS, 96]

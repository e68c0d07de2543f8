"""bench/moe_prefill.py's candidate prefill tier computes the layer: its sort-by-expert and two grouped GEMMs
(torch._grouped_mm, which has a CPU implementation) against the torch backend on the CPU, with the reference's W in
place of the native reconstruct, routing skewed so some experts get no rows. The GPU run adds the native op and
the timings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from vllm_exl3.dev.synthetic import expert_stack, random_weights
from vllm_exl3.format import reference as R
from vllm_exl3.kernels.backends.torch_ref import TorchBackend
from vllm_exl3.kernels.interface import MoECall

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    """bench/moe_prefill.py as a module; the sys.path entries it adds for its GPU run are taken back."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("moe_prefill", ROOT / "bench" / "moe_prefill.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_the_tier_matches_the_reference_layer():
    bench = load_bench()
    hidden, inter, experts, top_k, tokens = 256, 384, 6, 2, 40
    weights = [[random_weights(hidden, inter, 3, "mcg", seed=10 * e + p) for p in range(2)]
               + [random_weights(inter, hidden, 3, "mcg", seed=10 * e + 2)] for e in range(experts)]
    stack = expert_stack(weights, list(range(experts)))
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)  # 4 of 6
    w = torch.rand(tokens, top_k, generator=g).softmax(-1)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    tier = bench.Tier(stack, top_k, weight=lambda wt: R.full_weight(wt).to(torch.bfloat16))
    tier.reconstruct()
    y = tier.gemms(x, w, ids).float()
    ref = TorchBackend().bind_moe(stack, MoECall("silu", top_k=top_k))(x.float(), w, ids, None)
    assert torch.isfinite(y).all() and y.abs().sum() > 0
    assert ((y - ref).norm() / ref.norm()).item() < 2e-2

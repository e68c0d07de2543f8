"""Routed experts on the native kernels against the fp32 torch reference, on a GPU (`pytest -m gpu tests/gpu`).

Fresh random weights and inputs for every case, the output poisoned before each call: every codebook x bit width
(at the three row-chunk sizes the op picks by rows per expert), mixed widths and codebooks in one layer, E in {8, 16,
128}, top-k in {1, 2, 4, 8}, 1..4096 tokens (past the op's 1024-token chunk), skewed routing, expert parallelism
with -1 entries, tensor-parallel slices inside a 128-block, every activation (gpt-oss's clamped SwiGLU with the
clamp biting, its limit and alpha from the call), expert biases (gate/up and down, on every slice and rank), router
weight on the input,
fp16 / bf16, int32 / int64 ids; CUDA-graph replay bitwise equal to eager; two runs bitwise equal; no 16-bit copy
of any expert; the layer's plan made at bind (moe_plan: its kinds in launch order, its refusals) and the op's
refusal of a list that is not a plan.

Bounds: tests/support/moe_cases.py.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from vllm_exl3.dev.cuda_graph import capture
from vllm_exl3.dev.synthetic import expert_stack
from vllm_exl3.format.constants import CODEBOOKS

from support.gpu import native_or_skip
from support.moe_cases import DEV, add_biases, make_weights, rel, routing, through_custom_op
from support.moe_cases import run_case as run_backend_case

pytestmark = pytest.mark.gpu
native = native_or_skip()

from vllm_exl3.kernels import ops  # noqa: E402, F401  (registers torch.ops.vllm_exl3.*)
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402
from vllm_exl3.kernels.specs import ACTIVATIONS  # noqa: E402

WIDTHS = [(cb, float(b)) for cb in CODEBOOKS for b in range(1, 9)] + [("mul1", 1.5), ("mul1", 2.5), ("mul1", 3.5)]
_observed: dict[str, float] = defaultdict(float)
BACKEND = get_backend("native")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if path := os.environ.get("VLLM_EXL3_TEST_REPORT_MOE"):
        Path(path).write_text(json.dumps(dict(sorted(_observed.items())), indent=1))


def _note(key, err):
    _observed[key] = max(_observed[key], err)


def run_case(*, key=None, **kw):
    """One checked call of the native backend (support.moe_cases.run_case), its error noted under `key`."""
    dtype = kw.get("dtype", torch.float16)
    return run_backend_case(BACKEND, note=lambda err: _note(key or f"{dtype}", err), **kw)


@pytest.mark.parametrize("tokens", [3, 100, 600], ids=["rows8", "rows16", "rows64"])
@pytest.mark.parametrize("width", WIDTHS, ids=[f"{c}-{b:g}b" for c, b in WIDTHS])
def test_every_width_at_every_chunk_size(width, tokens):
    run_case(widths=(width,), tokens=tokens, seed=WIDTHS.index(width) * 10 + tokens % 7, key=f"{width[0]}-{width[1]:g}")


def test_mixed_widths_and_codebooks_in_one_layer():
    run_case(widths=(("mul1", 4.0), ("mcg", 3.0), ("mul1", 2.5), ("3inst", 2.0)), experts=8, tokens=40, seed=3)
    run_case(widths=(("mul1", 4.0), ("mcg", 3.0), ("mul1", 2.5), ("3inst", 2.0)), experts=8, tokens=700, seed=4)


@pytest.mark.parametrize("experts,top_k", [(8, 1), (16, 2), (16, 4), (128, 8)])
@pytest.mark.parametrize("tokens", [1, 8, 64, 513])
def test_experts_topk_tokens(experts, top_k, tokens):
    run_case(experts=experts, top_k=top_k, tokens=tokens, hidden=512, inter=256, seed=experts + top_k + tokens)


@pytest.mark.parametrize("splits", ["1x1", "2x1", "2x2", "3x2", "4x2", "3x3", "4x4"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_every_k_split_against_the_reference(monkeypatch, splits, tokens):
    """The op picks the K splits of its two GEMMs per shape at decode sizes (csrc/moe.h moe_k_splits; small layers
    like this one's get none): forced here (VLLM_EXL3_MOE_SPLITS13/2, as bench/moe.py --splits does), each split
    count's partial sums, with the biases and the clamp added once after them, against the reference, and the same
    call twice bit for bit."""
    s13, s2 = splits.split("x")
    monkeypatch.setenv("VLLM_EXL3_MOE_SPLITS13", s13)
    monkeypatch.setenv("VLLM_EXL3_MOE_SPLITS2", s2)
    x, tw, ti, emap, _, bound, y = run_case(activation="swigluoai", bias=True, x_scale=4.0, hidden=1536, inter=768,
                                            experts=16, top_k=4, tokens=tokens, seed=30 + tokens,
                                            key=f"splits-{splits}")
    assert torch.equal(bound(x, tw, ti, emap), y)


@pytest.mark.parametrize("tokens", [1025, 4096])
def test_past_the_internal_chunk(tokens):
    run_case(experts=16, top_k=4, tokens=tokens, hidden=256, inter=256, seed=tokens)


@pytest.mark.parametrize("skew", ["one", "few"])
@pytest.mark.parametrize("tokens", [5, 300])
def test_skewed_routing(skew, tokens):
    run_case(experts=16, top_k=2, tokens=tokens, skew=skew, seed=11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activations_and_dtypes(activation, dtype):
    run_case(activation=activation, dtype=dtype, tokens=33, seed=5, key=f"{dtype}-{activation}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tokens", [1, 8, 100, 600], ids=["t1", "t8", "rows16", "rows64"])
def test_clamped_swiglu_with_biases(tokens, dtype):
    """gpt-oss's experts: inputs at 4x scale put ~16 % of gate/up outputs past the clamp of 7 (std ~5)."""
    run_case(activation="swigluoai", bias=True, x_scale=4.0, dtype=dtype, tokens=tokens, experts=16, top_k=4,
             seed=21, key=f"{dtype}-swigluoai-bias")


def test_the_clamp_and_alpha_come_from_the_call():
    run_case(activation="swigluoai", limit=1.0, alpha=1.0, tokens=40, seed=22, key="swigluoai-limit1")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_biases_with_plain_activations(activation):
    run_case(activation=activation, bias=True, tokens=25, seed=23, key=f"{activation}-bias")


def test_biases_with_router_weight_on_input():
    run_case(activation="swigluoai", bias=True, top_k=1, rwoi=True, tokens=20, seed=24, key="swigluoai-bias-rwoi")


@pytest.mark.parametrize("span", [(0, 192), (96, 288)])
def test_biases_on_a_tensor_parallel_slice_and_an_expert_parallel_rank(span):
    run_case(activation="swigluoai", bias=True, x_scale=4.0, inter=384, tokens=17, tp=span, seed=25)
    run_case(activation="swigluoai", bias=True, experts=16, top_k=4, tokens=30, ep=(16, [0, 3, 7, 8, 15]), seed=26)


def test_ranks_with_biases_sum_to_the_whole():
    """The down bias lives on the first tensor-parallel rank only (integration/moe.py), so the ranks' sum is the
    whole layer's output, as vLLM's all-reduce makes it."""
    hidden, inter, experts, top_k, tokens = 256, 384, 8, 2, 24
    weights = make_weights(hidden, inter, experts, [("mul1", 4.0)], seed=27)
    x = torch.randn(tokens, hidden, device=DEV, dtype=torch.float16) * 4
    topk_weights, topk_ids = routing(tokens, experts, top_k, 27)
    call = MoECall("swigluoai", top_k=top_k, max_tokens=tokens)
    whole = expert_stack(weights, list(range(experts)))
    add_biases(whole, 28)
    full = BACKEND.bind_moe(whole, call)(x, topk_weights, topk_ids, None).float()
    tp_sum = 0
    for rank, (i0, i1) in enumerate(((0, 160), (160, 384))):
        s = expert_stack(weights, list(range(experts)), i0, i1)
        lo, hi = i0 // 128 * 128, -(-i1 // 128) * 128
        keep = torch.zeros(inter, device=DEV)
        keep[i0:i1] = 1
        s.w13_bias = (whole.w13_bias * keep)[..., lo:hi].contiguous()
        s.w2_bias = whole.w2_bias.clone() if rank == 0 else torch.zeros_like(whole.w2_bias)
        tp_sum = tp_sum + BACKEND.bind_moe(s, call)(x, topk_weights, topk_ids, None).float()
    assert rel(tp_sum, full) < 2e-3


def test_swiglu_with_biases_graph_replay_bitwise_equal():
    x, tw, ti, emap, stack, bound, y = run_case(activation="swigluoai", bias=True, x_scale=4.0, experts=16, top_k=4,
                                                tokens=8, seed=29)
    graph, out = capture(lambda: bound(x, tw, ti, emap))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y) and torch.equal(bound(x, tw, ti, emap), y)


def test_router_weight_on_input_top1():
    run_case(top_k=1, rwoi=True, tokens=20, seed=6)


def test_int64_ids_and_unpadded_hidden():
    run_case(ids_dtype=torch.int64, hidden=200, inter=300, tokens=9, seed=8)


def test_expert_parallel_map_with_minus_one():
    run_case(experts=16, top_k=4, tokens=50, ep=(16, [1, 4, 5, 9, 12, 15]), seed=9)


@pytest.mark.parametrize("span", [(0, 192), (192, 384), (96, 288), (128, 256)])
def test_tensor_parallel_slice_inside_a_block(span):
    run_case(inter=384, tokens=17, tp=span, seed=10)


def test_sums_of_tp_ranks_and_ep_ranks_equal_the_whole():
    hidden, inter, experts, top_k, tokens = 256, 384, 8, 2, 24
    weights = make_weights(hidden, inter, experts, [("mul1", 3.0)], seed=12)
    x = torch.randn(tokens, hidden, device=DEV, dtype=torch.float16)
    topk_weights, topk_ids = routing(tokens, experts, top_k, 12)
    whole = expert_stack(weights, list(range(experts)))
    call = MoECall("silu", top_k=top_k, max_tokens=tokens)
    full = BACKEND.bind_moe(whole, call)(x, topk_weights, topk_ids, None).float()
    tp_sum = sum(BACKEND.bind_moe(s, call)(x, topk_weights, topk_ids, None).float()
                 for s in (expert_stack(weights, list(range(experts)), 0, 160),
                           expert_stack(weights, list(range(experts)), 160, 384)))
    ep_sum = 0
    for part in ([0, 2, 4, 6], [1, 3, 5, 7]):
        emap = torch.full((experts,), -1, dtype=torch.int32, device=DEV)
        emap[part] = torch.arange(len(part), dtype=torch.int32, device=DEV)
        s = expert_stack(weights, part)
        ep_sum = ep_sum + BACKEND.bind_moe(s, call)(x, topk_weights, topk_ids, emap).float()
    assert rel(tp_sum, full) < 2e-3 and rel(ep_sum, full) < 2e-3


@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_graph_replay_bitwise_equal_and_deterministic(tokens):
    x, tw, ti, emap, stack, bound, y = run_case(experts=16, top_k=4, tokens=tokens, seed=13)
    again = bound(x, tw, ti, emap)
    assert torch.equal(again, y), "two eager runs differ"
    static_x, static_w, static_i = x.clone(), tw.clone(), ti.clone()
    before = torch.cuda.memory_allocated()  # the warm-up inside capture() must leave nothing behind either
    graph, out = capture(lambda: bound(static_x, static_w, static_i, emap))
    assert torch.cuda.memory_allocated() - before <= out.numel() * out.element_size() + 4096
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y), "graph replay differs from eager"
    # new inputs through the same graph: the routing is recomputed on the device
    tw2, ti2 = routing(tokens, 16, 4, 99)
    static_x.copy_(torch.randn_like(x))
    static_w.copy_(tw2)
    static_i.copy_(ti2)
    graph.replay()
    eager = bound(static_x, static_w, static_i, emap)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_no_sixteen_bit_copy_of_the_experts():
    """A native binding keeps two small key tensors; the only other memory is the shared workspace."""
    hidden, inter, experts = 2048, 768, 16
    weights = make_weights(hidden, inter, experts, [("mcg", 4.0)], seed=14)
    stack = expert_stack(weights, list(range(experts)))
    packed = sum(t.numel() * t.element_size() for t in (stack.w13_trellis, stack.w2_trellis))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    bound = BACKEND.bind_moe(stack, MoECall("silu", top_k=8, max_tokens=1))  # 1 token: the workspace adds ~1 MB at most
    after = torch.cuda.memory_allocated()
    assert sum(t.numel() * t.element_size() for t in bound.keys) < 4096
    assert after - before < 0.05 * packed, (after - before, packed)


@pytest.mark.parametrize("words,codebooks,message", [
    ([20], [1], "expert trellis words 20 is not 16 \\* bits"),
    ([136], [2], "expert trellis words 136 is not 16 \\* bits"),
    ([32], [3], "codebook index 3 is not 0..2"),
    ([24], [1], "half-integer bit widths need mul1"),
    ([72], [2], "half-integer bit widths need mul1"),
    ([32, 32], [1], "one codebook per weight"),
], ids=["not-16-bits", "past-8-bits", "codebook", "half-integer-mcg", "half-integer-past-3.5", "one-codebook-short"])
def test_the_plan_refuses_widths_no_kernel_runs(words, codebooks, message):
    """At bind, with the messages the op gave per call when it walked every expert's width."""
    with pytest.raises(RuntimeError, match=message):
        torch.ops.vllm_exl3.moe_plan(words, codebooks)


def test_the_plan_holds_each_kind_once_in_key_order():
    # mul1 4 bits, mcg 3 bits, mul1 2.5 bits twice; key = words * 4 + codebook (csrc/moe.h moe_weight_key)
    assert torch.ops.vllm_exl3.moe_plan([64, 48, 40, 40], [2, 1, 2, 2]) == [162, 5, 2, 193, 6, 1, 258, 8, 2]


@pytest.mark.parametrize("plan,message", [
    ([], "must be a moe_plan"),
    ([256, 8], "must be a moe_plan"),
    ([272, 17, 0], "holds width 17"),
    ([256, 8, 3], "codebook index 3 is not 0..2"),
    ([161, 5, 1], "half-integer bit widths need mul1"),
    ([257, 8, 0], "is not a moe_plan"),
    ([257, 8, 1, 256, 8, 0], "is not a moe_plan"),
    ([257, 8, 1, 257, 8, 1], "is not a moe_plan"),
], ids=["empty", "not-triples", "width", "codebook", "half-integer", "wrong-key", "descending", "twice"])
def test_the_op_refuses_a_list_that_is_not_a_plan(plan, message):
    x, tw, ti, _, _, bound, _ = run_case(tokens=4, seed=16)
    args = list(bound.args)
    names = [a.name for a in torch.ops.vllm_exl3.native_moe.default._schema.arguments[4:]]
    args[names.index("w13_plan")] = plan
    with pytest.raises(RuntimeError, match=message):
        torch.ops.vllm_exl3.native_moe(x, tw, ti, bound.no_map, *args)


def test_through_the_custom_op():
    x, tw, ti, emap, stack, bound, y = run_case(tokens=12, seed=15)
    assert torch.equal(through_custom_op(bound, x, tw, ti), y)


def test_auto_picks_native_for_moe_on_cuda(monkeypatch):
    from vllm_exl3.kernels import selection, specs

    monkeypatch.setenv("VLLM_EXL3_KERNEL", "auto")
    spec = specs.MoESpec(("mcg",) * 3, (4.0,) * 3, 2048, 768, 128, "silu", torch.bfloat16, "cuda")
    assert selection.choose_moe_backend(spec).name == "native"

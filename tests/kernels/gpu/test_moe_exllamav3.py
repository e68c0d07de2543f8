"""Routed experts on the exllamav3 backend (ExLlamaV3's own BlockSparseMLP over our stacks) against the fp32 torch
reference, on a GPU with the `exllamav3` package (`pytest -m gpu`; skipped without it unless
VLLM_EXL3_REQUIRE_EXLLAMAV3=1).

Fresh random weights and inputs for every case, outputs poisoned: the three codebooks at every bit width ExLlamaV3
has expert kernels for, on both sides of its 8-token decode tier; E, top-k and 1..513 tokens; expert parallelism
with -1 entries; tensor-parallel slices inside a 128-block; the activations it implements (gpt-oss's clamped
SwiGLU with the clamp biting) and expert biases, on both sides of the decode tier, on slices and under graphs; router
weight on the input; fp16 and bf16; two eager runs bitwise equal; CUDA graphs at decode sizes (ExLlamaV3's own route) and above
(the capturable routes of exllamav3_moe.py), replayed on new inputs; no 16-bit copy of the experts; the custom op.
Bounds: tests/support/moe_cases.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_exl3.dev.cuda_graph import capture
from vllm_exl3.dev.synthetic import expert_stack

from support.moe_cases import BOUND, make_weights, reference, rel, routing, run_case, through_custom_op

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.backends import exllamav3_moe  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402

BACKEND = get_backend("exllamav3")
if (_why := BACKEND.unavailable_reason() or exllamav3_moe.api_reason()) is not None:
    if os.environ.get("VLLM_EXL3_REQUIRE_EXLLAMAV3") == "1":
        raise RuntimeError(f"exllamav3 backend unavailable: {_why}")
    pytest.skip(f"exllamav3 backend unavailable: {_why}", allow_module_level=True)

WIDTHS = [(cb, float(b)) for cb in ("3inst", "mcg", "mul1") for b in range(1, 9)] + [("mul1", 2.5)]


def case(**kw):
    return run_case(BACKEND, **kw)


@pytest.mark.parametrize("tokens", [3, 40], ids=["decode", "above-decode"])
@pytest.mark.parametrize("width", WIDTHS, ids=[f"{c}-{b:g}b" for c, b in WIDTHS])
def test_every_codebook_and_width(width, tokens):
    case(widths=(width,), tokens=tokens, seed=WIDTHS.index(width) * 10 + tokens)


@pytest.mark.parametrize("experts,top_k", [(8, 1), (16, 2), (16, 4), (128, 8)])
@pytest.mark.parametrize("tokens", [1, 8, 64, 513])
def test_experts_topk_tokens(experts, top_k, tokens):
    case(experts=experts, top_k=top_k, tokens=tokens, hidden=512, inter=256, widths=(("mul1", 4.0),),
         seed=experts + top_k + tokens)


@pytest.mark.parametrize("tokens", [5, 50])
def test_expert_parallel_map_with_minus_one(tokens):
    case(experts=16, top_k=4, tokens=tokens, ep=(16, [1, 4, 5, 9, 12, 15]), seed=9)


@pytest.mark.parametrize("tokens", [4, 17])
@pytest.mark.parametrize("span", [(0, 192), (192, 384), (96, 288), (128, 256)])
def test_tensor_parallel_slice_inside_a_block(span, tokens):
    case(inter=384, tokens=tokens, tp=span, seed=10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", sorted(exllamav3_moe.ACTIVATION))
@pytest.mark.parametrize("tokens", [6, 33])
def test_activations_and_dtypes(activation, dtype, tokens):
    case(activation=activation, dtype=dtype, tokens=tokens, seed=5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tokens", [1, 6, 40], ids=["t1", "decode", "above-decode"])
def test_clamped_swiglu_with_biases(tokens, dtype):
    """gpt-oss's experts: inputs at 4x scale put ~16 % of gate/up outputs past the clamp of 7."""
    case(activation="swigluoai", bias=True, x_scale=4.0, dtype=dtype, tokens=tokens, experts=16, top_k=4, seed=21)


@pytest.mark.parametrize("tokens", [4, 17])
@pytest.mark.parametrize("span", [(0, 192), (96, 288)])
def test_biases_on_a_tensor_parallel_slice(span, tokens):
    case(activation="swigluoai", bias=True, x_scale=4.0, inter=384, tokens=tokens, tp=span, seed=25)


def test_biases_with_router_weight_on_input_and_expert_parallelism():
    case(activation="swigluoai", bias=True, top_k=1, rwoi=True, tokens=20, seed=24)
    case(activation="silu", bias=True, experts=16, top_k=4, tokens=30, ep=(16, [0, 3, 7, 8, 15]), seed=26)


def test_a_limit_is_passed_and_another_alpha_refused():
    case(activation="swigluoai", limit=1.0, tokens=12, seed=22)
    with pytest.raises(ValueError, match="alpha"):
        case(activation="swigluoai", alpha=1.0, tokens=4, seed=22)


@pytest.mark.parametrize("tokens", [5, 40])
def test_swiglu_with_biases_under_a_cuda_graph(tokens):
    x, tw, ti, emap, stack, bound, y = case(activation="swigluoai", bias=True, x_scale=4.0, experts=16, top_k=4,
                                            tokens=tokens, seed=29)
    graph, out = capture(lambda: bound(x, tw, ti, emap))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(x, tw, ti, emap, stack, MoECall("swigluoai"))
    assert rel(out, ref) < BOUND[x.dtype]


def test_router_weight_on_input_top1():
    case(top_k=1, rwoi=True, tokens=20, seed=6)


def test_int64_ids_and_unpadded_hidden():
    case(ids_dtype=torch.int64, hidden=200, inter=300, tokens=9, seed=8)


def test_erf_gelu_and_mixed_layers_are_declined():
    from vllm_exl3.kernels.specs import MoESpec

    spec = MoESpec(("mcg",) * 6, (4.0,) * 6, 256, 384, 2, "gelu", torch.float16, "cuda")
    assert "tanh" in BACKEND.moe_unsupported_reason(spec)
    mixed = MoESpec(("mcg", "mcg", "mcg", "mul1", "mul1", "mul1"), (4.0,) * 6, 256, 384, 2, "silu", torch.float16,
                    "cuda")
    assert "codebooks" in BACKEND.moe_unsupported_reason(mixed)


def test_two_eager_runs_bitwise_equal():
    for tokens in (4, 300):
        x, tw, ti, emap, stack, bound, y = case(experts=16, top_k=4, tokens=tokens, seed=13)
        assert torch.equal(bound(x, tw, ti, emap), y)


# Above 8 tokens: the fused route (mcg, mul1; mul1's half-integer rates take their own kernel instances there), the
# decode-chunk route (3inst).
GRAPH_WIDTHS = [("mcg", 4.0), ("3inst", 4.0), ("mul1", 4.0), ("mul1", 3.5)]


@pytest.mark.parametrize("width", GRAPH_WIDTHS, ids=[f"{c}-{b:g}b" for c, b in GRAPH_WIDTHS])
@pytest.mark.parametrize("tokens", [1, 8, 40, 64, 512])
def test_graph_capture_and_replay(width, tokens):
    x, tw, ti, emap, stack, bound, y = case(experts=16, top_k=4, tokens=tokens, widths=(width,), seed=14)
    static_x, static_w, static_i = x.clone(), tw.clone(), ti.clone()
    graph, out = capture(lambda: bound(static_x, static_w, static_i, emap))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(x, tw, ti, emap, stack, MoECall("silu"))
    assert torch.isfinite(out).all() and rel(out, ref) < BOUND[torch.float16]
    if tokens <= exllamav3_moe.MAX_DECODE_TOKENS:
        assert torch.equal(out, y), "graph replay differs from eager on ExLlamaV3's own decode route"
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first), "two replays differ"
    tw2, ti2 = routing(tokens, 16, 4, 99)  # new inputs through the same graph
    static_x.copy_(torch.randn_like(x))
    static_w.copy_(tw2)
    static_i.copy_(ti2)
    graph.replay()
    torch.cuda.synchronize()
    ref2 = reference(static_x, static_w, static_i, emap, stack, MoECall("silu"))
    assert rel(out, ref2) < BOUND[torch.float16]


def test_no_sixteen_bit_copy_of_the_experts():
    """Past ExLlamaV3's per-device buffers (shared by every layer, made by the first), a layer adds only pointer
    tables and markers: far under 5% of its packed size."""
    hidden, inter, experts = 2048, 768, 16
    stacks = [expert_stack(make_weights(hidden, inter, experts, [("mcg", 4.0)], seed=s), list(range(experts)))
              for s in (15, 16)]
    call = MoECall("silu", top_k=8, max_tokens=1)
    bound = [BACKEND.bind_moe(stacks[0], call)]  # the first binding makes the per-device buffers
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    bound.append(BACKEND.bind_moe(stacks[1], call))
    torch.cuda.synchronize()
    packed = sum(t.numel() * t.element_size() for t in (stacks[1].w13_trellis, stacks[1].w2_trellis))
    assert torch.cuda.memory_allocated() - before < 0.05 * packed


def test_through_the_custom_op():
    x, tw, ti, emap, stack, bound, y = case(tokens=12, seed=17)
    assert torch.equal(through_custom_op(bound, x, tw, ti), y)


def test_named_exllamav3_serves_moe(monkeypatch):
    from vllm_exl3.kernels import selection, specs

    monkeypatch.setenv("VLLM_EXL3_KERNEL", "exllamav3")
    monkeypatch.setenv("VLLM_EXL3_KERNEL_STRICT", "1")
    spec = specs.MoESpec(("mcg",) * 3, (4.0,) * 3, 2048, 768, 128, "silu", torch.bfloat16, "cuda")
    assert selection.choose_moe_backend(spec).name == "exllamav3"


def test_built_while_the_default_dtype_is_bf16():
    """vLLM builds the layers while torch's default dtype is the model's: ExLlamaV3's intermediates must stay fp16
    (left to the default, a bf16 model's load died in BC_BlockSparseMLP: "gu_u is incorrect datatype")."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        case(dtype=torch.bfloat16, tokens=5, seed=14)
    finally:
        torch.set_default_dtype(before)

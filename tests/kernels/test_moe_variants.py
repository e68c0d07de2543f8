"""The routed experts' variants the new families need, on the torch reference (the oracle the GPU kernels are checked
against): gpt-oss's clamped SwiGLU and the experts' biases, against a naive fp64 computation from the full weights;
tensor- and expert-parallel ranks summing to the whole with biases (the down projection's bias added once); that
both GPU backends take them, and the layer type saying which variant a layer is. The GPU backends' numbers are the
GPU suite's (tests/kernels/gpu/test_moe.py, test_moe_exllamav3.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_exl3.dev.synthetic import expert_stack, random_weights
from vllm_exl3.format import reference as R
from vllm_exl3.kernels import selection
from vllm_exl3.kernels.backends import exllamav3_moe, native_moe
from vllm_exl3.kernels.backends.torch_ref import decoded_experts, gated, moe_all_tokens, moe_routed_tokens
from vllm_exl3.kernels.interface import MoECall
from vllm_exl3.kernels.specs import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, MoESpec

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 256, 256, 4, 2, 11
SWIGLUOAI = MoECall("swigluoai", top_k=TOP_K)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def case():
    """Experts of mixed bits and codebooks, fp32 biases, inputs large enough that the clamp bites on gate and up."""
    g = torch.Generator().manual_seed(11)
    cfgs = [(4, "mul1"), (3, "mcg"), (2.5, "mul1"), (2, "3inst")]
    weights = [[random_weights(HIDDEN, INTER, *cfgs[e], seed=100 + 10 * e + p, scale=4 / HIDDEN ** 0.5)
                for p in range(2)] + [random_weights(INTER, HIDDEN, *cfgs[e], seed=100 + 10 * e + 2)]
               for e in range(EXPERTS)]
    b13 = torch.randn(EXPERTS, 2, INTER, generator=g)
    b2 = torch.randn(EXPERTS, HIDDEN, generator=g)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)]).to(torch.int32)
    w = torch.rand(TOKENS, TOP_K, generator=g).softmax(-1)
    return weights, b13, b2, x, w, ids


def stack(weights, b13, b2, experts, i0=0, i1=INTER, first_rank=True):
    s = expert_stack(weights, list(experts), i0, i1)
    lo = i0 // 128 * 128
    hi = -(-i1 // 128) * 128
    s.w13_bias = b13[list(experts)][..., lo:hi].contiguous()
    s.w2_bias = b2[list(experts)].clone() if first_rank else torch.zeros(len(experts), HIDDEN)
    return s


def naive(weights, b13, b2, x, w, ids) -> torch.Tensor:
    """Token by token, expert by expert, fp64, the formula as vLLM's SwigluOAIAndMul and transformers write it."""
    full = [[R.full_weight(v).double() for v in ws] for ws in weights]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gw, uw, dw = full[e]
            gate = (x[t].double() @ gw + b13[e, 0].double()).clamp(max=SWIGLUOAI_LIMIT)
            up = (x[t].double() @ uw + b13[e, 1].double()).clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
            h = gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate) * (up + 1)
            out[t] += w[t, k].double() * (h @ dw + b2[e].double())
    return out


def test_the_clamp_is_exercised(case):
    weights, b13, _, x, _, _ = case
    gate = x @ R.full_weight(weights[0][0]) + b13[0, 0]
    assert (gate > SWIGLUOAI_LIMIT).any() and (gate < -SWIGLUOAI_LIMIT).any()


@pytest.mark.parametrize("run", [moe_routed_tokens, moe_all_tokens], ids=["routed-tokens", "all-tokens"])
def test_swigluoai_with_biases_matches_naive(case, run):
    weights, b13, b2, x, w, ids = case
    s = stack(weights, b13, b2, range(EXPERTS))
    y = run(x, w, ids, None, s, decoded_experts(s), SWIGLUOAI)
    assert rel(y, naive(weights, b13, b2, x, w, ids)) < 1e-5


@pytest.mark.parametrize("limit, alpha", [(3.0, 1.0), (100.0, 2.5)])
def test_the_clamp_and_alpha_come_from_the_call(limit, alpha):
    gate, up = torch.tensor([-8.0, 0.5, 9.0]), torch.tensor([-9.0, 0.25, 8.0])
    got = gated(MoECall("swigluoai", limit=limit, alpha=alpha))(gate, up)
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    assert torch.equal(got, g * torch.sigmoid(alpha * g) * (u + 1))


@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_ranks_with_biases_sum_to_the_whole(case, tp):
    """Intermediate 256 per rank: 128 (aligned) at tp 2, 85-86 (inside blocks) at tp 3; only rank 0 adds the
    down projection's bias (the ranks' partial sums are all-reduced)."""
    weights, b13, b2, x, w, ids = case
    bounds = [round(r * INTER / tp) for r in range(tp + 1)]
    total = sum(moe_routed_tokens(x, w, ids, None, s, decoded_experts(s), SWIGLUOAI)
                for r in range(tp) for s in [stack(weights, b13, b2, range(EXPERTS), bounds[r], bounds[r + 1],
                                                   first_rank=r == 0)])
    assert rel(total, naive(weights, b13, b2, x, w, ids)) < 1e-5


def test_expert_parallel_ranks_with_biases_sum_to_the_whole(case):
    weights, b13, b2, x, w, ids = case
    total = 0
    for local in ([0, 1], [2, 3]):
        expert_map = torch.full((EXPERTS,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(len(local), dtype=torch.int32)
        s = stack(weights, b13, b2, local)
        total = total + moe_routed_tokens(x, w, ids, expert_map, s, decoded_experts(s), SWIGLUOAI)
    assert rel(total, naive(weights, b13, b2, x, w, ids)) < 1e-5


def _spec(activation="silu", has_bias=False, device="cuda"):
    return MoESpec(("mul1",) * 12, (4.0,) * 12, HIDDEN, INTER, EXPERTS, activation, torch.float16, device, has_bias)


@pytest.mark.parametrize("backend", [native_moe, exllamav3_moe], ids=["native", "exllamav3"])
def test_both_gpu_backends_take_the_clamped_swiglu_and_biases(backend):
    assert backend.unsupported_reason(_spec("swigluoai", True)) is None


def test_the_layer_type_names_a_variant():
    assert selection.moe_layer_type(_spec()) == "moe:mul1:4b:cuda"
    assert selection.moe_layer_type(_spec("swigluoai", True, "cpu")) == "moe:mul1:4b:swigluoai:bias:cpu"

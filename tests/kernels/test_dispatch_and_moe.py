"""Kernel dispatch, the custom ops (under torch.compile), the torch MoE backend, and the vLLM version gate."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys

import pytest
import torch

from vllm_exl3.kernels import backend as kbackend
from vllm_exl3.kernels import errors, interface, requested, selection, specs
from vllm_exl3.format import reference as R
from vllm_exl3.kernels.specs import LinearSpec
from support.backends import WrongNative
from vllm_exl3.kernels import ops
from vllm_exl3.kernels.backends.torch_ref import TorchBackend, decoded_experts, moe_all_tokens, moe_routed_tokens
from vllm_exl3.kernels.interface import MoECall
from vllm_exl3.dev.synthetic import expert_stack, random_weights


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------------------
def spec(device="cpu"):
    return LinearSpec("mul1", 4.0, 256, 256, torch.bfloat16, device)


def test_auto_picks_an_available_backend_and_records_why_others_were_skipped(monkeypatch):
    monkeypatch.setenv(requested.KERNEL_ENV, "auto")
    backend = selection.choose_linear_backend(spec())
    assert backend.unavailable_reason() is None and backend.linear_unsupported_reason(spec()) is None
    decision = next(d for d in selection.decision_counts() if d.layer_type == "linear:mul1:4b:cpu")
    assert decision.backend == backend.name
    skipped = [name for name, _ in decision.fallback_reasons]
    assert skipped == list(requested.PREFERENCE[: requested.PREFERENCE.index(backend.name)])
    assert all(reason for _, reason in decision.fallback_reasons)


def test_explicit_backend_that_is_unavailable_is_an_error(monkeypatch):
    monkeypatch.setenv(requested.KERNEL_ENV, "native")
    monkeypatch.setattr(kbackend.get_backend("torch"), "unavailable_reason", lambda: None)
    native = kbackend.REGISTRY.get("native")
    if native is not None:
        monkeypatch.setattr(native, "unavailable_reason", lambda: "no CUDA device")
    monkeypatch.setenv(requested.STRICT_ENV, "1")  # strict or not: the user named it, so it is an error
    with pytest.raises(errors.BackendUnavailableError,
                       match="^VLLM_EXL3_KERNEL=native: that backend is unavailable here: ") as e:
        selection.choose_linear_backend(spec())
    assert (e.value.setting, e.value.value) == ("VLLM_EXL3_KERNEL", "native") and e.value.reason


class _NoMoE(interface.Backend):
    name = "exllamav3"

    def linear_unsupported_reason(self, spec):
        return None


def test_explicit_backend_falls_back_for_layer_types_it_lacks_unless_strict(monkeypatch, caplog):
    """The exllamav3 compose profile must still boot a model whose experts that backend cannot run."""
    monkeypatch.setitem(kbackend.REGISTRY, "exllamav3", _NoMoE())
    monkeypatch.setenv(requested.KERNEL_ENV, "exllamav3")
    moe = specs.MoESpec(("mcg",), (3.0,), 256, 128, 8, "silu", torch.bfloat16, "cpu")
    assert selection.choose_linear_backend(spec()).name == "exllamav3"
    log = logging.getLogger("vllm_exl3.kernels")  # the plugin's logger may not propagate (register())
    log.addHandler(caplog.handler)
    try:
        assert selection.choose_moe_backend(moe).name == "torch"
    finally:
        log.removeHandler(caplog.handler)
    assert "exllamav3 backend cannot serve it" in caplog.text
    monkeypatch.setenv(requested.STRICT_ENV, "1")
    with pytest.raises(errors.FallbackRefusedError, match=r"^VLLM_EXL3_KERNEL_STRICT=1: VLLM_EXL3_KERNEL=exllamav3 "
                                                          r"cannot serve moe:mcg:3b:cpu \(.*\) and falling back to "
                                                          r"torch is forbidden"):
        selection.choose_moe_backend(moe)
    monkeypatch.setenv(requested.STRICT_ENV, "sometimes")
    with pytest.raises(ValueError, match="VLLM_EXL3_KERNEL_STRICT='sometimes': expected a boolean"):
        selection.choose_moe_backend(moe)


def test_unknown_kernel_name(monkeypatch):
    monkeypatch.setenv(requested.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="expected one of auto, native, exllamav3, torch"):
        requested.requested_kernel()


# ---------------------------------------------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------------------------------------------
def test_linear_op_matches_reference_and_traces_whole_under_compile():
    w = random_weights(320, 200, 3, "mcg", seed=1)
    bound = TorchBackend().bind_linear(w, 0, 0, 200)
    ops.serve(bound)

    def f(x):
        return torch.ops.vllm_exl3.linear(x, w.trellis, 200) * 2

    x = torch.randn(7, 320)
    expected = 2 * R.forward(x, w, out_features=200)
    assert rel(f(x), expected) < 1e-5
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (7, 1, 33):  # one graph for every row count: the op decides GEMV/GEMM inside, at run time
        x = torch.randn(rows, 320)
        assert rel(compiled(x), 2 * R.forward(x, w, out_features=200)) < 1e-5


def test_linear_op_output_has_the_fakes_layout_under_inductor():
    """Out 160 (stored 256): the torch backend's product is a column slice of the stored blocks. The op hands back
    the fake's contiguous layout; before, Inductor read it with the fake's strides (a GLM-4.7-Flash kv_a_proj_with_mqa,
    576 of 640, came out wrong in vLLM's compiled CPU graph, silently)."""
    w = random_weights(256, 160, 4, "mcg", seed=3)
    ops.serve(bound := TorchBackend().bind_linear(w, 0, 0, 160))
    x = torch.randn(5, 256)
    assert torch.ops.vllm_exl3.linear(x, w.trellis, 160).is_contiguous()  # opcheck would clone the trellis

    def f(x):
        y = torch.ops.vllm_exl3.linear(x, w.trellis, 160)
        return y.split([128, 32], -1)[1] * 2

    expected = 2 * R.forward(x, w, out_features=160)[:, 128:]
    assert rel(torch.compile(f, fullgraph=True)(x), expected) < 1e-5
    assert bound is ops.serving(w.trellis)


def test_the_op_runs_the_binding_served_last_and_forgets_an_unloaded_layer():
    """A fallback binds a layer again: the op then runs the new binding. A layer that is gone (its binding no longer
    referenced) leaves nothing behind, and the op says which trellis it could not place."""
    w = random_weights(128, 128, 3, "mcg", seed=2)
    x = torch.randn(3, 128)
    first = TorchBackend().bind_linear(w, 0, 0, 128)
    ops.serve(first)
    assert ops.serving(w.trellis) is first
    wrong = WrongNative().bind_linear(w, 0, 0, 128)
    ops.serve(wrong)
    assert ops.serving(w.trellis) is wrong
    assert rel(torch.ops.vllm_exl3.linear(x, w.trellis, 128), 1.1 * first(x)) < 1e-6
    del first, wrong
    gc.collect()
    assert ops.serving(w.trellis) is None
    with pytest.raises(RuntimeError, match=r"no BoundLinear is served for a trellis of shape \[8, 8, 48\]"):
        torch.ops.vllm_exl3.linear(x, w.trellis, 128)


# ---------------------------------------------------------------------------------------------------------------
# routed experts (torch backend)
# ---------------------------------------------------------------------------------------------------------------
HIDDEN, INTER, EXPERTS, TOP_K = 256, 384, 4, 2
SILU = MoECall("silu")


def expert_weights(seed=0):
    """Per expert: gate/up (H -> I) and down (I -> H); mixed bits and codebooks across experts."""
    cfgs = [(4, "mul1"), (3, "mcg"), (2.5, "mul1"), (2, "3inst")]
    return [[random_weights(HIDDEN, INTER, *cfgs[e], seed=seed + 10 * e + p) for p in range(2)]
            + [random_weights(INTER, HIDDEN, *cfgs[e], seed=seed + 10 * e + 2)] for e in range(EXPERTS)]


def stack(weights, experts, i0=0, i1=INTER):
    """The stack one rank would hold: its experts, intermediate block range around [i0, i1)."""
    return expert_stack(weights, list(experts), i0, i1)


def naive_moe(x, topk_weights, topk_ids, weights):
    """Token by token, expert by expert, from full fp64 weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    full = [[R.full_weight(w).double() for w in ws] for ws in weights]
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            g, u, d = full[int(topk_ids[t, k])]
            xt = x[t].double()
            h = torch.nn.functional.silu(xt @ g[:, :INTER]) * (xt @ u[:, :INTER])
            out[t] += topk_weights[t, k].double() * (h @ d[:INTER, :HIDDEN])
    return out


@pytest.fixture(scope="module")
def moe_case():
    g = torch.Generator().manual_seed(3)
    weights = expert_weights()
    x = torch.randn(9, HIDDEN, generator=g)
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(9)]).to(torch.int32)
    topk_weights = torch.rand(9, TOP_K, generator=g).softmax(-1)
    return weights, x, topk_weights, topk_ids, naive_moe(x, topk_weights, topk_ids, weights)


@pytest.mark.parametrize("run", [moe_routed_tokens, moe_all_tokens], ids=["routed-tokens", "all-tokens"])
def test_torch_moe_matches_naive(moe_case, run):
    weights, x, topk_weights, topk_ids, expected = moe_case
    experts = stack(weights, range(EXPERTS))
    y = run(x, topk_weights, topk_ids, None, experts, decoded_experts(experts), SILU)
    assert rel(y, expected) < 1e-5


def test_moe_expert_parallel_ranks_sum_to_the_whole(moe_case):
    weights, x, topk_weights, topk_ids, expected = moe_case
    total = 0
    for local in ([0, 1], [2, 3]):
        expert_map = torch.full((EXPERTS,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(len(local), dtype=torch.int32)
        experts = stack(weights, local)
        total = total + moe_routed_tokens(x, topk_weights, topk_ids, expert_map, experts,
                                          decoded_experts(experts), SILU)
    assert rel(total, expected) < 1e-5


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_moe_tensor_parallel_ranks_sum_to_the_whole(moe_case, tp):
    """Intermediate 384 per rank: 192 (mid-block), 128 (aligned), 96 (mid-block)."""
    weights, x, topk_weights, topk_ids, expected = moe_case
    total, part = 0, INTER // tp
    for r in range(tp):
        experts = stack(weights, range(EXPERTS), r * part, (r + 1) * part)
        total = total + moe_routed_tokens(x, topk_weights, topk_ids, None, experts,
                                          decoded_experts(experts), SILU)
    assert rel(total, expected) < 1e-5


def test_moe_op_through_torch_ops(moe_case):
    weights, x, topk_weights, topk_ids, expected = moe_case
    e = stack(weights, range(EXPERTS))
    bound = TorchBackend().bind_moe(e, MoECall("silu", top_k=TOP_K))
    ops.serve(bound)
    y = torch.ops.vllm_exl3.moe(x, topk_weights, topk_ids, None, e.w13_trellis)
    assert rel(y, expected) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# the vLLM version gate
# ---------------------------------------------------------------------------------------------------------------
def test_unsupported_vllm_fails_at_import_naming_the_range():
    pytest.importorskip("vllm")
    code = "import vllm; vllm.__version__ = '0.29.1'\nimport vllm_exl3\nvllm_exl3.register()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "vllm-exl3 supports vLLM >=0.31.0,<0.34.0" in proc.stderr and "this is vLLM 0.29.1" in proc.stderr

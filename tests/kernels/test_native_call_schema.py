"""The native bindings' argument lists, made once at load (kernels/backends/native.py, native_moe.py), fit the C++
ops' schemas as csrc declares them: read from the source and parsed by torch's own schema parser, no build, no GPU.
A binding whose list drifted from the schema would fail only at the first call on a GPU."""

from __future__ import annotations

import re
import types
from pathlib import Path

import torch

from vllm_exl3.dev.synthetic import expert_stack, random_weights
from vllm_exl3.kernels.backends import native, native_moe
from vllm_exl3.kernels.interface import MoECall

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def schema(file: str, op: str) -> torch._C.FunctionSchema:
    text = (CSRC / file).read_text()
    m = re.search(rf'm\.def\(\s*("{op}\(.*?)\);', text, re.S)
    assert m, f"{op} not declared in csrc/{file}"
    declared = "".join(re.findall(r'"([^"]*)"', m.group(1).split(", &")[0]))
    return torch._C.parse_schema(f"vllm_exl3::{declared}")


def fits(value, arg) -> bool:
    kind = str(arg.type)
    if kind == "Tensor":
        return isinstance(value, torch.Tensor)
    if kind in ("Tensor[]", "List[Tensor]"):
        return isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value)
    if kind in ("int[]", "List[int]"):
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "float":
        return isinstance(value, float)
    if kind in ("Tensor?", "Optional[Tensor]"):
        return value is None or isinstance(value, torch.Tensor)
    raise AssertionError(f"schema type {kind} not covered by this test")


def assert_fits(args: tuple, s: torch._C.FunctionSchema, per_call: int) -> None:
    """`args` follow the op's first `per_call` (per-call) arguments, one for each remaining schema argument."""
    bound_args = s.arguments[per_call:]
    required = [a for a in bound_args if not a.has_default_value()]
    assert len(required) <= len(args) <= len(bound_args), ([a.name for a in bound_args], len(args))
    for value, arg in zip(args, bound_args):
        assert fits(value, arg), (arg.name, str(arg.type), type(value).__name__)


def test_a_native_linear_binding_fits_native_linear(monkeypatch):
    monkeypatch.setattr(native, "extension_error", lambda: None)
    w = random_weights(256, 384, 3, "mul1", seed=1)
    bound = native.NativeBackend().bind_linear(w, 0, 128, 200)
    s = schema("bindings.cpp", "native_linear")
    assert [a.name for a in s.arguments[:1]] == ["x"]
    assert_fits(bound.args, s, per_call=1)
    assert bound.args[0] is w.trellis and bound.handle is w.trellis


def test_the_bench_trace_op_takes_native_linears_arguments():
    """bench/kernels.py --trace calls native_linear_traced with linear_args, as the serving path calls
    native_linear."""
    w = random_weights(256, 384, 3, "mul1", seed=1)
    s = schema("bindings.cpp", "native_linear_traced")
    assert [a.name for a in s.arguments[:1]] == ["x"] and len(s.returns) == 2
    assert_fits(native.linear_args(w, 0, 0, 384, native.NativePath.SKINNY_SPLIT), s, per_call=1)
    assert [str(a.type) for a in s.arguments] == [str(a.type) for a in schema("bindings.cpp", "native_linear").arguments]


def test_native_linear_group_arguments_fit_native_linear_group():
    ws = [random_weights(256, n, 3, "mul1", seed=i) for i, n in enumerate((128, 256, 384))]
    args = native.linear_group_args(ws, native.NativePath.AUTO)
    s = schema("bindings.cpp", "native_linear_group")
    assert [a.name for a in s.arguments[:1]] == ["x"]
    assert_fits(args, s, per_call=1)
    assert all(t is w.trellis for t, w in zip(args[0], ws)) and args[3] == 2


def test_a_native_moe_binding_fits_native_moe(monkeypatch):
    fake_ops = types.SimpleNamespace(  # the four load-time ops (their behaviour is the GPU suite's to check)
        moe_prepare=lambda words, codebook: None,
        moe_expert_keys=lambda words, codebooks: torch.zeros(len(words), dtype=torch.int32),
        moe_plan=lambda words, codebooks: [*words, *codebooks],  # what it was given, to see what reached it
        moe_reserve=lambda device, tokens, *rest: 0)
    monkeypatch.setattr(torch.ops, "vllm_exl3", fake_ops, raising=False)
    weights = [[random_weights(128, 256, 2 + e, cb, seed=3 * e + p) for p in range(3)]
               for e, cb in enumerate(("mcg", "mul1"))]
    stack = expert_stack(weights, [0, 1])
    bound = native_moe.BoundNativeMoE(stack, MoECall("silu", True, 2, 64))
    s = schema("moe_bindings.cpp", "native_moe")
    assert [a.name for a in s.arguments[:4]] == ["x", "topk_weights", "topk_ids", "expert_map"]
    assert_fits(bound.args, s, per_call=4)
    named = dict(zip([a.name for a in s.arguments[4:]], bound.args))
    assert named["w13_trellis"] is stack.w13_trellis and named["w2_svh"] is stack.w2_svh
    # each projection's plan from its own words and codebooks (format.CODEBOOKS order), expert by expert
    assert named["w13_plan"] == [*stack.w13_words, 1, 1, 2, 2] and named["w2_plan"] == [*stack.w2_words, 1, 2]
    assert (named["activation"], named["router_weight_on_input"]) == ("silu", True)
    assert (named["inter_offset"], named["inter_size"]) == (stack.inter_offset, stack.inter_size)
    assert named["w13_bias"] is None and named["w2_bias"] is None  # the stack has no biases
    assert (named["swiglu_limit"], named["swiglu_alpha"]) == (7.0, 1.702)


def test_a_biased_swigluoai_binding_passes_its_biases_and_clamp(monkeypatch):
    fake_ops = types.SimpleNamespace(moe_prepare=lambda words, codebook: None,
                                     moe_expert_keys=lambda words, codebooks: torch.zeros(len(words), dtype=torch.int32),
                                     moe_plan=lambda words, codebooks: [1, 2, 3],
                                     moe_reserve=lambda device, tokens, *rest: 0)
    monkeypatch.setattr(torch.ops, "vllm_exl3", fake_ops, raising=False)
    stack = expert_stack([[random_weights(128, 256, 4, "mul1", seed=p) for p in range(3)]], [0])
    stack.w13_bias, stack.w2_bias = torch.randn(1, 2, 256), torch.randn(1, 128)
    bound = native_moe.BoundNativeMoE(stack, MoECall("swigluoai", False, 1, 64, limit=5.0, alpha=1.5))
    s = schema("moe_bindings.cpp", "native_moe")
    assert_fits(bound.args, s, per_call=4)
    named = dict(zip([a.name for a in s.arguments[4:]], bound.args))
    assert named["w13_bias"] is stack.w13_bias and named["w2_bias"] is stack.w2_bias
    assert (named["activation"], named["swiglu_limit"], named["swiglu_alpha"]) == ("swigluoai", 5.0, 1.5)

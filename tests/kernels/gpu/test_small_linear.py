"""small_linear (csrc/small_linear.cu) on a GPU: y = x W^T for a 16-bit weight at 1..16 rows, the shape of a MoE
layer's router (Qwen3-30B-A3B: 2048 -> 128; GLM-4.5-Air: 4096 -> 128) and odd ones (one output column, columns not a
multiple of the block's four, in_features not a multiple of the lanes' 256-wide stride), fp16 and bf16, fp32 or
16-bit output, a strided x (a slice of a wider tensor). Against the fp32 product of the same values, fresh random
inputs, outputs poisoned before each call; two calls bitwise equal; CUDA-graph replay equal to eager; shapes the
kernel does not take are refused with a message naming the expectation.

The router gate op that serves a MoE gate with it (`vllm_exl3::router_gate`, kernels/backends/native.py): the kernel
up to its row limit, cuBLAS above it and for an x the kernel does not take, the choice made per call under
torch.compile, graph replay.
"""

from __future__ import annotations

import pytest
import torch

from vllm_exl3.dev.cuda_graph import capture
from support.gpu import native_or_skip
from support.moe_cases import poison, rel

pytestmark = pytest.mark.gpu

native = native_or_skip()

from vllm_exl3.kernels import ops  # noqa: E402, F401  (registers torch.ops.vllm_exl3.*)

DEV = "cuda"
SHAPES = [(2048, 128), (4096, 128), (264, 1), (200, 6), (8, 130)]  # (in, out)
ROWS = [1, 2, 3, 4, 7, 8, 9, 16]
DTYPES = [torch.float16, torch.bfloat16]
# fp32 output: the kernel's sums differ from the fp32 reference only by summation order (one fp32 rounding per add);
# 16-bit output adds the final rounding of that dtype.
BOUND = {(True, torch.float16): 1e-5, (True, torch.bfloat16): 1e-5, (False, torch.float16): 1e-3,
         (False, torch.bfloat16): 8e-3}


def call(x, w, out_fp32):
    poison((x.shape[0], w.shape[0]), torch.float32 if out_fp32 else x.dtype)
    return torch.ops.vllm_exl3.small_linear(x, w, out_fp32)


@pytest.mark.parametrize("out_fp32", [True, False], ids=["fp32-out", "16bit-out"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_against_the_fp32_product(shape, rows, dtype, out_fp32):
    k, n = shape
    g = torch.Generator(device=DEV).manual_seed(k * 31 + n * 7 + rows)
    x = torch.randn(rows, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).to(dtype)
    y = call(x, w, out_fp32)
    torch.cuda.synchronize()
    assert y.shape == (rows, n) and y.dtype == (torch.float32 if out_fp32 else dtype)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    ref = x.float() @ w.float().T
    assert rel(y, ref) < BOUND[(out_fp32, dtype)]
    assert torch.equal(call(x, w, out_fp32), y), "two calls differ"


def test_strided_rows_and_graph_replay():
    g = torch.Generator(device=DEV).manual_seed(5)
    wide = torch.randn(8, 2048 + 64, device=DEV, generator=g).to(torch.bfloat16)
    x = wide[:, :2048]  # row stride 2112: a view, not a copy
    w = (torch.randn(128, 2048, device=DEV, generator=g) * 2048 ** -0.5).to(torch.bfloat16)
    y = call(x, w, True)
    assert rel(y, x.float() @ w.float().T) < 1e-5
    static = x.clone()
    graph, out = capture(lambda: torch.ops.vllm_exl3.small_linear(static, w, True))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
    static.copy_(torch.randn_like(static))
    graph.replay()
    assert torch.equal(out, torch.ops.vllm_exl3.small_linear(static, w, True))


@pytest.mark.parametrize("case,message", [
    ("17-rows", "1..16 rows"),
    ("in-not-multiple-of-8", "16-byte aligned rows"),
    ("dtype-mismatch", "of x's dtype"),
    ("width-mismatch", "columns, the weight"),
])
def test_refuses_what_it_does_not_take(case, message):
    x = torch.randn(4, 2048, device=DEV, dtype=torch.float16)
    w = torch.randn(128, 2048, device=DEV, dtype=torch.float16)
    if case == "17-rows":
        x = torch.randn(17, 2048, device=DEV, dtype=torch.float16)
    elif case == "in-not-multiple-of-8":
        x, w = x[:, :2044].contiguous(), w[:, :2044].contiguous()
    elif case == "dtype-mismatch":
        w = w.to(torch.bfloat16)
    else:
        w = w[:, :1024].contiguous()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.vllm_exl3.small_linear(x, w, True)


# -- the router gate op: small_linear up to its row limit, cuBLAS above or where x's layout is not the kernel's ---
def _gate_case(rows: int, dtype=torch.bfloat16, k: int = 2048, n: int = 128, seed: int = 11):
    g = torch.Generator(device=DEV).manual_seed(seed + rows)
    x = torch.randn(rows, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("out_fp32", [True, False], ids=["fp32-out", "16bit-out"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 64])
def test_router_gate_op_takes_the_kernel_up_to_its_measured_crossover(rows, dtype, out_fp32):
    from vllm_exl3.kernels.backends.native import ROUTER_GATE_SMALL_LINEAR_ROWS as SMALL

    x, w = _gate_case(rows, dtype)
    poison((rows, w.shape[0]), torch.float32 if out_fp32 else dtype)
    y = torch.ops.vllm_exl3.router_gate(x, w, out_fp32)
    assert y.dtype == (torch.float32 if out_fp32 else dtype) and torch.isfinite(y).all()
    if rows <= SMALL:
        assert torch.equal(y, torch.ops.vllm_exl3.small_linear(x, w, out_fp32))
    else:  # vLLM's own gate GEMM
        cublas = (torch.mm(x, w.t(), out_dtype=torch.float32) if out_fp32 and dtype == torch.bfloat16
                  else torch.nn.functional.linear(x, w).to(y.dtype))
        assert torch.equal(y, cublas)
    kernel = rows <= SMALL  # cuBLAS may round to 16 bits before the fp32 output
    assert rel(y, x.float() @ w.float().T) < BOUND[(out_fp32 and kernel, dtype)]


def test_router_gate_op_with_an_unaligned_x_goes_to_cublas():
    g = torch.Generator(device=DEV).manual_seed(3)
    wide = torch.randn(4, 2048 + 8, device=DEV, generator=g).to(torch.bfloat16)
    x = wide[:, 4:2052]  # 8-byte offset: not the kernel's 16-byte rows
    w = (torch.randn(128, 2048, device=DEV, generator=g) * 2048 ** -0.5).to(torch.bfloat16)
    y = torch.ops.vllm_exl3.router_gate(x, w, True)
    assert torch.equal(y, torch.mm(x, w.t(), out_dtype=torch.float32))


def test_router_gate_op_keeps_its_choice_per_call_under_torch_compile():
    """vLLM compiles the model once for a symbolic batch size: the op's row test must run at each call, not once at
    the trace (a traced branch would be frozen)."""
    from vllm_exl3.kernels.backends.native import ROUTER_GATE_SMALL_LINEAR_ROWS as SMALL

    compiled = torch.compile(lambda x, w: torch.ops.vllm_exl3.router_gate(x, w, True), dynamic=True, fullgraph=True)
    for rows in (4, 1, 64, 2, 3):
        x, w = _gate_case(rows)
        expected = (torch.ops.vllm_exl3.small_linear(x, w, True) if rows <= SMALL
                    else torch.mm(x, w.t(), out_dtype=torch.float32))
        assert torch.equal(compiled(x, w), expected), rows


def test_router_gate_op_graph_replay():
    x, w = _gate_case(2)
    static = x.clone()
    graph, out = capture(lambda: torch.ops.vllm_exl3.router_gate(static, w, True))
    out.fill_(float("nan"))
    static.copy_(torch.randn_like(static))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.ops.vllm_exl3.small_linear(static, w, True))

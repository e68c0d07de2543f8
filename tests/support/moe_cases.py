"""Routed-expert cases shared by the GPU tests of every MoE backend: random EXL3 experts on the GPU, routing, the
fp32 reference forward of the same stack, and one checked call (`run_case`) of a backend against it.

Biases (`bias=True`): fp32 gate/up biases over the stack's block range (zero outside its slice) and a down bias,
added as gpt-oss adds them (before the activation; the down bias inside the router-weighted sum).

Bounds (relative L2 against the fp32 forward of the same Ŵ): a backend rounds the transformed inputs of both
projections to fp16, the gate/up outputs and the result to the activation dtype: about 4 roundings of ~3e-4
(fp16) or ~2.3e-3 (bf16, two of them in bf16), so fp16 must stay under 3e-3 and bf16 under 1e-2.
"""

from __future__ import annotations

import torch

from vllm_exl3.dev.synthetic import expert_stack, random_weights
from vllm_exl3.format import reference as R
from vllm_exl3.kernels.interface import MoECall

DEV = "cuda"
BOUND = {torch.float16: 3e-3, torch.bfloat16: 1e-2}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def poison(shape, dtype) -> None:
    held = [torch.full(shape, float("nan"), dtype=dtype, device=DEV) for _ in range(4)]
    del held


def make_weights(hidden, inter, experts, widths, seed):
    """weights[e] = [gate, up, down] on the GPU; widths[e] = (codebook, bits) of that expert (all three)."""
    def one(k, n, e, p):
        codebook, bits = widths[e % len(widths)]
        return random_weights(k, n, bits, codebook, seed=seed * 1000 + 3 * e + p, device=DEV)

    return [[one(hidden, inter, e, 0), one(hidden, inter, e, 1), one(inter, hidden, e, 2)] for e in range(experts)]


def gated(call: MoECall, gate, up):
    """act(gate) * up, or the clamped SwiGLU with the call's limit and alpha (kernels/specs.py ACTIVATIONS)."""
    if call.activation == "swigluoai":
        limit, alpha = call.clamp
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    if call.activation == "silu":
        return torch.nn.functional.silu(gate) * up
    return torch.nn.functional.gelu(gate, approximate="tanh" if call.activation == "gelu_tanh" else "none") * up


def add_biases(stack, seed, scale=1.0) -> None:
    """Random fp32 expert biases on `stack` (ExpertStack.w13_bias / w2_bias): zero outside its intermediate slice."""
    g = torch.Generator().manual_seed(seed)
    e, inter, hidden = stack.num_experts, stack.w13_svh.shape[-1], stack.w2_svh.shape[-1]
    b13 = torch.randn(e, 2, inter, generator=g) * scale
    keep = torch.zeros(inter)
    keep[stack.inter_offset:stack.inter_offset + stack.inter_size] = 1
    stack.w13_bias = (b13 * keep).to(DEV).contiguous()
    stack.w2_bias = (torch.randn(e, hidden, generator=g) * scale).to(DEV).contiguous()


def reference(x, topk_weights, topk_ids, expert_map, stack, call: MoECall):
    """fp32 forward of the same stack: per routed (token, k), w * (down(act(gate(x) + bg, up(x) + bu)) + bd)."""
    rwoi = call.router_weight_on_input
    hidden = x.shape[1]
    io, isz = stack.inter_offset, stack.inter_size
    out = torch.zeros(x.shape, dtype=torch.float32, device=DEV)
    ids = topk_ids.long()
    local = expert_map[ids].long() if expert_map is not None else ids
    w_hat = {}

    def lin(xs, e, p, in_off, out_off, n_out):
        w = stack.weights(e, p)
        if (e, p) not in w_hat:
            w_hat[e, p] = R.decode_rotated(w.trellis, w.codebook).float()
        k = w_hat[e, p].shape[0]
        xp = torch.zeros(xs.shape[0], k, device=DEV)
        xp[:, in_off:in_off + xs.shape[1]] = xs
        y = R.hadamard_rows(R.hadamard_rows(xp * w.suh.float()) @ w_hat[e, p]) * w.svh.float()
        return y[:, out_off:out_off + n_out]

    for e in range(stack.num_experts):
        tok, kk = (local == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        src = x[tok].float()
        wt = topk_weights[tok, kk].float()[:, None]
        if rwoi:
            src = src * wt
        gate, up = lin(src, e, "gate", 0, io, isz), lin(src, e, "up", 0, io, isz)
        if stack.w13_bias is not None:
            gate, up = gate + stack.w13_bias[e, 0, io:io + isz], up + stack.w13_bias[e, 1, io:io + isz]
        y = lin(gated(call, gate, up), e, "down", io, 0, hidden)
        if stack.w2_bias is not None:
            y = y + stack.w2_bias[e, :hidden]
        out.index_add_(0, tok, y if rwoi else y * wt)
    return out


def routing(tokens, experts, top_k, seed, skew=None):
    g = torch.Generator().manual_seed(seed)
    if skew == "one":  # every token to expert 0 (top-1) or experts 0..k-1
        ids = torch.arange(top_k).repeat(tokens, 1)
    elif skew == "few":  # a quarter of the experts get everything, the rest nothing
        pool = max(top_k, experts // 4)
        ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return weights.to(DEV), ids.to(torch.int32).to(DEV)


def run_case(backend, *, hidden=256, inter=384, experts=8, top_k=2, tokens=7, widths=(("mcg", 4.0),), dtype=torch.float16,
             activation="silu", rwoi=False, skew=None, ids_dtype=torch.int32, ep=None, tp=None, seed=0, note=None,
             bias=False, x_scale=1.0, limit=None, alpha=None):
    weights = make_weights(hidden, inter, experts if ep is None else ep[0], list(widths), seed)
    expert_map = None
    local = list(range(experts))
    if ep is not None:  # ep = (global experts, local global ids)
        expert_map = torch.full((ep[0],), -1, dtype=torch.int32, device=DEV)
        expert_map[list(ep[1])] = torch.arange(len(ep[1]), dtype=torch.int32, device=DEV)
        local = list(ep[1])
    i0, i1 = tp if tp is not None else (0, inter)
    stack = expert_stack(weights, local, i0, i1)
    g = torch.Generator().manual_seed(seed + 7)
    if bias:
        add_biases(stack, seed + 3)
    x = (torch.randn(tokens, hidden, generator=g) * x_scale).to(DEV, dtype)
    topk_weights, topk_ids = routing(tokens, experts if ep is None else ep[0], top_k, seed, skew)
    topk_ids = topk_ids.to(ids_dtype)
    call = MoECall(activation, rwoi, top_k, tokens, limit=limit, alpha=alpha)
    bound = backend.bind_moe(stack, call)
    poison((tokens, hidden), dtype)
    y = bound(x, topk_weights, topk_ids, expert_map)
    torch.cuda.synchronize()
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    ref = reference(x, topk_weights, topk_ids, expert_map, stack, call)
    err = rel(y, ref)
    if note is not None:
        note(err)
    assert err < BOUND[dtype], err
    return x, topk_weights, topk_ids, expert_map, stack, bound, y




def through_custom_op(bound, x, topk_weights, topk_ids):
    """The same call through `torch.ops.vllm_exl3.moe` (as the vLLM layer makes it, with the binding served), no
    expert map."""
    from vllm_exl3.kernels import ops

    ops.serve(bound)
    return torch.ops.vllm_exl3.moe(x, topk_weights, topk_ids, None, bound.experts.w13_trellis)

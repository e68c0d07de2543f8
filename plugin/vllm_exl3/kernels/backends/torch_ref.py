"""The `torch` backend: the reference math with Ŵ decoded by the reference decoder.

Always available (CPU and CUDA) and the oracle every other backend is checked against. Dense linears cache Ŵ at
load: 16 bits per weight on CUDA (fp16 Ŵ, matmul on tensor cores with fp32 accumulation) and 32 on CPU (fp32 Ŵ,
exact). Routed experts cache Ŵ on CPU only (the tests' tiny models); on CUDA a layer's experts would take ~5x
their packed bytes, so there they are decoded per call, one expert at a time (bounded memory, very slow: a
correctness fallback that says so once per process).
"""

from __future__ import annotations

import logging

import torch

from ...format.tensors import Exl3Weights
from ...format import reference
from ...format.reference import decode_rotated
from ..interface import (Backend, BoundLinear, BoundLinearGroup, BoundMoE, MoECall, SideBySideLinearGroup,
                         register_backend)
from ..specs import W13, W2, ExpertStack, LinearSpec, MoESpec

logger = logging.getLogger(__name__)

_ACTIVATION = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
}


def gated(call: MoECall):
    """The experts' gated activation of `call` as (gate, up) -> intermediate (specs.ACTIVATIONS): the clamped SwiGLU
    in fp32, the others in their inputs' dtype."""
    if call.activation == "swigluoai":
        limit, alpha = call.clamp

        def swigluoai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            gate, up = gate.float().clamp(max=limit), up.float().clamp(-limit, limit)
            return gate * torch.sigmoid(gate * alpha) * (up + 1)

        return swigluoai
    act = _ACTIVATION[call.activation]
    return lambda gate, up: act(gate) * up


def cached_w_hat(w: Exl3Weights) -> torch.Tensor:
    w_hat = decode_rotated(w.trellis, w.codebook)
    return w_hat if w_hat.is_cuda else w_hat.float()


def rotated_linear(x: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, w_hat: torch.Tensor, in_offset: int,
                   out_offset: int, out_features: int) -> torch.Tensor:
    """x·W through a cached Ŵ; x [M, in] sits at in_offset of the stored input width (see Backend.linear). The
    reference's forward, with the product in Ŵ's dtype (fp16 on CUDA: tensor cores, fp32 accumulation)."""
    y = reference.rotated_forward(x, suh, svh, w_hat, in_offset, out_offset, out_features, in_weight_dtype=True)
    return y.to(x.dtype)


class TorchBackend(Backend):
    name = "torch"

    def linear_unsupported_reason(self, spec: LinearSpec) -> str | None:
        return None

    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        return None

    def bind_linear(self, w: Exl3Weights, in_offset: int, out_offset: int, out_features: int) -> BoundLinear:
        return TorchLinear(w, in_offset, out_offset, out_features)

    def linear_group_unsupported_reason(self, spec: LinearSpec, shards: int) -> str | None:
        return None

    def bind_linear_group(self, shards: list[BoundLinear]) -> BoundLinearGroup:
        return TorchLinearGroup(shards)

    def bind_moe(self, experts: ExpertStack, call: MoECall) -> BoundMoE:
        return TorchMoE(experts, call)

    def router_gate_unsupported_reason(self, dtype: torch.dtype, in_features: int) -> str | None:
        return None

    def router_gate(self, x: torch.Tensor, weight: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        y = x.float() @ weight.float().t()  # the reference: fp32 products and sums
        return y if out_fp32 else y.to(x.dtype)


class TorchLinear(BoundLinear):
    backend = TorchBackend.name

    def __init__(self, w, in_offset, out_offset, out_features):
        super().__init__(w, in_offset, out_offset, out_features)
        self.w_hat = cached_w_hat(w)

    def __call__(self, x):
        return rotated_linear(x, self.w.suh, self.w.svh, self.w_hat, self.in_offset, self.out_offset,
                              self.out_features)


class TorchLinearGroup(SideBySideLinearGroup):
    """The grouped call's reference: the shards' own bindings (their decoded Ŵ, no second copy), side by side."""


class TorchMoE(BoundMoE):
    backend = TorchBackend.name

    def __init__(self, experts, call):
        super().__init__(experts, call)
        self.decoded = decoded_experts(experts)

    def __call__(self, x, topk_weights, topk_ids, expert_map):
        # CUDA graphs forbid data-dependent shapes, so on CUDA every expert sees every token (weighted 0 when
        # not routed there); elsewhere only the routed tokens are gathered.
        run = moe_all_tokens if x.is_cuda else moe_routed_tokens
        return run(x, topk_weights, topk_ids, expert_map, self.experts, self.decoded, self.call)


def decoded_experts(experts: ExpertStack) -> list[torch.Tensor]:
    """CPU: decoded Ŵ of every (expert, projection), [E, 2, H, I_blk] and [E, I_blk, H]. CUDA: nothing (decoded
    per call, see the module docstring)."""
    if experts.w13_trellis.is_cuda:
        return []
    e = experts.num_experts
    w13 = torch.stack([torch.stack([cached_w_hat(experts.weights(i, p)) for p in W13]) for i in range(e)])
    w2 = torch.stack([cached_w_hat(experts.weights(i, W2)) for i in range(e)])
    return [w13, w2]


_warned_slow = False


def _expert_fn(experts: ExpertStack, decoded: list[torch.Tensor], call: MoECall, hidden: int,
               warn_slow: bool = True):
    global _warned_slow
    glu = gated(call)
    io, isz = experts.inter_offset, experts.inter_size
    if decoded:
        w13_hat, w2_hat = decoded

        def w_hat(e: int, proj: str) -> torch.Tensor:
            return w2_hat[e] if proj == W2 else w13_hat[e, W13.index(proj)]
    else:
        if warn_slow and not _warned_slow:
            _warned_slow = True
            logger.warning("EXL3 routed experts on the torch backend on CUDA: every expert is decoded on every call "
                           "(a correctness fallback, orders of magnitude slower than the native kernels)")

        def w_hat(e: int, proj: str) -> torch.Tensor:
            return cached_w_hat(experts.weights(e, proj))

    g, u = W13.index("gate"), W13.index("up")

    b13, b2 = experts.w13_bias, experts.w2_bias

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        gate = rotated_linear(xe, experts.w13_suh[e, g], experts.w13_svh[e, g], w_hat(e, "gate"), 0, io, isz)
        up = rotated_linear(xe, experts.w13_suh[e, u], experts.w13_svh[e, u], w_hat(e, "up"), 0, io, isz)
        if b13 is not None:  # fp32 [E, 2, I_blk]; the gate/up outputs are the slice [io, io + isz) of it
            gate, up = gate.float() + b13[e, g, io:io + isz], up.float() + b13[e, u, io:io + isz]
        y = rotated_linear(glu(gate, up).to(xe.dtype), experts.w2_suh[e], experts.w2_svh[e], w_hat(e, W2), io, 0,
                           hidden)
        return y if b2 is None else y.float() + b2[e, :hidden]

    return expert


def _routing(x, topk_weights, topk_ids, expert_map, router_weight_on_input):
    ids = topk_ids.reshape(-1).long()
    local = expert_map[ids].long() if expert_map is not None else ids
    src = x.float() * topk_weights.float() if router_weight_on_input else x.float()
    return local, topk_weights.reshape(-1).float(), src


def moe_routed_tokens(x, topk_weights, topk_ids, expert_map, experts, decoded, call: MoECall, warn_slow: bool = True):
    """Only the experts that receive tokens run (and, without `decoded` (decoded_experts), only those are
    decoded)."""
    m, hidden = x.shape
    local, weight, src = _routing(x, topk_weights, topk_ids, expert_map, call.router_weight_on_input)
    token = torch.arange(m, device=x.device).repeat_interleave(topk_ids.shape[1])
    expert = _expert_fn(experts, decoded, call, hidden, warn_slow)
    out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    for e in range(experts.num_experts):
        sel = (local == e).nonzero().squeeze(1)
        if sel.numel():
            y = expert(e, src[token[sel]]).float()
            out.index_add_(0, token[sel], y if call.router_weight_on_input else y * weight[sel, None])
    return out.to(x.dtype)


def moe_all_tokens(x, topk_weights, topk_ids, expert_map, experts, decoded, call: MoECall):
    m, hidden = x.shape
    local, weight, src = _routing(x, topk_weights, topk_ids, expert_map, call.router_weight_on_input)
    expert = _expert_fn(experts, decoded, call, hidden)
    out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    for e in range(experts.num_experts):
        routed = (local == e).view(m, -1)
        scale = (routed.any(1, keepdim=True).float() if call.router_weight_on_input
                 else (routed * weight.view(m, -1)).sum(1, keepdim=True))
        out += expert(e, src).float() * scale
    return out.to(x.dtype)


register_backend(TorchBackend())

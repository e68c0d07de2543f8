"""Routed experts on the native kernels (csrc/moe.h): the op `torch.ops.vllm_exl3.native_moe` and a layer bound to
it (`BoundNativeMoE`).

The packed trellis is read as stored (no 16-bit copy of any expert). Per layer the binding keeps two tiny int32
tensors (the kernel key of each expert's gate/up and down weight, for layers that mix bit widths or codebooks) and
two plans (`moe_plan`: each projection's distinct keys, the launches a call makes, so that no call walks the
experts' widths); per device one workspace serves every MoE layer, sized for at most MOE_CHUNK_TOKENS tokens
(native_moe_limits.py; longer calls run in chunks inside the op), and reserved at load so that CUDA-graph capture
allocates nothing. Routing, row-chunk sizes and kernel choice happen inside the op from shapes and device-side
counts: no host sync, so every token count captures.
"""

from __future__ import annotations

import logging

import torch

from ...format.constants import CODEBOOKS
from ..interface import BoundMoE, MoECall
from ..specs import W13, W2, ExpertStack, MoESpec
from .native_limits import limits_reason
from .native_moe_limits import MAX_LOCAL_EXPERTS, MOE_CHUNK_TOKENS

logger = logging.getLogger(__name__)


def register_fakes() -> None:
    def moe_fake(x, topk_weights, topk_ids, expert_map, w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh,
                 w13_keys, w2_keys, w13_plan, w2_plan, activation, router_weight_on_input, inter_offset, inter_size,
                 w13_bias, w2_bias, swiglu_limit, swiglu_alpha):
        return x.new_empty((x.shape[0], x.shape[1]))

    try:
        torch.library.register_fake("vllm_exl3::native_moe")(moe_fake)
    except RuntimeError as e:  # already registered (module reloaded)
        if "already" not in str(e):
            raise


# The activations csrc/moe.h implements (MoeActivation), expert biases included.
NATIVE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")


def unsupported_reason(spec: MoESpec) -> str | None:
    if spec.activation not in NATIVE_ACTIVATIONS:
        return f"activation {spec.activation!r}: the native expert kernels implement {', '.join(NATIVE_ACTIVATIONS)}"
    if not 1 <= spec.num_local_experts <= MAX_LOCAL_EXPERTS:
        return f"{spec.num_local_experts} local experts (the routing kernel takes 1..{MAX_LOCAL_EXPERTS})"
    return limits_reason(spec.device_type, spec.act_dtype, zip(spec.codebooks, spec.bits),
                         [spec.hidden_padded, spec.intermediate_padded])


def codebook_indices(codebooks: tuple[str, ...]) -> list[int]:
    """The C++ op's codebook numbers (csrc/exl3_kernels.h `enum Codebook` = format.CODEBOOKS order): the one place
    names become indices on the MoE path."""
    return [CODEBOOKS.index(c) for c in codebooks]


def expert_keys(experts: ExpertStack) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The kernel key of each local expert's gate/up and down weights (csrc/moe.h moe_weight_key), on the stack's
    device, and the gate/up and down plans (moe_plan: the distinct keys, checked), with the kernels' shared-memory
    limits raised for every key present."""
    device = experts.w13_trellis.device
    local = range(experts.num_experts)
    gate_up_cb = codebook_indices(tuple(experts.codebook(e, p) for e in local for p in W13))  # as w13_words
    down_cb = codebook_indices(tuple(experts.codebook(e, W2) for e in local))
    for words, codebook in set(zip(experts.w13_words, gate_up_cb)) | set(zip(experts.w2_words, down_cb)):
        torch.ops.vllm_exl3.moe_prepare(words, codebook)
    w13_words, w2_words = list(experts.w13_words), list(experts.w2_words)
    keys = [torch.ops.vllm_exl3.moe_expert_keys(w13_words, gate_up_cb).to(device),
            torch.ops.vllm_exl3.moe_expert_keys(w2_words, down_cb).to(device)]
    plans = [torch.ops.vllm_exl3.moe_plan(w13_words, gate_up_cb), torch.ops.vllm_exl3.moe_plan(w2_words, down_cb)]
    return keys, plans


def reserve(experts: ExpertStack, top_k: int, max_tokens: int | None) -> int:
    """The shared workspace reserved for this layer's shape (bytes held on its device): at most one chunk of tokens,
    before CUDA-graph capture so that capture allocates nothing."""
    device = experts.w13_trellis.device
    held = torch.ops.vllm_exl3.moe_reserve(device, max_tokens or MOE_CHUNK_TOKENS, top_k, experts.num_experts,
                                           experts.w13_trellis.shape[2] * 16, experts.w13_trellis.shape[3] * 16)
    logger.debug("EXL3 native MoE workspace on %s: %.1f MiB (shared by every MoE layer)", device, held / 2**20)
    return held


class BoundNativeMoE(BoundMoE):
    """A layer on the native op: its key tables, its plans and the op's whole argument list, made once."""

    def __init__(self, experts: ExpertStack, call: MoECall):
        super().__init__(experts, call)
        (keys13, keys2), (plan13, plan2) = expert_keys(experts)
        self.keys = keys13, keys2  # the binding's only tensors of its own
        if call.top_k:
            reserve(experts, call.top_k, call.max_tokens)
        self.no_map = torch.empty(0, dtype=torch.int32, device=experts.w13_trellis.device)
        self.args = (experts.w13_trellis, experts.w13_suh, experts.w13_svh, experts.w2_trellis, experts.w2_suh,
                     experts.w2_svh, keys13, keys2, plan13, plan2, call.activation, call.router_weight_on_input,
                     experts.inter_offset, experts.inter_size, experts.w13_bias, experts.w2_bias, *call.clamp)

    def __call__(self, x, topk_weights, topk_ids, expert_map):
        if expert_map is None:
            expert_map = self.no_map
        elif expert_map.dtype != torch.int32:
            expert_map = expert_map.to(torch.int32)
        return torch.ops.vllm_exl3.native_moe(x, topk_weights, topk_ids, expert_map, *self.args)

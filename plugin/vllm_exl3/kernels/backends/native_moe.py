"""Routed experts on the native kernels (csrc/moe.h): the op `torch.ops.vllm_exl3.native_moe` and what the native
backend keeps per layer.

The packed trellis is read as stored (no 16-bit copy of any expert). Per layer the backend keeps two tiny int32
tensors (the kernel key of each expert's gate/up and down weight, for layers that mix bit widths or codebooks); per
device one workspace serves every MoE layer, sized for at most MOE_CHUNK_TOKENS tokens (native_moe_limits.py; longer
calls run in chunks inside the op), and reserved at load so that CUDA-graph capture allocates nothing. Routing,
row-chunk sizes and kernel choice happen inside the op from shapes and device-side counts: no host sync, so every
token count captures.
"""

from __future__ import annotations

import functools
import logging

import torch

from ...format.constants import CODEBOOKS
from ..specs import ACTIVATIONS, W13, W2, ExpertStack, MoESpec
from .native_limits import limits_reason
from .native_moe_limits import MAX_LOCAL_EXPERTS, MOE_CHUNK_TOKENS

logger = logging.getLogger(__name__)


def register_fakes() -> None:
    def moe_fake(x, topk_weights, topk_ids, expert_map, w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh,
                 w13_keys, w2_keys, w13_words, w2_words, codebooks, activation, router_weight_on_input, inter_offset,
                 inter_size):
        return x.new_empty((x.shape[0], x.shape[1]))

    try:
        torch.library.register_fake("vllm_exl3::native_moe")(moe_fake)
    except RuntimeError as e:  # already registered (module reloaded)
        if "already" not in str(e):
            raise


def unsupported_reason(spec: MoESpec) -> str | None:
    if spec.activation not in ACTIVATIONS:
        return f"activation {spec.activation!r} not one of {ACTIVATIONS}"
    if not 1 <= spec.num_local_experts <= MAX_LOCAL_EXPERTS:
        return f"{spec.num_local_experts} local experts (the routing kernel takes 1..{MAX_LOCAL_EXPERTS})"
    return limits_reason(spec.device_type, spec.act_dtype, zip(spec.codebooks, spec.bits),
                         [spec.hidden_padded, spec.intermediate_padded])


@functools.lru_cache(maxsize=None)
def codebook_indices(codebooks: tuple[str, ...]) -> list[int]:
    """The C++ op's codebook numbers (csrc/exl3_kernels.h `enum Codebook` = format.CODEBOOKS order): the one place
    names become indices on the MoE path. Cached: an eager call must not redo this per layer and step."""
    return [CODEBOOKS.index(c) for c in codebooks]


@functools.lru_cache(maxsize=None)
def _empty_map(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int32, device=device)


def prepare(experts: ExpertStack, top_k: int | None, max_tokens: int | None) -> list[torch.Tensor]:
    """Per layer: the key tensors, the kernels' shared-memory limits raised, the shared workspace reserved."""
    device = experts.w13_trellis.device
    local = range(experts.num_experts)
    gate_up_cb = codebook_indices(tuple(experts.codebook(e, p) for e in local for p in W13))  # as w13_words
    down_cb = codebook_indices(tuple(experts.codebook(e, W2) for e in local))
    for words, codebook in set(zip(experts.w13_words, gate_up_cb)) | set(zip(experts.w2_words, down_cb)):
        torch.ops.vllm_exl3.moe_prepare(words, codebook)
    keys13 = torch.ops.vllm_exl3.moe_expert_keys(list(experts.w13_words), gate_up_cb).to(device)
    keys2 = torch.ops.vllm_exl3.moe_expert_keys(list(experts.w2_words), down_cb).to(device)
    if top_k:
        held = torch.ops.vllm_exl3.moe_reserve(device, max_tokens or MOE_CHUNK_TOKENS, top_k, experts.num_experts,
                                               experts.w13_trellis.shape[2] * 16, experts.w13_trellis.shape[3] * 16)
        logger.debug("EXL3 native MoE workspace on %s: %.1f MiB (shared by every MoE layer)", device, held / 2**20)
    return [keys13, keys2]


def moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
        experts: ExpertStack, prepared: list[torch.Tensor], activation: str,
        router_weight_on_input: bool) -> torch.Tensor:
    keys13, keys2 = prepared
    if expert_map is None:
        expert_map = _empty_map(x.device)
    elif expert_map.dtype != torch.int32:
        expert_map = expert_map.to(torch.int32)
    return torch.ops.vllm_exl3.native_moe(
        x, topk_weights, topk_ids, expert_map, experts.w13_trellis, experts.w13_suh, experts.w13_svh,
        experts.w2_trellis, experts.w2_suh, experts.w2_svh, keys13, keys2, list(experts.w13_words),
        # codebooks cross as the stack holds them, PROJECTIONS order per expert (csrc/moe_bindings.cpp splits them)
        list(experts.w2_words), codebook_indices(experts.codebooks), activation,
        router_weight_on_input, experts.inter_offset, experts.inter_size)


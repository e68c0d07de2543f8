"""The EXL3 custom ops vLLM's graphs see. Each has a fake (shape-only) implementation, so torch.compile traces
through it and CUDA graphs capture whatever kernel the chosen backend launches inside.

Names, not indices, cross this boundary: the backend (one of kernels.PREFERENCE), the codebook(s) (format.CODEBOOKS)
and the activation (kernels.ACTIVATIONS) are strings, checked here when the op runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..format.constants import CODEBOOKS
from ..format.records import bits_from_trellis_dim
from ..format.tensors import Exl3Weights
from .backend import get_backend
from .requested import PREFERENCE
from .specs import ACTIVATIONS, ExpertStack


def _checked(what: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"vllm_exl3 op: unknown {what} {value!r} (expected one of {', '.join(allowed)})")
    return value


def codebook_list(codebooks: Sequence[str]) -> str:
    """The `codebooks` argument of vllm_exl3::moe: the names, comma-separated."""
    return ",".join(codebooks)


@torch.library.custom_op("vllm_exl3::linear", mutates_args=())
def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                prepared: torch.Tensor, codebook: str, backend: str, in_offset: int, out_offset: int,
                out_features: int) -> torch.Tensor:
    """y [M, out_features] = x [M, in] · W; see Backend.linear for the offsets. `codebook` is a format.CODEBOOKS
    name, `backend` a kernels.PREFERENCE name."""
    w = Exl3Weights(trellis, suh, svh, _checked("codebook", codebook, CODEBOOKS),
                    bits_from_trellis_dim(trellis.shape[-1]))
    backend = get_backend(_checked("backend", backend, PREFERENCE))
    return backend.linear(x, w, prepared, in_offset, out_offset, out_features)


@exl3_linear.register_fake
def _(x, trellis, suh, svh, prepared, codebook, backend, in_offset, out_offset, out_features):
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("vllm_exl3::moe", mutates_args=())
def exl3_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor,
             w13_trellis: torch.Tensor, w13_suh: torch.Tensor, w13_svh: torch.Tensor, w2_trellis: torch.Tensor,
             w2_suh: torch.Tensor, w2_svh: torch.Tensor, prepared: list[torch.Tensor], w13_words: list[int],
             w2_words: list[int], codebooks: str, activation: str, router_weight_on_input: bool,
             backend: str, inter_offset: int, inter_size: int) -> torch.Tensor:
    """Routed experts: [M, H] local partial sum; see Backend.moe. An empty `expert_map` means no expert
    parallelism; `codebooks` names the codebook of each (expert, gate/up/down), comma-separated (op schemas take no
    list of strings; see codebook_list), `activation` is a kernels.ACTIVATIONS name, `backend` a kernels.PREFERENCE
    name."""
    experts = ExpertStack(w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh, tuple(w13_words),
                          tuple(w2_words), tuple(_checked("codebook", c, CODEBOOKS) for c in codebooks.split(",")), inter_offset,
                          inter_size)
    return get_backend(_checked("backend", backend, PREFERENCE)).moe(
        x, topk_weights, topk_ids, expert_map if expert_map.numel() else None, experts, prepared,
        _checked("activation", activation, ACTIVATIONS), router_weight_on_input)


@exl3_moe.register_fake
def _(x, topk_weights, topk_ids, expert_map, w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh, prepared,
      w13_words, w2_words, codebooks, activation, router_weight_on_input, backend, inter_offset, inter_size):
    return torch.empty_like(x)

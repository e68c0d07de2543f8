"""The EXL3 custom ops vLLM's graphs see. Each has a fake (shape-only) implementation, so torch.compile traces
through it and CUDA graphs capture whatever kernel the chosen backend launches inside."""

from __future__ import annotations

import torch

from ..format import CODEBOOKS, Exl3Weights, bits_from_trellis_dim
from . import PREFERENCE, get_backend


@torch.library.custom_op("vllm_exl3::linear", mutates_args=())
def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                prepared: torch.Tensor, codebook: int, backend: int, in_offset: int, out_offset: int,
                out_features: int) -> torch.Tensor:
    """y [M, out_features] = x [M, in] · W; see Backend.linear for the offsets. `codebook` indexes
    format.CODEBOOKS, `backend` indexes kernels.PREFERENCE (ints keep the op schema simple)."""
    w = Exl3Weights(trellis, suh, svh, CODEBOOKS[codebook], bits_from_trellis_dim(trellis.shape[-1]))
    return get_backend(PREFERENCE[backend]).linear(x, w, prepared, in_offset, out_offset, out_features)


@exl3_linear.register_fake
def _(x, trellis, suh, svh, prepared, codebook, backend, in_offset, out_offset, out_features):
    return x.new_empty((x.shape[0], out_features))

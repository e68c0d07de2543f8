"""The `torch` backend: the reference math with Ŵ decoded once at load and cached.

Always available (CPU and CUDA) and the oracle every other backend is checked against. The cache costs 16 bits
per weight on CUDA (fp16 Ŵ, matmul on tensor cores with fp32 accumulation) and 32 on CPU (fp32 Ŵ, exact).
"""

from __future__ import annotations

import torch

from ..format import Exl3Weights
from ..reference import decode_rotated, hadamard_rows
from . import Backend, LinearSpec, MoESpec, register_backend


def cached_w_hat(w: Exl3Weights) -> torch.Tensor:
    w_hat = decode_rotated(w.trellis, w.codebook)
    return w_hat if w_hat.is_cuda else w_hat.float()


def rotated_linear(x: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, w_hat: torch.Tensor, in_offset: int,
                   out_offset: int, out_features: int) -> torch.Tensor:
    """x·W through a cached Ŵ; x [M, in] sits at in_offset of the stored input width (see Backend.linear)."""
    k = w_hat.shape[0]
    xs = x.new_zeros((x.shape[0], k), dtype=torch.float32)
    xs[:, in_offset:in_offset + x.shape[1]] = x
    xh = hadamard_rows(xs * suh.float())
    z = (xh.to(w_hat.dtype) @ w_hat).float()
    y = hadamard_rows(z) * svh.float()
    return y[:, out_offset:out_offset + out_features].to(x.dtype)


class TorchBackend(Backend):
    name = "torch"

    def linear_unsupported_reason(self, spec: LinearSpec) -> str | None:
        return None

    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        return None

    def prepare_linear(self, w: Exl3Weights) -> torch.Tensor:
        return cached_w_hat(w)

    def linear(self, x, w, prepared, in_offset, out_offset, out_features):
        return rotated_linear(x, w.suh, w.svh, prepared, in_offset, out_offset, out_features)


register_backend(TorchBackend())

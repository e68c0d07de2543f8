"""What the native kernels accept, for dense linears and routed experts alike (csrc/: every codebook, 1..8 bits,
1.5/2.5/3.5 with mul1, fp16/bf16 activations, dims padded to 128, a CUDA device)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...format.constants import CODEBOOK_MUL1, CODEBOOKS, HADAMARD_BLOCK

ACT_DTYPES = (torch.float16, torch.bfloat16)


def limits_reason(device_type: str, act_dtype: torch.dtype, widths: Iterable[tuple[str, float]],
                  dims: Iterable[int]) -> str | None:
    """None when the kernels take a layer on `device_type` with these activations, (codebook, bits) weights and
    stored dims; else why not."""
    if device_type != "cuda":
        return f"needs a CUDA device (layer on {device_type})"
    if act_dtype not in ACT_DTYPES:
        return f"activations must be fp16 or bf16, not {act_dtype}"
    for codebook, bits in widths:
        if codebook not in CODEBOOKS:
            return f"unknown codebook {codebook!r}"
        if bits != int(bits) and (codebook != CODEBOOK_MUL1 or bits > 3.5):
            return f"{bits:g} bits needs the mul1 codebook"
        if not 1 <= bits <= 8:
            return f"{bits:g} bits outside 1..8"
    if any(d % HADAMARD_BLOCK for d in dims):
        return "stored dims must be multiples of 128"
    return None

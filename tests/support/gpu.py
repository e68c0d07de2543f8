"""The GPU tests' entry condition: a CUDA device and the native extension (else the module is skipped, or, with
VLLM_EXL3_REQUIRE_NATIVE=1 on the GPU machine, fails), and the cuda copy of a pack's weights."""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda"


def native_or_skip():
    """The native backend module, with every backend registered; skips the calling test module without it."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    from vllm_exl3.kernels.backend import get_backend

    get_backend("torch")  # loads every backend module
    from vllm_exl3.kernels.backends import native

    if reason := native.unavailable_reason():
        if os.environ.get("VLLM_EXL3_REQUIRE_NATIVE") == "1":
            raise RuntimeError(f"native backend unavailable: {reason}")
        pytest.skip(f"native backend unavailable: {reason}", allow_module_level=True)
    return native


def on_cuda(w):
    """An Exl3Weights with its tensors on the GPU."""
    return type(w)(w.trellis.to(DEV), w.suh.to(DEV), w.svh.to(DEV), w.codebook, w.bits,
                   None if w.bias is None else w.bias.to(DEV))

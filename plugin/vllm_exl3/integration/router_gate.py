"""A MoE layer's router gate on the plugin's backends (`VLLM_EXL3_ROUTER_GATE=1`).

The gate is a 16-bit linear [experts, hidden], not EXL3: by default vLLM's own GateLinear runs it (on Hopper a
cuBLAS GEMM). With the setting on, our quantization config answers for it with `RouterGateMethod`: vLLM's
GateLinear then turns its own GEMM tiers off (it keeps them only for `UnquantizedLinearMethod`) and calls this
method's `apply`, whose logits come out in the gate's `out_dtype` when that is fp32. The weight is created and
loaded exactly as vLLM's unquantized method does it, and left as loaded (no CPU repacking: the kernel reads it).

After loading, the gate binds like an EXL3 layer: the backend is chosen per (dtype, device) layer type
(kernels/selection.py), recorded in the compile-cache key, and checked by the parity gate against the torch
reference's fp32 product, which may move it to the next backend.
"""

from __future__ import annotations

import torch

from . import binding, compat, compile_key, telemetry
from ..kernels import parity
from ..kernels.interface import Backend
from ..kernels.selection import choose_router_gate_backend, router_gate_layer_type


def out_fp32(layer) -> bool:
    """Whether the gate hands the router fp32 logits (GateLinear's `out_dtype`, final once the model is built)."""
    return getattr(layer, "out_dtype", None) == torch.float32


class RouterGateMethod(compat.LinearMethodBase):
    def __init__(self, prefix: str, last_block: bool):
        self.prefix, self.last_block = prefix, last_block
        self.plain = compat.UnquantizedLinearMethod()
        self.backend: Backend | None = None

    def create_weights(self, layer, *args, **kwargs) -> None:
        self.plain.create_weights(layer, *args, **kwargs)  # `weight` and its loader, as vLLM makes them

    def process_weights_after_loading(self, layer) -> None:
        self._bind(layer)
        compile_key.record()
        telemetry.layer_bound()

    def _bind(self, layer) -> None:
        weight = layer.weight.data
        backend = choose_router_gate_backend(weight.dtype, weight.shape[1], weight.device.type)
        self.backend = backend
        fp32 = out_fp32(layer)
        binding.bind_checked(self.prefix, router_gate_layer_type(weight.dtype, weight.device.type), backend,
                             weight.dtype, lambda: parity.router_gate_error(backend, weight, fp32),
                             lambda: self._bind(layer), self.last_block)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = self.backend.router_gate(x2, layer.weight, out_fp32(layer))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

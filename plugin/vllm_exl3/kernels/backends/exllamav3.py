"""The `exllamav3` backend: ExLlamaV3's own kernels (the `exllamav3` package, MIT), as a baseline and fallback.

Dense linears: one `exllamav3.modules.quant.exl3.LinearEXL3` per layer, which picks its own GEMV/GEMM/reconstruct
path by row count. Its kernels take fp16 activations only (bf16 is cast in and out here), the padded input width
and produce the padded output, so the tensor-parallel offsets are handled by zero-extension and narrowing.
Routed experts: one ExLlamaV3 `BlockSparseMLP` per layer over the stored tensors (exllamav3_moe.py).
Imports fine without the package; `unavailable_reason()` says why it cannot run.

`auto` prefers the native backend wherever that is available.
"""

from __future__ import annotations

import functools
import threading

import torch

from ...format.reference import zero_extend
from ...format.tensors import Exl3Weights
from ..backend import Backend, register_backend
from ..specs import ExpertStack, LinearSpec, MoESpec
from . import exllamav3_moe

SUPPORTED_VERSIONS = ("1.6.",)  # the format and kernel behaviour this wrapper was checked against


@functools.lru_cache(maxsize=None)
def _import_error() -> str | None:
    try:
        import exllamav3  # noqa: F401
        from exllamav3.version import __version__ as version
    except ImportError as e:
        return f"exllamav3 not installed ({e})"
    if not version.startswith(SUPPORTED_VERSIONS):
        return f"exllamav3 {version} not supported (need {' or '.join(v + 'x' for v in SUPPORTED_VERSIONS)})"
    return None


def make_layer(w: Exl3Weights):
    """ExLlamaV3's LinearEXL3 over the stored (padded) tensors; building it loads/compiles exllamav3_ext."""
    return exllamav3_moe.linear_exl3(w.trellis, w.suh, w.svh, w.codebook)


class ExLlamaV3Backend(Backend):
    name = "exllamav3"

    def __init__(self) -> None:
        self._layers: dict[tuple[int, int, int], object] = {}
        self._moe_layers: dict[tuple[int, int, int, int], object] = {}
        self._lock = threading.Lock()

    def unavailable_reason(self) -> str | None:
        if (err := _import_error()) is not None:
            return err
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None

    def build_id(self) -> str:
        if _import_error() is not None:
            return ""
        from exllamav3.version import __version__ as version

        return f"exllamav3 {version}"

    def linear_unsupported_reason(self, spec: LinearSpec) -> str | None:
        if spec.device_type != "cuda":
            return f"needs a CUDA device (layer on {spec.device_type})"
        if spec.act_dtype not in (torch.float16, torch.bfloat16):
            return f"activations must be fp16 or bf16, not {spec.act_dtype}"
        return None

    def _layer(self, w: Exl3Weights):
        key = (w.trellis.data_ptr(), w.suh.data_ptr(), w.svh.data_ptr())
        with self._lock:
            layer = self._layers.get(key)
            if layer is None:
                layer = self._layers[key] = make_layer(w)
        return layer

    def prepare_linear(self, w: Exl3Weights) -> torch.Tensor:
        self._layer(w)  # build (and JIT-load the extension) at load time, not in the first forward
        return torch.empty(0, device=w.trellis.device)

    def linear(self, x, w, prepared, in_offset, out_offset, out_features):
        layer = self._layer(w)
        x16 = x.to(torch.float16)
        if in_offset != 0 or x.shape[1] != w.in_padded:
            x16 = zero_extend(x16, w.in_padded, in_offset)
        y = layer.forward(x16.contiguous(), {})
        return y[:, out_offset:out_offset + out_features].to(x.dtype)

    # -- routed experts -----------------------------------------------------------------------------------
    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        if spec.device_type != "cuda":
            return f"needs a CUDA device (layer on {spec.device_type})"
        if spec.act_dtype not in (torch.float16, torch.bfloat16):
            return f"activations must be fp16 or bf16, not {spec.act_dtype}"
        return exllamav3_moe.unsupported_reason(spec) or exllamav3_moe.api_reason()

    @staticmethod
    def _moe_key(experts: ExpertStack) -> tuple[int, int, int, int]:
        return (experts.w13_trellis.data_ptr(), experts.w2_trellis.data_ptr(), experts.inter_offset,
                experts.inter_size)

    def prepare_moe(self, experts, top_k=None, max_tokens=None, activation=None):
        if top_k is None or activation is None:
            raise ValueError("the exllamav3 backend builds ExLlamaV3's expert module at load and needs the layer's "
                             f"top-k and activation (got top_k={top_k}, activation={activation})")
        if (reason := exllamav3_moe.api_reason()) is not None:
            raise RuntimeError(reason)
        module = exllamav3_moe.build(experts, top_k, activation)
        with self._lock:
            self._moe_layers[self._moe_key(experts)] = module
        return []

    def moe(self, x, topk_weights, topk_ids, expert_map, experts, prepared, activation, router_weight_on_input):
        module = self._moe_layers.get(self._moe_key(experts))
        if module is None:
            raise RuntimeError("exllamav3 backend: moe() on an expert stack that prepare_moe() never saw")
        if module.activation_fn != exllamav3_moe.ACTIVATION.get(activation):
            raise ValueError(f"exllamav3 backend: the layer was prepared for {module.activation_fn}, "
                             f"called with {activation!r}")
        return exllamav3_moe.forward(module, x, topk_weights, topk_ids, expert_map, router_weight_on_input)


register_backend(ExLlamaV3Backend())

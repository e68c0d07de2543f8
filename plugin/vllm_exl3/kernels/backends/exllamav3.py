"""The `exllamav3` backend: ExLlamaV3's own kernels (the `exllamav3` package, MIT), as a baseline and fallback.

Dense linears: one `exllamav3.modules.quant.exl3.LinearEXL3` per layer, which picks its own GEMV/GEMM/reconstruct
path by row count. Its kernels take fp16 activations only (bf16 is cast in and out here), the padded input width
and produce the padded output, so the tensor-parallel offsets are handled by zero-extension and narrowing.
Up to its reconstruct threshold the layer is asked for an fp32 output: its GEMM autotunes the number of blocks per
call shape, and a choice that splits K across blocks hands the partial sums on through the output tensor, rounded
to fp16 between blocks when the output is fp16 (exllamav3_ext/quant/exl3_gemm_inner.cuh, `write_sum_gl`); an fp32
output keeps them fp32 whatever the choice. The reconstruct path above the threshold is one cuBLAS GEMM. With
fp16 outputs Qwen3.5's 3.5-bit fixture read top-1 0.924 compiled on this profile; with fp32 ones 1.0, both served
side by side (bench/notes/serving-run-17.md "fp32 partials on exllamav3").
Routed experts: one ExLlamaV3 `BlockSparseMLP` per layer over the stored tensors (exllamav3_moe.py).
Imports fine without the package; `unavailable_reason()` says why it cannot run.

`auto` prefers the native backend wherever that is available.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import re
from pathlib import Path

import torch

from ...format.reference import zero_extend
from ...format.tensors import Exl3Weights
from ..interface import Backend, BoundLinear, BoundMoE, MoECall, register_backend
from ..specs import ExpertStack, LinearSpec, MoESpec
from . import exllamav3_moe

SUPPORTED_VERSIONS = ("1.6.",)  # the format and kernel behaviour this wrapper was checked against


logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def installed_version() -> str | None:
    """ExLlamaV3's version, read from its files without importing it: `import exllamav3` imports its extension,
    which ExLlamaV3 compiles on the spot (minutes, a CUDA toolkit needed) unless a prebuilt `exllamav3_ext` is
    importable. Asking whether the backend is there (every boot, for the decision log and the metrics) must not
    do that; only binding a layer to it does (prebuilt_extension())."""
    spec = importlib.util.find_spec("exllamav3")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    m = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", version_file.read_text()) if version_file.is_file() \
        else None
    return m.group(1) if m else "unknown"


def prebuilt_extension() -> bool:
    """Is ExLlamaV3's compiled extension importable as is (the appliance image builds it, tools/build-exllamav3-ext)?
    The same test ExLlamaV3's own exllamav3/ext.py makes before it falls back to compiling."""
    spec = importlib.util.find_spec("exllamav3_ext")
    return bool(spec and spec.origin and spec.origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)))


@functools.lru_cache(maxsize=None)
def _import_error() -> str | None:
    version = installed_version()
    if version is None:
        return "exllamav3 not installed"
    if not version.startswith(SUPPORTED_VERSIONS):
        return f"exllamav3 {version} not supported (need {' or '.join(v + 'x' for v in SUPPORTED_VERSIONS)})"
    return None


@functools.lru_cache(maxsize=None)
def load_package() -> None:
    """Import ExLlamaV3 once, when the first layer is bound to it, saying so when that means compiling."""
    if not prebuilt_extension():
        logger.warning("EXL3: ExLlamaV3's CUDA extension is not prebuilt: ExLlamaV3 compiles it now, which takes "
                       "minutes (tools/build-exllamav3-ext builds it ahead of time, as the appliance image does)")
    import exllamav3  # noqa: F401


@functools.lru_cache(maxsize=None)
def reconstruct_threshold() -> int:
    """Rows above which LinearEXL3 reconstructs and calls cuBLAS instead of its own GEMM (0 if this version does not
    say: every call then keeps ExLlamaV3's fp16 output)."""
    from exllamav3.modules.quant import exl3

    return int(getattr(exl3, "AUTO_RECONSTRUCT_THRESHOLD", 0))


def make_layer(w: Exl3Weights):
    """ExLlamaV3's LinearEXL3 over the stored (padded) tensors; building it loads/compiles exllamav3_ext."""
    load_package()
    return exllamav3_moe.linear_exl3(w.trellis, w.suh, w.svh, w.codebook)


class ExLlamaV3Backend(Backend):
    name = "exllamav3"

    def unavailable_reason(self) -> str | None:
        if (err := _import_error()) is not None:
            return err
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None

    def build_id(self) -> str:
        if _import_error() is not None:
            return ""
        return f"exllamav3 {installed_version()} ({'prebuilt' if prebuilt_extension() else 'JIT'} extension)"

    def linear_unsupported_reason(self, spec: LinearSpec) -> str | None:
        if spec.device_type != "cuda":
            return f"needs a CUDA device (layer on {spec.device_type})"
        if spec.act_dtype not in (torch.float16, torch.bfloat16):
            return f"activations must be fp16 or bf16, not {spec.act_dtype}"
        return None

    def bind_linear(self, w: Exl3Weights, in_offset: int, out_offset: int, out_features: int) -> BoundLinear:
        return _Linear(w, in_offset, out_offset, out_features)

    # -- routed experts -----------------------------------------------------------------------------------
    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        if spec.device_type != "cuda":
            return f"needs a CUDA device (layer on {spec.device_type})"
        if spec.act_dtype not in (torch.float16, torch.bfloat16):
            return f"activations must be fp16 or bf16, not {spec.act_dtype}"
        if reason := exllamav3_moe.unsupported_reason(spec):
            return reason
        load_package()  # the API check below imports ExLlamaV3
        return exllamav3_moe.api_reason()

    def bind_moe(self, experts: ExpertStack, call: MoECall) -> BoundMoE:
        if call.top_k is None:
            raise ValueError("the exllamav3 backend builds ExLlamaV3's expert module at load and needs the layer's "
                             "top-k (got None)")
        if (reason := exllamav3_moe.api_reason()) is not None:
            raise RuntimeError(reason)
        return _MoE(experts, call)


class _Linear(BoundLinear):
    """ExLlamaV3's LinearEXL3, built at load (which JIT-loads its extension then, not in the first forward)."""

    backend = ExLlamaV3Backend.name

    def __init__(self, w, in_offset, out_offset, out_features):
        super().__init__(w, in_offset, out_offset, out_features)
        self.layer = make_layer(w)

    def __call__(self, x):
        x16 = x.to(torch.float16)
        if self.in_offset != 0 or x.shape[1] != self.w.in_padded:
            x16 = zero_extend(x16, self.w.in_padded, self.in_offset)
        # fp32 out on the GEMM/GEMV path (the module docstring says why)
        out_dtype = torch.float32 if x16.shape[0] <= reconstruct_threshold() else None
        y = self.layer.forward(x16.contiguous(), {}, out_dtype)
        return y[:, self.out_offset:self.out_offset + self.out_features].to(x.dtype)


class _MoE(BoundMoE):
    """ExLlamaV3's BlockSparseMLP over the stack, built at load (exllamav3_moe.build)."""

    backend = ExLlamaV3Backend.name

    def __init__(self, experts, call):
        super().__init__(experts, call)
        self.module = exllamav3_moe.build(experts, call)

    def __call__(self, x, topk_weights, topk_ids, expert_map):
        return exllamav3_moe.forward(self.module, x, topk_weights, topk_ids, expert_map,
                                     self.call.router_weight_on_input)


register_backend(ExLlamaV3Backend())

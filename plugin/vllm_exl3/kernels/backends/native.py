"""The `native` backend: our CUDA kernels (`vllm_exl3.kernels._C`, built from csrc/ when VLLM_EXL3_BUILD_CUDA=1).

Imports fine without the extension (CPU installs); `unavailable_reason()` then says why it cannot run. The C++ ops
live in the `vllm_exl3` namespace next to the Python-defined ones; their fake (shape-only) implementations are
registered here, so torch.compile traces through them.

Per call, the C++ side picks the kernel by row count and layer size: up to VLLM_EXL3_SKINNY_MAX_ROWS rows the
skinny tensor-core kernel that decodes tiles in registers once per 16 rows, up to VLLM_EXL3_PANEL_MAX_ROWS the panel
kernel that decodes them once per 64 rows, above that the weight with its output-side Hadamard and svh applied
(W' = Ŵ H diag(svh), Hadamard on tensor cores) times the transformed input in one cuBLAS GEMM, and from
VLLM_EXL3_ORIGINAL_MIN_ROWS rows (default: a quarter of the active output columns) the weight in its original basis
times x itself, with no input transform. Defaults (measured crossovers: bench/NOTES.md "Path crossovers"): 16 / 64 rows,
8 / 16 when the layer's fp16 W' fits in the L2 (the GEMM then reads it back from there), 16 / 256 on sm_12x (an
unmeasured estimate). All are CUDA-graph safe: no host syncs, workspace sized by shape, current stream.
"""

from __future__ import annotations

import enum
import functools

import torch
import torch.nn.functional as F

from ...format.constants import CODEBOOKS
from ...format.tensors import Exl3Weights
from ..interface import Backend, BoundLinear, BoundLinearGroup, BoundMoE, MoECall, register_backend
from ..specs import ExpertStack, LinearSpec, MoESpec
from . import native_moe
from .native_limits import limits_reason



class NativePath(enum.IntEnum):
    """The `path` argument of torch.ops.vllm_exl3.native_linear: csrc/planner.h's `enum Path` (kAuto -> AUTO, ...),
    checked name for name and value for value by tests/kernels/test_native_path.py."""

    AUTO = 0  # csrc/planner.cpp plan_linear_path decides
    SKINNY = 1
    RECONSTRUCT = 2
    SKINNY_SPLIT = 3  # bench: split-K forced
    SKINNY_DIRECT = 4  # bench: no split-K
    SKINNY_PLAIN = 5  # bench: rounded Ŵ pairs instead of codewords
    PANEL = 6
    RECON_ORIGINAL = 7


MAX_GROUP_SHARDS = 4  # csrc/exl3_kernels.h kMaxGroupShards
SMALL_LINEAR_MAX_ROWS = 16  # csrc/exl3_kernels.h kSmallLinearMaxRows


@functools.lru_cache(maxsize=None)
def extension_error() -> str | None:
    """Load vllm_exl3.kernels._C (registering its ops); None when loaded, else why not."""
    try:
        from .. import _C  # noqa: F401
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) or "cannot import name '_C'" in str(e):
            return "vllm_exl3.kernels._C not built (install with VLLM_EXL3_BUILD_CUDA=1)"
        return f"vllm_exl3.kernels._C failed to load: {e}"
    _register_fakes()
    native_moe.register_fakes()
    return None


def _register_fakes() -> None:
    def linear_fake(x, trellis, suh, svh, codebook, in_offset, out_offset, out_features, path=NativePath.AUTO):
        return x.new_empty((x.shape[0], out_features))

    def reconstruct_fake(trellis, codebook, suh=None, svh=None, bf16=False):
        return trellis.new_empty((trellis.shape[0] * 16, trellis.shape[1] * 16),
                                 dtype=torch.bfloat16 if bf16 else torch.float16)

    def linear_group_fake(x, trellis, suh, svh, codebook, path=NativePath.AUTO):
        return x.new_empty((x.shape[0], sum(t.shape[1] * 16 for t in trellis)))

    def small_linear_fake(x, weight, out_fp32):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32 if out_fp32 else x.dtype)

    for name, fn in (("vllm_exl3::native_linear", linear_fake), ("vllm_exl3::reconstruct", reconstruct_fake),
                     ("vllm_exl3::native_linear_group", linear_group_fake),
                     ("vllm_exl3::small_linear", small_linear_fake)):
        try:
            torch.library.register_fake(name)(fn)
        except RuntimeError as e:  # already registered (module reloaded)
            if "already" not in str(e):
                raise


def build_info() -> str | None:
    return None if extension_error() else torch.ops.vllm_exl3.build_info()


@functools.lru_cache(maxsize=None)
def _device_reason(device_index: int) -> str | None:
    with torch.cuda.device(device_index):
        return torch.ops.vllm_exl3.device_check() or None


def unavailable_reason() -> str | None:
    if (err := extension_error()) is not None:
        return err
    if not torch.cuda.is_available():
        return "no CUDA device"
    return _device_reason(torch.cuda.current_device())


def codebook_index(codebook: str) -> int:
    return CODEBOOKS.index(codebook)


def reconstruct(w: Exl3Weights, original_basis: bool = False, bf16: bool = False) -> torch.Tensor:
    """Ŵ (rotated basis, bit-exact with reference.decode_rotated) or, with original_basis, W = diag(suh) H Ŵ H
    diag(svh) (the input side in fp32, rounded to fp16; then the output side as the W' kernel does it, with fp16
    butterfly sums; rounded once more at the end); (in, out) padded geometry."""
    cb = codebook_index(w.codebook)
    if original_basis:
        return torch.ops.vllm_exl3.reconstruct(w.trellis, cb, w.suh, w.svh, bf16)
    return torch.ops.vllm_exl3.reconstruct(w.trellis, cb, None, None, bf16)


def linear_args(w: Exl3Weights, in_offset: int, out_offset: int, out_features: int, path: int) -> tuple:
    """native_linear's arguments after x (csrc/bindings.cpp; tests/kernels/test_native_call_schema.py)."""
    return (w.trellis, w.suh, w.svh, codebook_index(w.codebook), in_offset, out_offset, out_features, int(path))


def linear(x: torch.Tensor, w: Exl3Weights, in_offset: int = 0, out_offset: int = 0,
           out_features: int | None = None, path: int = NativePath.AUTO) -> torch.Tensor:
    out_features = w.out_padded - out_offset if out_features is None else out_features
    return torch.ops.vllm_exl3.native_linear(x, *linear_args(w, in_offset, out_offset, out_features, path))


def linear_group_args(ws: list[Exl3Weights], path: int) -> tuple:
    """native_linear_group's arguments after x (csrc/bindings.cpp; tests/kernels/test_native_call_schema.py)."""
    codebooks = {w.codebook for w in ws}
    if len(codebooks) != 1:
        raise ValueError(f"native_linear_group: the shards must share one codebook, got {sorted(codebooks)}")
    return ([w.trellis for w in ws], [w.suh for w in ws], [w.svh for w in ws], codebook_index(ws[0].codebook),
            int(path))


def linear_group(x: torch.Tensor, ws: list[Exl3Weights], path: int = NativePath.AUTO) -> torch.Tensor:
    """y [rows, sum of the shards' padded out] = the whole linears `ws` (2..4, one input: attention q, k, v) side by
    side, x [rows, in_padded]. Up to 8 rows on the skinny path, two kernel launches for all shards; otherwise one
    native_linear per shard (csrc/bindings.cpp, native_linear_group). Not used by the serving path yet."""
    return torch.ops.vllm_exl3.native_linear_group(x, *linear_group_args(ws, path))


# Rows up to which a router gate runs small_linear rather than cuBLAS: where it measured faster (H100, bf16, the
# Qwen3-30B-A3B and GLM-4.5-Air routers: 3.2 / 5.2 µs against 5.3 / 6.9 at 1 row, 3.9 / 6.4 against 5.3 / 6.9 at 2,
# 7.8 / 14.3 against 5.3 / 6.9 at 4; bench/results/s14-h100/call-c/small-linear.md). The kernel takes up to
# SMALL_LINEAR_MAX_ROWS.
ROUTER_GATE_SMALL_LINEAR_ROWS = 2


def _small_linear_takes(x: torch.Tensor) -> bool:
    """Rows and layout csrc/bindings.cpp small_linear accepts (the weight's were checked when the gate was bound),
    up to the rows where it beats cuBLAS."""
    return (1 <= x.shape[0] <= ROUTER_GATE_SMALL_LINEAR_ROWS and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0)


@torch.library.custom_op("vllm_exl3::router_gate", mutates_args=())
def router_gate(x: torch.Tensor, weight: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """A router gate's logits x W^T: small_linear (csrc/small_linear.cu) up to ROUTER_GATE_SMALL_LINEAR_ROWS rows,
    cuBLAS above it (what vLLM's own gate calls: one GEMM with an fp32 output for bf16, else F.linear). The rows are
    known only here: an op, so torch.compile keeps the choice per call."""
    if _small_linear_takes(x):
        return torch.ops.vllm_exl3.small_linear(x, weight, out_fp32)
    if out_fp32 and x.dtype == torch.bfloat16:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    y = F.linear(x, weight)
    return y.float() if out_fp32 else y


@router_gate.register_fake
def _(x, weight, out_fp32):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32 if out_fp32 else x.dtype)


class NativeBackend(Backend):
    name = "native"

    def unavailable_reason(self) -> str | None:
        return unavailable_reason()

    def build_id(self) -> str:
        return build_info() or ""

    def linear_unsupported_reason(self, spec: LinearSpec) -> str | None:
        return limits_reason(spec.device_type, spec.act_dtype, [(spec.codebook, spec.bits)],
                             [spec.in_padded, spec.out_padded])

    def bind_linear(self, w: Exl3Weights, in_offset: int, out_offset: int, out_features: int) -> BoundLinear:
        # The kernels read the stored layout as is: no repacked copy, no extra memory.
        if (err := extension_error()) is not None:
            raise RuntimeError(err)
        return _Linear(w, in_offset, out_offset, out_features)

    def linear_group_unsupported_reason(self, spec: LinearSpec, shards: int) -> str | None:
        if not 2 <= shards <= MAX_GROUP_SHARDS:
            return f"{shards} shards (the grouped kernel takes 2..{MAX_GROUP_SHARDS})"
        return self.linear_unsupported_reason(spec)

    def bind_linear_group(self, shards: list[BoundLinear]) -> BoundLinearGroup:
        if (err := extension_error()) is not None:
            raise RuntimeError(err)
        return _LinearGroup(shards)

    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        return native_moe.unsupported_reason(spec)

    def bind_moe(self, experts: ExpertStack, call: MoECall) -> BoundMoE:
        if (err := extension_error()) is not None:
            raise RuntimeError(err)
        return _MoE(experts, call)

    def router_gate_unsupported_reason(self, dtype: torch.dtype, in_features: int) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16):
            return f"a {str(dtype).removeprefix('torch.')} gate weight (the kernel reads fp16/bf16)"
        if in_features % 8:
            return f"{in_features} input features (the kernel reads rows of 8-feature, 16-byte chunks)"
        return None

    def router_gate(self, x: torch.Tensor, weight: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        return torch.ops.vllm_exl3.router_gate(x, weight, out_fp32)


class _Linear(BoundLinear):
    backend = NativeBackend.name

    def __init__(self, w, in_offset, out_offset, out_features):
        super().__init__(w, in_offset, out_offset, out_features)
        self.args = linear_args(w, in_offset, out_offset, out_features, NativePath.AUTO)

    def __call__(self, x):
        return torch.ops.vllm_exl3.native_linear(x, *self.args)


class _LinearGroup(BoundLinearGroup):
    backend = NativeBackend.name

    def __init__(self, shards):
        super().__init__(shards)
        self.args = linear_group_args(self.ws, NativePath.AUTO)

    def __call__(self, x):
        return torch.ops.vllm_exl3.native_linear_group(x, *self.args)


class _MoE(native_moe.BoundNativeMoE):
    backend = NativeBackend.name


register_backend(NativeBackend())

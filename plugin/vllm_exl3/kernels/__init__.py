"""One dispatch interface for EXL3 compute; backends: `native` (our csrc), `exllamav3` (ExLlamaV3's kernels),
`torch` (the reference, always available).

Python decides *which* backend runs a layer (once, at load time, from `VLLM_EXL3_KERNEL`); the backend decides
*how* (e.g. GEMV vs GEMM by row count) inside the custom op, at run time, because branches on the token count
in traced Python code are frozen at trace time (vllm-cpu-032.md §4.2).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from ..format.tensors import Exl3Weights

logger = logging.getLogger("vllm_exl3.kernels")

KERNEL_ENV = "VLLM_EXL3_KERNEL"
STRICT_ENV = "VLLM_EXL3_KERNEL_STRICT"
CHOICES = ("auto", "native", "exllamav3", "torch")
PREFERENCE = ("native", "exllamav3", "torch")  # `auto` takes the first that is available and supports the layer


@dataclass(frozen=True)
class LinearSpec:
    """What a backend needs to know to accept or refuse a dense EXL3 linear."""

    codebook: str
    bits: float
    in_padded: int  # K of the stored (block-aligned) slice
    out_padded: int  # N of the stored slice
    act_dtype: torch.dtype
    device_type: str


@dataclass(frozen=True)
class MoESpec:
    """What a backend needs to know to accept or refuse a routed-experts layer."""

    codebooks: tuple[str, ...]
    bits: tuple[float, ...]
    hidden_padded: int
    intermediate_padded: int
    num_local_experts: int
    activation: str
    act_dtype: torch.dtype
    device_type: str


ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # gated: act(gate) * up


@dataclass
class ExpertStack:
    """A routed-experts layer's EXL3 weights as one rank stores them.

    gate/up share the input (hidden) and are stacked on dim 1; every tile record is padded to the widest bit
    width in the stack (`*_words` say how many int16 words each (expert, projection) really uses). Intermediate
    features follow the same block-range rule as dense layers (geometry.py): gate/up outputs are computed for
    the stored block range and narrowed at `inter_offset`; the down projection's input is zero-filled there.
    """

    w13_trellis: torch.Tensor  # int16 [E, 2, H/16, I_blk/16, W13]
    w13_suh: torch.Tensor  # fp16 [E, 2, H]
    w13_svh: torch.Tensor  # fp16 [E, 2, I_blk]
    w2_trellis: torch.Tensor  # int16 [E, I_blk/16, H/16, W2]
    w2_suh: torch.Tensor  # fp16 [E, I_blk]
    w2_svh: torch.Tensor  # fp16 [E, H]
    w13_words: tuple[int, ...]  # [E * 2]
    w2_words: tuple[int, ...]  # [E]
    codebooks: tuple[str, ...]  # [E * 3]: gate, up, down of each expert
    inter_offset: int
    inter_size: int

    @property
    def num_experts(self) -> int:
        return self.w13_trellis.shape[0]

    def weights(self, expert: int, proj: int) -> Exl3Weights:
        """Views of one projection (0 gate, 1 up, 2 down) of one local expert."""
        from ..format.records import bits_from_trellis_dim

        if proj < 2:
            words = self.w13_words[2 * expert + proj]
            t, suh, svh = self.w13_trellis[expert, proj], self.w13_suh[expert, proj], self.w13_svh[expert, proj]
        else:
            words = self.w2_words[expert]
            t, suh, svh = self.w2_trellis[expert], self.w2_suh[expert], self.w2_svh[expert]
        return Exl3Weights(t[..., :words], suh, svh, self.codebooks[3 * expert + proj], bits_from_trellis_dim(words))


class Backend:
    """A kernel backend. Subclasses override what they implement; a `None` reason means "yes"."""

    name = "?"

    def unavailable_reason(self) -> str | None:
        return None

    # -- dense linears ------------------------------------------------------------------------------------
    def linear_unsupported_reason(self, spec: LinearSpec) -> str | None:
        return "dense linears not implemented"

    def prepare_linear(self, w: Exl3Weights) -> torch.Tensor:
        """Once per layer after loading: any derived tensor the backend wants (a decoded cache, a repacked
        trellis). Returned tensor is kept on the layer and handed back to `linear`; empty when unused."""
        return torch.empty(0, device=w.trellis.device)

    def linear(self, x: torch.Tensor, w: Exl3Weights, prepared: torch.Tensor, in_offset: int, out_offset: int,
               out_features: int) -> torch.Tensor:
        """y = x·W for a layer stored as the 128-aligned block range around its logical slice.

        x: [M, in] in the activation dtype, placed at columns [in_offset, in_offset + in) of a zero input of
        width w.in_padded; returns [M, out_features] = columns [out_offset, out_offset + out_features) of the
        output, in x's dtype, without bias. Must not sync the host or allocate by tensor *values* (CUDA graphs).
        """
        raise NotImplementedError

    # -- routed experts -----------------------------------------------------------------------------------
    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        return "routed experts not implemented"

    def prepare_moe(self, experts: ExpertStack) -> list[torch.Tensor]:
        return []

    def moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            expert_map: torch.Tensor | None, experts: ExpertStack, prepared: list[torch.Tensor], activation: str,
            router_weight_on_input: bool) -> torch.Tensor:
        """Σ_k w_k · expert_{id_k}(x) over the experts local to this rank, [M, H] in x's dtype.

        topk_ids are global expert ids; `expert_map` (global -> local, -1 elsewhere) is given under expert
        parallelism. With `router_weight_on_input` (top-1 models) x is scaled before the experts instead."""
        raise NotImplementedError


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    _load_backends()
    return _REGISTRY[name]


_backends_loaded = False


def _load_backends() -> None:
    """Import every backend module once (each registers itself), whatever was imported before."""
    global _backends_loaded
    if _backends_loaded:
        return
    _backends_loaded = True
    from .backends import torch_ref as torch_backend  # noqa: F401  (registers "torch")

    for module in ("backends.native", "backends.exllamav3"):
        try:
            __import__(f"{__name__}.{module}")
        except ImportError as e:  # a backend module itself must import; its *library* may be missing
            logger.debug("backend module %s not importable: %s", module, e)


def requested_kernel() -> str:
    value = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{KERNEL_ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


# ------------------------------------------------------------------------------------------------------------
# Decisions: which backend serves which layer, and why the preferred ones did not. Logged once per layer type,
# counted for metrics.
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    layer_type: str  # e.g. "linear:mul1:4b" or "moe:mcg:3b"
    backend: str
    fallback_reasons: tuple[tuple[str, str], ...]  # (backend, why not) for each preferred backend skipped


_lock = threading.Lock()
_decision_counts: Counter[Decision] = Counter()


def decision_counts() -> dict[Decision, int]:
    with _lock:
        return dict(_decision_counts)


def _record(decision: Decision) -> None:
    with _lock:
        first = decision not in _decision_counts
        _decision_counts[decision] += 1
    if first:
        if decision.fallback_reasons:
            why = "; ".join(f"{b}: {r}" for b, r in decision.fallback_reasons)
            logger.info("EXL3 %s -> %s backend (skipped %s)", decision.layer_type, decision.backend, why)
        else:
            logger.info("EXL3 %s -> %s backend", decision.layer_type, decision.backend)


def _choose(layer_type: str, reason_of) -> Backend:
    """`auto`: the first of PREFERENCE that is available and serves the layer. A named backend comes first and
    must be installed (else an error: the user asked for it); a layer type it does not implement falls back down
    the preference order with a warning, unless STRICT_ENV=1 makes that an error too (for A/B measurements)."""
    _load_backends()
    requested = requested_kernel()
    candidates = PREFERENCE if requested == "auto" else (requested,) + tuple(p for p in PREFERENCE if p != requested)
    skipped: list[tuple[str, str]] = []
    for name in candidates:
        backend = _REGISTRY.get(name)
        unavailable = "not installed" if backend is None else backend.unavailable_reason()
        if unavailable and name == requested:
            raise RuntimeError(f"{KERNEL_ENV}={requested}, but that backend is unavailable: {unavailable}")
        reason = unavailable or reason_of(backend)
        if reason is None:
            if requested not in ("auto", name):
                if os.environ.get(STRICT_ENV) == "1":
                    raise RuntimeError(f"{KERNEL_ENV}={requested} cannot serve {layer_type} ({skipped[0][1]}) and "
                                       f"{STRICT_ENV}=1 forbids falling back")
                logger.warning("EXL3 %s: %s backend cannot serve it (%s); using %s", layer_type, requested,
                               skipped[0][1], name)
            _record(Decision(layer_type, name, tuple(skipped)))
            return backend
        skipped.append((name, reason))
    raise RuntimeError(f"no EXL3 backend serves {layer_type}: {skipped}")


def choose_linear_backend(spec: LinearSpec) -> Backend:
    layer_type = f"linear:{spec.codebook}:{spec.bits:g}b:{spec.device_type}"
    return _choose(layer_type, lambda b: b.linear_unsupported_reason(spec))


def choose_moe_backend(spec: MoESpec) -> Backend:
    cbs = "+".join(sorted(set(spec.codebooks)))
    bits = "+".join(f"{b:g}" for b in sorted(set(spec.bits)))
    layer_type = f"moe:{cbs}:{bits}b:{spec.device_type}"
    return _choose(layer_type, lambda b: b.moe_unsupported_reason(spec))

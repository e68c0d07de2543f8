"""Which backend serves which layer, and why the preferred ones did not: logged once per layer type, counted for
metrics. What the user asked for (requested.py) comes first; strict mode (VLLM_EXL3_KERNEL_STRICT=1) turns a
fallback into an error (errors.py). A (backend, layer type) the parity gate failed (kernels/parity.py) is skipped
from then on, with the gate's numbers as the reason."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from ..base import settings
from .backend import REGISTRY, load_backends
from .errors import BackendUnavailableError, FallbackRefusedError
from .interface import Backend
from .requested import KERNEL_ENV, PREFERENCE, STRICT_ENV, requested_kernel, strict
from .specs import LinearSpec, MoESpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    layer_type: str  # e.g. "linear:mul1:4b" or "moe:mcg:3b"
    backend: str
    fallback_reasons: tuple[tuple[str, str], ...]  # (backend, why not) for each preferred backend skipped


_lock = threading.Lock()
_decision_counts: Counter[Decision] = Counter()
_excluded: dict[tuple[str, str], str] = {}  # (backend, layer type) -> why (the parity gate failed it)


def exclude(backend: str, layer_type: str, reason: str) -> None:
    """Never choose `backend` for `layer_type` again in this process (kernels.parity's fallback)."""
    with _lock:
        _excluded[(backend, layer_type)] = reason


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
    must be installed (else BackendUnavailableError: the user asked for it); a layer type it does not implement
    falls back down the preference order with a warning, unless STRICT_ENV=1 makes that an error too
    (FallbackRefusedError, for A/B measurements)."""
    load_backends()
    requested = requested_kernel()
    candidates = PREFERENCE if requested == "auto" else (requested,) + tuple(p for p in PREFERENCE if p != requested)
    skipped: list[tuple[str, str]] = []
    for name in candidates:
        backend = REGISTRY.get(name)
        unavailable = "not installed" if backend is None else backend.unavailable_reason()
        if unavailable and name == requested:
            raise BackendUnavailableError(KERNEL_ENV, requested, f"that backend is unavailable here: {unavailable}")
        reason = unavailable or _excluded.get((name, layer_type)) or reason_of(backend)
        if reason is None:
            if requested not in ("auto", name):
                if strict():
                    raise FallbackRefusedError(STRICT_ENV, settings.get(STRICT_ENV),
                                               f"{KERNEL_ENV}={requested} cannot serve {layer_type} "
                                               f"({skipped[0][1]}) and falling back to {name} is forbidden")
                logger.warning("EXL3 %s: %s backend cannot serve it (%s); using %s", layer_type, requested,
                               skipped[0][1], name)
            _record(Decision(layer_type, name, tuple(skipped)))
            return backend
        skipped.append((name, reason))
    # Internal: the torch reference serves every layer type, so this means a broken install, not a setting.
    raise RuntimeError(f"no EXL3 backend serves {layer_type}: {skipped}")


def linear_layer_type(spec: LinearSpec) -> str:
    return f"linear:{spec.codebook}:{spec.bits:g}b:{spec.device_type}"


def moe_layer_type(spec: MoESpec) -> str:
    """`moe:<codebooks>:<bits>b[:<activation>][:bias]:<device>`: the activation named when it is not silu."""
    cbs = "+".join(sorted(set(spec.codebooks)))
    bits = "+".join(f"{b:g}" for b in sorted(set(spec.bits)))
    variant = "".join((f":{spec.activation}" if spec.activation != "silu" else "", ":bias" if spec.has_bias else ""))
    return f"moe:{cbs}:{bits}b{variant}:{spec.device_type}"


def choose_linear_backend(spec: LinearSpec) -> Backend:
    return _choose(linear_layer_type(spec), lambda b: b.linear_unsupported_reason(spec))


GROUP_ENV = "VLLM_EXL3_GROUP_LINEARS"


def linear_group_layer_type(spec: LinearSpec) -> str:
    return f"linear_group:{spec.codebook}:{spec.bits:g}b:{spec.device_type}"


def choose_linear_group_backend(spec: LinearSpec, shards: int, backend_name: str) -> Backend | None:
    """Whether the shards of one layer, each already bound to the backend named, run as one grouped call on it: it,
    or None (one call per shard) when GROUP_ENV=0, the backend has no grouped kernel for them, or the parity gate
    failed its grouped call. Never another backend: the group is the shards' own kernels, called together."""
    layer_type = linear_group_layer_type(spec)
    if not settings.get_bool(GROUP_ENV):
        return None
    backend = REGISTRY[backend_name]
    with _lock:
        excluded = (backend_name, layer_type) in _excluded
    if excluded or backend.linear_group_unsupported_reason(spec, shards) is not None:
        return None
    _record(Decision(layer_type, backend.name, ()))  # a grouped layer traces another op: in the compile key
    return backend


def choose_moe_backend(spec: MoESpec) -> Backend:
    return _choose(moe_layer_type(spec), lambda b: b.moe_unsupported_reason(spec))


ROUTER_GATE_ENV = "VLLM_EXL3_ROUTER_GATE"


def router_gate_on() -> bool:
    """Whether MoE router gates (16-bit, not EXL3) run on the plugin's backends (ROUTER_GATE_ENV), instead of
    vLLM's own gate GEMM. `auto` (the default): where the native backend serves the model's layers (asked for by
    name or by `auto`, and available here: a CUDA GPU and the built kernels), the case a served A/B measured faster
    (bench/notes/serving-run-16.md "Sixteenth run"); elsewhere vLLM's gate, since nothing measured a gain there."""
    if settings.get(ROUTER_GATE_ENV).strip().lower() != "auto":
        return settings.get_bool(ROUTER_GATE_ENV)
    load_backends()
    native = REGISTRY.get("native")
    return requested_kernel() in ("auto", "native") and native is not None and native.unavailable_reason() is None


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def router_gate_layer_type(dtype: torch.dtype, device_type: str) -> str:
    return f"router_gate:{_DTYPE_NAMES.get(dtype, str(dtype).removeprefix('torch.'))}:{device_type}"


def choose_router_gate_backend(dtype: torch.dtype, in_features: int, device_type: str) -> Backend:
    """The backend for a router gate of this weight dtype and width, chosen as for the EXL3 layers (the requested
    one first, strict refusing a fallback, a parity failure excluding it); the torch reference serves every gate."""
    return _choose(router_gate_layer_type(dtype, device_type),
                   lambda b: b.router_gate_unsupported_reason(dtype, in_features))

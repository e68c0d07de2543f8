"""Which backend serves which layer, and why the preferred ones did not: logged once per layer type, counted for
metrics; strict mode (VLLM_EXL3_KERNEL_STRICT=1) turns a fallback into an error. A (backend, layer type) the
parity gate failed (kernels/parity.py) is skipped from then on, with the gate's numbers as the reason."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass

from . import backend as _backend
from .backend import Backend
from .choice import KERNEL_ENV, PREFERENCE, STRICT_ENV, requested_kernel
from .specs import LinearSpec, MoESpec

logger = logging.getLogger("vllm_exl3.kernels")


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
    must be installed (else an error: the user asked for it); a layer type it does not implement falls back down
    the preference order with a warning, unless STRICT_ENV=1 makes that an error too (for A/B measurements)."""
    _backend.load_backends()
    requested = requested_kernel()
    candidates = PREFERENCE if requested == "auto" else (requested,) + tuple(p for p in PREFERENCE if p != requested)
    skipped: list[tuple[str, str]] = []
    for name in candidates:
        backend = _backend.REGISTRY.get(name)
        unavailable = "not installed" if backend is None else backend.unavailable_reason()
        if unavailable and name == requested:
            raise RuntimeError(f"{KERNEL_ENV}={requested}, but that backend is unavailable: {unavailable}")
        reason = unavailable or _excluded.get((name, layer_type)) or reason_of(backend)
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


def linear_layer_type(spec: LinearSpec) -> str:
    return f"linear:{spec.codebook}:{spec.bits:g}b:{spec.device_type}"


def moe_layer_type(spec: MoESpec) -> str:
    cbs = "+".join(sorted(set(spec.codebooks)))
    bits = "+".join(f"{b:g}" for b in sorted(set(spec.bits)))
    return f"moe:{cbs}:{bits}b:{spec.device_type}"


def choose_linear_backend(spec: LinearSpec) -> Backend:
    return _choose(linear_layer_type(spec), lambda b: b.linear_unsupported_reason(spec))


def choose_moe_backend(spec: MoESpec) -> Backend:
    return _choose(moe_layer_type(spec), lambda b: b.moe_unsupported_reason(spec))

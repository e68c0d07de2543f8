"""Binding a layer to a kernel backend, checked: the parity gate (kernels/parity.py) decides, this module acts.

Every layer binds through `bind_checked`, which remembers how to bind it again under its (backend, layer type).
When the gate returns a `Fallback` for a (backend, layer type), every layer bound to it so far is bound again;
selection (kernels/selection.py) has excluded the failed backend, so each gets the next one. Layers bound later
never see the failed backend."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..kernels import parity
from ..kernels.interface import Backend

_lock = threading.Lock()
_bound: dict[tuple[str, str], list[Callable[[], None]]] = {}  # (backend, layer type) -> how to bind each again


def bind_checked(layer: str, layer_type: str, backend: Backend, dtype: torch.dtype,
                 measure: Callable[[], tuple[float, str]], rebind: Callable[[], None],
                 last_block: bool) -> None:
    """Called right after `backend` was bound to `layer`: record `rebind` (which chooses and binds the layer
    again), run the gate, and act on a fallback it decides."""
    with _lock:
        _bound.setdefault((backend.name, layer_type), []).append(rebind)
    fallback = parity.gate(layer, layer_type, backend, dtype, measure, last_block)
    if fallback is not None:
        with _lock:
            again = _bound.pop((fallback.backend, fallback.layer_type), [])
        for bind in again:
            bind()


def reset() -> None:
    """Forget every binding (tests; with parity.reset())."""
    with _lock:
        _bound.clear()

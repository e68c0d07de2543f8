"""This worker's EXL3 state, published as a JSON file for the metrics exporter (appliance/metrics/).

vLLM's own `/metrics` lives in the API server process, and a headless worker (rank 1 on the second Spark) has no
API server at all, while backend decisions, the parity gate and the load receipt happen in the worker processes.
So each worker writes `$VLLM_EXL3_STATE_DIR/exl3-rank<rank>.json` (base/state.py names it; atomically: temp file +
rename), and the exporter beside it (one per node) turns every such file into metrics at scrape time. The keys
below are the contract with base/state.py's `read_worker`; tests/appliance/test_metrics_exporter.py writes a file
through `publish()` and reads it back through the exporter.

Once per load, not once per layer: every EXL3 layer calls `layer_bound()` when its backend is bound, and the file is
written once no layer has been bound for `QUIET_S` seconds (a daemon thread waits for that), so a load of hundreds
of layers writes it once. Why a quiet period and not a call after the last layer: vLLM binds the layers one by one in
`process_weights_after_loading` and tells no quantization method which layer is the last, nor calls a plugin after
the loop (vllm/model_executor/model_loader/utils.py); a count of the layers the config created would never complete
for a layer vLLM builds but does not post-process. A long bind phase (the parity gate's checks of a large model) still
publishes at least every `MAX_DELAY_S` seconds, and the file is current well before the server answers: vLLM
profiles memory and captures CUDA graphs after loading.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..base import settings
from ..base.state import STATE_DIR_ENV, worker_file
from ..base.version import __version__
from ..format.jsonfile import write_json
from ..kernels import parity, selection
from ..kernels.backend import REGISTRY, load_backends
from ..kernels.requested import PREFERENCE, requested_kernel
from ..loader.progress import last_load_stats

logger = logging.getLogger(__name__)

SCHEMA = 1
QUIET_S = 1.0  # publish once no layer has been bound for this long
MAX_DELAY_S = 30.0  # ... or once the first unpublished binding is this old
_warned = False
writes = 0  # files written by this process (what the once-per-load rule is measured by)

_lock = threading.Lock()
_first_pending: float | None = None  # monotonic time of the oldest binding not yet published
_last_pending = 0.0  # ... and of the newest
_device: int | None = None  # the CUDA device of the bound layers (the timer thread's own current device is 0)
_timer: threading.Thread | None = None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _native_archs() -> list[str]:
    """The SASS targets of the native extension (`archs=` in csrc/bindings.cpp's build_info), [] without it."""
    from ..kernels.backends import native

    info = native.build_info() or ""
    return [a for a in info.partition("archs=")[2].replace(";", ",").split(",") if a.strip()]


def snapshot(device: int | None = None) -> dict[str, Any]:
    load_backends()
    decisions = [{"layer_type": d.layer_type, "backend": d.backend, "layers": n,
                  "skipped": [{"backend": b, "reason": r} for b, r in d.fallback_reasons]}
                 for d, n in sorted(selection.decision_counts().items(), key=lambda kv: kv[0].layer_type)]
    backends = []
    for name in PREFERENCE:
        b = REGISTRY.get(name)
        reason = "not installed" if b is None else b.unavailable_reason()
        backends.append({"name": name, "available": reason is None, "reason": reason or ""})
    receipt = last_load_stats()
    return {
        "schema": SCHEMA, "time": time.time(), "pid": os.getpid(), "rank": _rank(),
        "role": settings.get("VLLM_EXL3_ROLE") or "single", "version": __version__,
        "kernel_request": requested_kernel(), "backends": backends, "native_archs": _native_archs(),
        "decisions": decisions, "served": parity.served(),
        "parity": {"policy": parity.policy(), "checks": [
            {"layer": c.layer, "layer_type": c.layer_type, "backend": c.backend, "error": c.error,
             "bound": c.bound, "passed": c.passed} for c in parity.checks()]},
        "load": receipt.to_json() if receipt is not None else None,
        "device_allocated_bytes": torch.cuda.memory_allocated(device) if torch.cuda.is_initialized() else None,
    }


def publish(device: int | None = None) -> Path | None:
    """Write this worker's snapshot now; a failure is logged once and never stops serving (metrics are optional)."""
    global _warned, writes
    body = snapshot(device)
    path = worker_file(body["rank"])
    try:
        written = write_json(path, body, indent=1, make_parent=True)
    except OSError as e:
        if not _warned:
            logger.warning("EXL3 metrics: cannot write %s (%s); the metrics exporter will not see this worker "
                           "(set %s to a writable directory)", path, e, STATE_DIR_ENV)
            _warned = True
        return None
    writes += 1
    return written


def layer_bound() -> None:
    """An EXL3 layer has been bound to its backend: publish once the binding is over (see the module's doc)."""
    global _first_pending, _last_pending, _device, _timer
    now = time.monotonic()
    with _lock:
        _first_pending = _first_pending if _first_pending is not None else now
        _last_pending = now
        if torch.cuda.is_initialized():
            _device = torch.cuda.current_device()
        if _timer is None:
            _timer = threading.Thread(target=_publish_when_quiet, name="vllm-exl3-telemetry", daemon=True)
            _timer.start()


def _due() -> float:
    """Seconds until the pending snapshot is due (<= 0: now). Called with _lock held."""
    now = time.monotonic()
    return min(_last_pending + QUIET_S, _first_pending + MAX_DELAY_S) - now


def _take() -> int | None:
    """Forget the pending snapshot and return its device. Called with _lock held."""
    global _first_pending, _timer
    _first_pending, _timer = None, None
    return _device


def _publish_when_quiet() -> None:
    while True:
        with _lock:
            if _first_pending is None:  # flush() published it
                return
            wait = _due()
            if wait <= 0:
                device = _take()
                break
        time.sleep(wait)
    publish(device)


def flush() -> Path | None:
    """Publish a pending snapshot now, rather than after the quiet period (tests; a process about to exit)."""
    with _lock:
        if _first_pending is None:
            return None
        device = _take()
    return publish(device)

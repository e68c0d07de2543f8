"""This worker's EXL3 state, published as a JSON file for the metrics exporter (appliance/metrics/).

vLLM's own `/metrics` lives in the API server process, and a headless worker (rank 1 on the second Spark) has no
API server at all, while backend decisions, the parity gate and the load receipt happen in the worker processes.
So each worker writes `$VLLM_EXL3_STATE_DIR/exl3-rank<rank>.json` (atomically: temp file + rename) whenever a
layer has been bound, and the exporter beside it (one per node) turns every such file into metrics at scrape
time. The file names and keys below are the contract with appliance/metrics/state.py; tests/appliance/
test_metrics_state.py writes a file through `publish()` and reads it back through the exporter's reader.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..format.jsonfile import write_json
from ..kernels import parity, selection
from ..kernels.backend import REGISTRY, load_backends
from ..kernels.choice import PREFERENCE, requested_kernel
from ..loader.progress import last_load_stats

logger = logging.getLogger("vllm_exl3.telemetry")

STATE_DIR_ENV = "VLLM_EXL3_STATE_DIR"
DEFAULT_STATE_DIR = "/tmp/vllm-exl3-state"
SCHEMA = 1
_warned = False


def state_dir(environ=None) -> Path:
    return Path((os.environ if environ is None else environ).get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def worker_file(rank: int, environ=None) -> Path:
    return state_dir(environ) / f"exl3-rank{rank}.json"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _native_archs() -> list[str]:
    """The SASS targets of the native extension (`archs=` in csrc/bindings.cpp's build_info), [] without it."""
    from ..kernels.backends import native

    info = native.build_info() or ""
    return [a for a in info.partition("archs=")[2].replace(";", ",").split(",") if a.strip()]


def snapshot() -> dict[str, Any]:
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
        "role": os.environ.get("VLLM_EXL3_ROLE") or "single", "version": __version__,
        "kernel_request": requested_kernel(), "backends": backends, "native_archs": _native_archs(),
        "decisions": decisions, "served": parity.served(),
        "parity": {"policy": parity.policy(), "checks": [
            {"layer": c.layer, "layer_type": c.layer_type, "backend": c.backend, "error": c.error,
             "bound": c.bound, "passed": c.passed} for c in parity.checks()]},
        "load": receipt.to_json() if receipt is not None else None,
        "device_allocated_bytes": torch.cuda.memory_allocated() if torch.cuda.is_initialized() else None,
    }


def publish() -> Path | None:
    """Write this worker's snapshot; a failure is logged once and never stops serving (metrics are optional)."""
    global _warned
    body = snapshot()
    path = worker_file(body["rank"])
    try:
        return write_json(path, body, indent=1, make_parent=True)
    except OSError as e:
        if not _warned:
            logger.warning("EXL3 metrics: cannot write %s (%s); the metrics exporter will not see this worker "
                           "(set %s to a writable directory)", path, e, STATE_DIR_ENV)
            _warned = True
        return None

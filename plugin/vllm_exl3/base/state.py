"""The state files the serving processes publish in `VLLM_EXL3_STATE_DIR`: where they are, and their readers.

- `exl3-rank<N>.json`, one per worker rank (written by integration/telemetry.py; keys documented there).
- `memory-watchdog.json`, the memory watchdog's last reading and verdict (appliance/watchdog.py).
- `peer.json`, the two-Spark heartbeat: whether this node sees its peer (appliance/peer.py).
- `memory-plan.json`, the launcher's memory plan for this node (appliance/launch.py).

Writers name their file through `state_file` / `worker_file`; the health checks read through `load`, the metrics
exporter through the checked readers. A file that is missing reads as None; a file that is present but wrong raises
`StateError` naming the file, the field, what was expected and what was found (the exporter logs it and exports the
file as invalid). Standard library only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import settings

STATE_DIR_ENV = "VLLM_EXL3_STATE_DIR"
WORKER_FILE = re.compile(r"^exl3-rank(\d+)\.json$")  # worker_file()'s names
WATCHDOG_FILE = "memory-watchdog.json"
PEER_FILE = "peer.json"
PLAN_FILE = "memory-plan.json"
WATCHDOG_STATES = ("ok", "soft", "hard")
NUMBER = (int, float)


class StateError(ValueError):
    def __init__(self, file: Path, field: str | None, expected: str, found: str):
        self.file, self.field = file, field
        where = f"{file}: {field}" if field else str(file)
        super().__init__(f"{where}: expected {expected}, found {found}")


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    return Path(settings.get(STATE_DIR_ENV, env))


def state_file(name: str, env: Mapping[str, str] | None = None) -> Path:
    """One of the appliance's state files (WATCHDOG_FILE, PEER_FILE, PLAN_FILE) in the state directory."""
    return state_dir(env) / name


def worker_file(rank: int, env: Mapping[str, str] | None = None) -> Path:
    """The state file of the worker of rank `rank`."""
    return state_dir(env) / f"exl3-rank{rank}.json"


def load(path: Path) -> dict[str, Any] | None:
    """A state file's JSON object; None when there is no such file; StateError when it is not one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(path, None, "a readable file", str(e)) from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise StateError(path, None, "JSON", f"{e}") from None
    if not isinstance(data, dict):
        raise StateError(path, None, "a JSON object", type(data).__name__)
    return data


def _what(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in (types if isinstance(types, tuple) else (types,)))


def _field(path: Path, data: dict, key: str, types, what: str | None = None, *, optional: bool = False,
           label: str | None = None):
    label, what = label or key, what or _what(types)
    if key not in data or data[key] is None:
        if optional:
            return None
        raise StateError(path, label, what, "nothing (the key is missing)")
    value = data[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, types):
        raise StateError(path, label, what, repr(value))
    return value


@dataclass(frozen=True)
class Watchdog:
    time: float
    mem_available_bytes: float
    mem_total_bytes: float
    swap_used_bytes: float
    psi_some_avg10: float
    psi_full_avg10: float
    state: str
    soft_floor_bytes: float
    hard_floor_bytes: float
    soft_events_total: float
    hard_stops_total: float


def _read(path: Path, build: Callable[[Path, dict[str, Any]], Any]) -> Any:
    """`build(path, document)` of a state file; None when there is no such file."""
    data = load(path)
    return None if data is None else build(path, data)


def read_watchdog(directory: Path) -> Watchdog | None:
    return _read(directory / WATCHDOG_FILE, _watchdog)


def _watchdog(path: Path, data: dict[str, Any]) -> Watchdog:
    values = {k: _field(path, data, k, NUMBER, "a number")
              for k in Watchdog.__dataclass_fields__ if k != "state"}
    state = _field(path, data, "state", str, f"one of {', '.join(WATCHDOG_STATES)}")
    if state not in WATCHDOG_STATES:
        raise StateError(path, "state", f"one of {', '.join(WATCHDOG_STATES)}", repr(state))
    return Watchdog(state=state, **values)


@dataclass(frozen=True)
class Peer:
    time: float
    role: str
    peer: str
    alive: bool
    last_seen: float | None


def read_peer(directory: Path) -> Peer | None:
    return _read(directory / PEER_FILE, lambda path, data: Peer(
        _field(path, data, "time", NUMBER, "a number (Unix time)"), _field(path, data, "role", str, "a role name"),
        _field(path, data, "peer", str, "the peer's address or name"),
        _field(path, data, "alive", bool, "true or false"),
        _field(path, data, "last_seen", NUMBER, "a number (Unix time) or null", optional=True)))


@dataclass(frozen=True)
class MemoryPlan:
    time: float
    fits: bool
    gpu_memory_utilization: float
    max_model_len: int
    kv_tokens: int
    weights_bytes: int
    kv_bytes: int


def read_memory_plan(directory: Path) -> MemoryPlan | None:
    return _read(directory / PLAN_FILE, lambda path, data: MemoryPlan(
        _field(path, data, "time", NUMBER), _field(path, data, "fits", bool),
        _field(path, data, "gpu_memory_utilization", NUMBER),
        *(_field(path, data, k, int) for k in ("max_model_len", "kv_tokens", "weights_bytes", "kv_bytes"))))


@dataclass(frozen=True)
class Worker:
    """One worker rank's EXL3 state (integration/telemetry.py's snapshot), with its file's own checks done."""

    path: Path
    rank: int
    role: str
    pid: int
    time: float
    data: dict[str, Any]

    @property
    def alive(self) -> bool:
        """Is the process that wrote it still running? (A file left by a previous run is not exported.)"""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _list_of_objects(path: Path, data: dict, key: str, keys: dict[str, Any], prefix: str = "") -> list[dict]:
    items = _field(path, data, key, list, label=prefix + key)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise StateError(path, f"{prefix}{key}[{i}]", "an object", repr(item))
        for k, types in keys.items():
            _field(path, item, k, types, label=f"{prefix}{key}[{i}].{k}")
    return items


def read_worker(path: Path) -> Worker:
    data = load(path)
    if data is None:
        raise StateError(path, None, "a worker state file", "nothing (it vanished)")
    schema = _field(path, data, "schema", int, "schema 1")
    if schema != 1:
        raise StateError(path, "schema", "1 (this exporter's version)", repr(schema))
    rank = _field(path, data, "rank", int, "the worker's rank")
    expected_rank = int(WORKER_FILE.match(path.name).group(1))
    if rank != expected_rank:
        raise StateError(path, "rank", f"{expected_rank} (as the file name says)", repr(rank))
    decisions = _list_of_objects(path, data, "decisions", {"layer_type": str, "backend": str, "layers": int})
    for i, d in enumerate(decisions):
        _list_of_objects(path, d, "skipped", {"backend": str, "reason": str}, f"decisions[{i}].")
    _list_of_objects(path, data, "backends", {"name": str, "available": bool, "reason": str})
    for i, arch in enumerate(_field(path, data, "native_archs", list, "a list of architectures")):
        if not isinstance(arch, str):
            raise StateError(path, f"native_archs[{i}]", "a string", repr(arch))
    for layer_type, backend in _field(path, data, "served", dict, "an object (layer type -> backend)").items():
        if not isinstance(backend, str):
            raise StateError(path, f"served.{layer_type}", "a backend name", repr(backend))
    _field(path, data, "device_allocated_bytes", int, "an integer or null", optional=True)
    parity = _field(path, data, "parity", dict, "an object")
    _list_of_objects(path, parity, "checks", {"layer_type": str, "backend": str, "error": NUMBER, "bound": NUMBER,
                                              "passed": bool}, "parity.")
    receipt = _field(path, data, "load", dict, "an object or null", optional=True)
    if receipt is not None:
        for k in ("bytes", "seconds", "workers", "files", "tensors", "wait_seconds"):
            _field(path, receipt, k, NUMBER, label=f"load.{k}")
    return Worker(path, rank, _field(path, data, "role", str, "a role name"), _field(path, data, "pid", int, "a pid"),
                  _field(path, data, "time", NUMBER, "a number (Unix time)"), data)


def worker_files(directory: Path) -> list[Path]:
    try:
        names = sorted(p for p in directory.iterdir() if WORKER_FILE.match(p.name))
    except FileNotFoundError:
        return []
    return names

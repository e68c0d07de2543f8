"""`vllm-exl3 info`: what this install can run — kernel backends (available or why not), the native build, devices —
and the parity gate's report of each server on this machine (kernels/parity.py), with whether its writer runs."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from .. import __version__


@dataclass
class BackendInfo:
    name: str
    available: bool
    reason: str | None


@dataclass
class ParityReport:
    path: str
    report: dict | None  # None: unreadable, `problem` says why
    problem: str
    running: bool | None  # whether the process that wrote it still runs (None: the report names no pid)


@dataclass
class Info:
    version: str
    torch: str
    torch_cuda: str | None
    devices: list[str]
    kernel_env: str
    backends: list[BackendInfo] = field(default_factory=list)
    native_build: str | None = None
    parity_reports: list[ParityReport] = field(default_factory=list)  # one per server and rank (kernels/parity.py)

    def to_json(self) -> dict:
        return asdict(self)


def writer_running(report: dict) -> bool | None:
    """Whether the process that wrote `report` still runs: its pid exists and started before the report was
    written (so a later process that reused the pid does not count)."""
    import psutil

    pid, written = report.get("pid"), report.get("time")
    if not isinstance(pid, int) or not isinstance(written, (int, float)):
        return None
    try:
        return psutil.Process(pid).create_time() <= written + 1
    except psutil.AccessDenied:  # another user's process: it exists
        return True
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def collect(port: int | None = None) -> Info:
    from ..kernels.backend import get_backend
    from ..kernels.choice import KERNEL_ENV, PREFERENCE

    get_backend("torch")  # loads every backend module first (kernels._load_backends runs once, on first use)
    from ..kernels.backends import native

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                           f"{p.total_memory / 2**30:.0f} GiB)")
    info = Info(__version__, torch.__version__, torch.version.cuda, devices, os.environ.get(KERNEL_ENV, "auto"))
    for name in PREFERENCE:
        try:
            reason = get_backend(name).unavailable_reason()
        except KeyError:
            reason = "backend module not importable"
        info.backends.append(BackendInfo(name, reason is None, reason))
    info.native_build = native.build_info()
    from ..kernels.parity import read_reports

    info.parity_reports = [ParityReport(str(r.path), r.body, r.problem, writer_running(r.body) if r.body else None)
                           for r in read_reports(port=port)]
    return info

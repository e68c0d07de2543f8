"""`vllm-exl3 info`: what this install can run — kernel backends (available or why not), the native build, devices —
and the parity gate's report of each server on this machine (kernels/parity.py), with whether its writer runs."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

from rich.table import Table

from ..base import settings
from ..base.argtypes import port_number
from ..base.version import __version__
from .common import console


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
    import torch

    from ..kernels.backend import get_backend
    from ..kernels.requested import KERNEL_ENV, PREFERENCE

    get_backend("torch")  # loads every backend module first (kernels/backend.py load_backends, once)
    from ..kernels.backends import native

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                           f"{p.total_memory / 2**30:.0f} GiB)")
    info = Info(__version__, torch.__version__, torch.version.cuda, devices, settings.get(KERNEL_ENV))
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


def info(p: argparse.ArgumentParser):
    """Kernel backends this install can run (and why not), the native build's targets, the CUDA devices, and the
    parity gate's report of each server on this machine (--port: only the server on that API port)."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--port", type=port_number, help="only the parity report of the server on this API port")

    def run(a: argparse.Namespace) -> int:
        found = collect(a.port)
        if a.json:
            print(json.dumps(found.to_json(), indent=2))
            return 0
        console.print(f"vllm-exl3 {found.version}, torch {found.torch} (CUDA {found.torch_cuda or 'none'}), "
                      f"VLLM_EXL3_KERNEL={found.kernel_env}")
        for d in found.devices or ["no CUDA device"]:
            console.print(f"  {d}")
        t = Table(title="kernel backends (auto prefers them in this order)")
        for col in ("backend", "available", "why not"):
            t.add_column(col)
        for b in found.backends:
            t.add_row(b.name, "[green]yes[/]" if b.available else "[red]no[/]", b.reason or "")
        console.print(t)
        if found.native_build:
            console.print(f"native build: {found.native_build}")
        _print_parity(found.parity_reports, a.port)
        return 0

    return run


def _server_label(report: dict) -> str:
    """`port-8000` -> "the server on port 8000" (kernels/parity.py server_key), plus the rank."""
    key, rank = str(report.get("server", "")), report.get("rank", 0)
    what = (f"the server on port {key.removeprefix('port-')}" if key.startswith("port-") else
            "a headless node" if key == "headless" else "an offline engine (no API server)" if key == "offline"
            else "a server")
    return f"{what}, rank {rank}"


def _print_parity(reports: list, port: int | None) -> None:
    from ..kernels.parity import REPORT_ENV, report_dir

    if not reports:
        where = settings.lookup(REPORT_ENV) or report_dir()
        console.print(f"parity gate: no report{f' of a server on port {port}' if port is not None else ''} in "
                      f"{where} (each server writes its own when it loads a pack)", highlight=False)
        return
    # every report of the server asked for; else those of processes that still run, and a line for the rest
    shown = reports if port is not None else [r for r in reports if r.running is not False]
    for r in shown:
        report = r.report
        if report is None:
            console.print(f"parity gate: {r.path} cannot be read ({r.problem})", highlight=False, soft_wrap=True)
            continue
        try:
            line, checks = _parity_summary(report, r.running, r.path)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a file edited by hand, or half a copy
            console.print(f"parity gate: {r.path} is not a parity report ({type(e).__name__}: {e})",
                          highlight=False, soft_wrap=True)
            continue
        console.print(line, highlight=False, soft_wrap=True)
        console.print(checks if checks is not None else
                      "  no layer checked (the torch reference serves every layer type)")
    exited = [str(r.report.get("server")) for r in reports if r not in shown]
    if exited:
        console.print(f"parity gate: {len(exited)} more report(s) of processes that have exited "
                      f"({', '.join(exited[:8])}{', ...' if len(exited) > 8 else ''}); "
                      "`vllm-exl3 info --port N` shows one", highlight=False, soft_wrap=True)


def _parity_summary(report: dict, running: bool | None, path: str) -> tuple[str, Table | None]:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.get("time", 0)))
    state = {True: "running", False: "exited", None: "unknown"}[running]
    line = (f"parity gate of {_server_label(report)} (pid {report.get('pid')}, {state}; {when}, policy "
            f"{report.get('policy')}, {report.get('seconds', 0):.3f} s; {path}): "
            + ", ".join(f"{t} -> {b}" for t, b in report.get("served", {}).items()))
    if not report.get("checks"):
        return line, None
    t = Table(title=f"parity checks against the {report.get('reference')} reference")
    for col in ("layer", "layer type", "backend", "rel. error", "bound", "result", "s"):
        t.add_column(col)
    for c in report["checks"]:
        t.add_row(c["layer"], c["layer_type"], c["backend"], f"{c['error']:.2e}", f"{c['bound']:g}",
                  "[green]pass[/]" if c["passed"] else "[red]FAIL[/]", f"{c['seconds']:.3f}")
    return line, t

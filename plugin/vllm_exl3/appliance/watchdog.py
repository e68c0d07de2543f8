"""The memory watchdog (a supervisord program, standard library only): unified memory must never wedge the host.

On DGX Spark the GPU's allocations are the host's memory: a KV cache, a long prefill or another program that
takes the last few GiB does not fail with a CUDA out-of-memory error but drives the host into reclaim, swap and
the kernel's OOM killer, or freezes it. Every VLLM_EXL3_WATCHDOG_INTERVAL seconds (1) this program reads
MemAvailable (VLLM_EXL3_MEMINFO, /proc/meminfo) and memory pressure (VLLM_EXL3_PSI, /proc/pressure/memory):

- MemAvailable below VLLM_EXL3_MEM_SOFT_FLOOR_GIB, or the PSI `full avg10` at or above VLLM_EXL3_MEM_PSI_FULL_SOFT
  (percent of the last 10 s in which every task stalled on memory): state `soft`, readiness goes red
  (health.py reads the state file), logged once per episode;
- below VLLM_EXL3_MEM_HARD_FLOOR_GIB: state `hard`, vLLM is stopped as supervisord stops it (SIGTERM to its main
  process, which drains; SIGKILL to its process group after VLLM_EXL3_MEM_STOP_GRACE seconds; health.stop_vllm),
  once per vLLM process, before the OOM killer picks a victim itself. The
  exit-on-fatal listener restarts it with backoff; the launcher's memory plan refuses to start it while memory
  is still short, and repeated stops end the container (supervisor_listener.py).

Every tick it rewrites $VLLM_EXL3_STATE_DIR/memory-watchdog.json atomically (write a temporary file, rename):
{"time", "mem_available_bytes", "mem_total_bytes", "swap_used_bytes", "psi_some_avg10", "psi_full_avg10",
"state", "soft_floor_bytes", "hard_floor_bytes", "soft_events_total", "hard_stops_total"}; the metrics exporter
publishes it. The PSI fields are null where the kernel has no PSI.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..base import settings
from ..base.state import WATCHDOG_FILE, state_file
from ..format.jsonfile import write_json
from .health import stderr_log, stop_vllm, vllm_pid
from ..format.units import GIB
from . import meminfo as proc_meminfo


@dataclass(frozen=True)
class Sample:
    time: float
    mem_available: int
    mem_total: int
    swap_used: int
    psi_some_avg10: float | None
    psi_full_avg10: float | None


def read_meminfo(path: Path) -> tuple[int, int, int]:
    """(MemTotal, MemAvailable, swap in use) in bytes; ValueError naming the file when a field is missing."""
    fields = proc_meminfo.read_meminfo(path, ("MemTotal", "MemAvailable"))
    return fields["MemTotal"], fields["MemAvailable"], max(0, fields.get("SwapTotal", 0) - fields.get("SwapFree", 0))


def read_psi(path: Path) -> tuple[float | None, float | None]:
    """avg10 of the `some` and `full` lines of a PSI file; None where the file or the line is missing (no PSI)."""
    try:
        text = path.read_text()
    except OSError:
        return None, None
    found: dict[str, float] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key == "avg10":
                try:
                    found[kind] = float(value)
                except ValueError:
                    pass
    return found.get("some"), found.get("full")


class Watchdog:
    def __init__(self, soft_floor: int, hard_floor: int, psi_full_soft: float, stop: Callable[[int], None],
                 pid: Callable[[], int | None], log: Callable[[str], None]):
        if hard_floor > soft_floor:
            raise ValueError(f"the hard floor ({hard_floor} B) is above the soft floor ({soft_floor} B): "
                             "set VLLM_EXL3_MEM_HARD_FLOOR_GIB below VLLM_EXL3_MEM_SOFT_FLOOR_GIB")
        self.soft_floor, self.hard_floor, self.psi_full_soft = soft_floor, hard_floor, psi_full_soft
        self.stop, self.pid, self.log = stop, pid, log
        self.state = "ok"
        self.soft_events_total = 0
        self.hard_stops_total = 0
        self.stopped_pid: int | None = None

    def classify(self, s: Sample) -> str:
        if s.mem_available < self.hard_floor:
            return "hard"
        pressured = s.psi_full_avg10 is not None and s.psi_full_avg10 >= self.psi_full_soft
        return "soft" if s.mem_available < self.soft_floor or pressured else "ok"

    def tick(self, s: Sample) -> str:
        state = self.classify(s)
        figures = (f"MemAvailable {s.mem_available / GIB:.2f} GiB (soft floor {self.soft_floor / GIB:.2f}, hard "
                   f"{self.hard_floor / GIB:.2f}), PSI full avg10 {s.psi_full_avg10}, swap used "
                   f"{s.swap_used / GIB:.2f} GiB")
        if state != "ok" and self.state == "ok":
            self.soft_events_total += 1
            self.log(f"memory-watchdog: {state}: {figures}; readiness is red until memory recovers")
        elif state == "ok" and self.state != "ok":
            self.log(f"memory-watchdog: ok again: {figures}")
        if state == "hard":
            pid = self.pid()
            if pid is not None and pid != self.stopped_pid:
                self.stopped_pid = pid
                self.hard_stops_total += 1
                self.log(f"memory-watchdog: below the hard floor: stopping vLLM (pid {pid}) before the kernel's "
                         f"OOM killer acts; {figures}")
                self.stop(pid)
        self.state = state
        return state

    def document(self, s: Sample) -> dict:
        return {"time": s.time, "mem_available_bytes": s.mem_available, "mem_total_bytes": s.mem_total,
                "swap_used_bytes": s.swap_used, "psi_some_avg10": s.psi_some_avg10,
                "psi_full_avg10": s.psi_full_avg10, "state": self.state, "soft_floor_bytes": self.soft_floor,
                "hard_floor_bytes": self.hard_floor, "soft_events_total": self.soft_events_total,
                "hard_stops_total": self.hard_stops_total}


def run(env: Mapping[str, str], log: Callable[[str], None] = stderr_log, rounds: int | None = None,
        sleep: Callable[[float], None] = time.sleep) -> int:
    meminfo, psi = Path(settings.get("VLLM_EXL3_MEMINFO", env)), Path(settings.get("VLLM_EXL3_PSI", env))
    path = state_file(WATCHDOG_FILE, env)

    def stop(pid: int) -> None:  # in a thread: the watchdog keeps reporting while vLLM shuts down
        threading.Thread(target=stop_vllm, args=(pid, log, grace), daemon=True).start()

    try:
        interval = settings.get_float("VLLM_EXL3_WATCHDOG_INTERVAL", env)
        grace = settings.get_float("VLLM_EXL3_MEM_STOP_GRACE", env)
        dog = Watchdog(int(settings.get_float("VLLM_EXL3_MEM_SOFT_FLOOR_GIB", env) * GIB),
                       int(settings.get_float("VLLM_EXL3_MEM_HARD_FLOOR_GIB", env) * GIB),
                       settings.get_float("VLLM_EXL3_MEM_PSI_FULL_SOFT", env), stop, lambda: vllm_pid(env), log)
        read_meminfo(meminfo)
    except (OSError, ValueError) as e:
        log(f"memory-watchdog: cannot start: {e}")
        return 2
    psi_seen = read_psi(psi)[0] is not None
    log(f"memory-watchdog: watching {meminfo} and {psi if psi_seen else f'no PSI ({psi} unreadable)'} every "
        f"{interval:g}s; soft floor {dog.soft_floor / GIB:.2f} GiB, hard floor {dog.hard_floor / GIB:.2f} GiB; "
        f"state in {path}")
    while rounds is None or rounds > 0:
        rounds = None if rounds is None else rounds - 1
        try:
            total, available, swap = read_meminfo(meminfo)
        except (OSError, ValueError) as e:
            log(f"memory-watchdog: {e}")
            sleep(interval)
            continue
        sample = Sample(time.time(), available, total, swap, *read_psi(psi))
        dog.tick(sample)
        try:
            write_json(path, dog.document(sample), make_parent=True)
        except OSError as e:
            log(f"memory-watchdog: cannot write {path}: {e}")
        sleep(interval)
    return 0


if __name__ == "__main__":
    sys.exit(run(os.environ))

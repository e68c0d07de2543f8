"""GPU clocks, temperature and power from `nvidia-smi` (present on a GPU host; absent on CPU machines, where these
metrics simply do not exist). Host memory, pressure and swap come from the node exporter instead: on DGX Spark
the GPU shares host memory and NVML reports no framebuffer figures."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

QUERY = ("index", "name", "clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")
TIMEOUT_S = 3.0  # a scrape must not hang on a wedged driver
MHZ = 1e6


@dataclass(frozen=True)
class GpuReading:
    index: str
    name: str
    sm_clock_hertz: float | None
    memory_clock_hertz: float | None
    temperature_celsius: float | None
    power_watts: float | None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse(csv: str) -> list[GpuReading]:
    """`nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits` output, one GPU a line."""
    readings = []
    for line in csv.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(QUERY):
            continue
        index, name, sm, mem, temp, power = cells
        sm_hz, mem_hz = _number(sm), _number(mem)
        readings.append(GpuReading(index, name, sm_hz * MHZ if sm_hz is not None else None,
                                   mem_hz * MHZ if mem_hz is not None else None, _number(temp), _number(power)))
    return readings


def read_gpus() -> tuple[list[GpuReading], str | None]:
    """The readings, and why there are none (None when nvidia-smi answered)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi"
    try:
        r = subprocess.run([smi, f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi: {e}"
    if r.returncode != 0:
        return [], f"nvidia-smi exited with {r.returncode}: {r.stderr.strip()[:200]}"
    return parse(r.stdout), None

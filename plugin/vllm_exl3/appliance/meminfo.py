"""Linux's /proc/meminfo, read one way for the memory plan (memory_plan.py) and the memory watchdog (watchdog.py)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..format.units import KIB


def read_meminfo(path: str | Path, required: Iterable[str]) -> dict[str, int]:
    """Every `Name: value [kB]` line of a meminfo file, in bytes; ValueError naming the file when a required line
    is missing (a file that is not a meminfo file), OSError when it cannot be read."""
    fields: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * (KIB if parts[1:2] == ["kB"] else 1)
    missing = [k for k in required if k not in fields]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} line (not a Linux meminfo file?)")
    return fields

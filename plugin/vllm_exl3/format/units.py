"""Byte units and the one byte formatter (loader receipts, the memory plan, the CLI). No torch."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
GB = 1e9  # throughput is reported in GB/s (10^9 bytes), like disk vendors
MB = 1e6


def format_bytes(n: float, *, binary: bool = False, digits: int | None = None) -> str:
    """'1.23 GB' / '45.6 MB' (decimal, the loader's GB/s world) or, with `binary`, 'GiB' / 'MiB' (memory)."""
    big, small, names = (GIB, MIB, ("GiB", "MiB")) if binary else (GB, MB, ("GB", "MB"))
    if abs(n) >= big:
        return f"{n / big:.{2 if digits is None else digits}f} {names[0]}"
    return f"{n / small:.{1 if digits is None else digits}f} {names[1]}"

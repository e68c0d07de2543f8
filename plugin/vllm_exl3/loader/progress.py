"""The load receipt (`LoadStats`, `last_load_stats()`) and the progress bar / log line of a running load."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..format.units import GB, format_bytes

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # progress line interval when stderr is not a terminal


@dataclass(frozen=True)
class LoadStats:
    """The receipt of one finished load (read by the metrics code through `last_load_stats()`)."""

    bytes: int
    seconds: float
    workers: int
    chunk_bytes: int
    ring_bytes: int
    direct_io: bool  # O_DIRECT was used for every file
    files: int
    tensors: int
    wait_seconds: float  # time the consumer waited for reads; near `seconds` means the disk was the bottleneck
    device: str
    # time with no read in flight between the first read and the last: what the disk lost to copies, ring waits
    # and hand-offs (a raw read's is ~0). Near 0 with `wait_seconds` near `seconds`: the disk itself set the pace.
    idle_seconds: float = 0.0
    # bytes the kernel wrote straight into their destination tensors (host loads), not through a bounce slot
    inplace_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / GB / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": round(self.gbps, 3)}


_last_stats: LoadStats | None = None


def last_load_stats() -> LoadStats | None:
    """The receipt of the last load that completed in this process (None before the first)."""
    return _last_stats


def record_load_stats(stats: LoadStats) -> LoadStats:
    global _last_stats
    _last_stats = stats
    return stats


def _eta(done: int, total: int, elapsed: float) -> str:
    if done <= 0 or elapsed <= 0:
        return "?"
    return f"{(total - done) / (done / elapsed):.0f} s"


class ProgressReporter:
    """A progress bar when stderr is a terminal, otherwise a log line every `LOG_EVERY_S` (bytes, GB/s, ETA)."""

    def __init__(self, total_bytes: int, label: str = "loading weights", *, bar: bool | None = None,
                 log: logging.Logger = logger):
        self.total = total_bytes
        self.label = label
        self.log = log
        self.start = time.perf_counter()
        self.last_log = self.start
        self._bar = None
        if bar is None:
            bar = os.isatty(2)
        if bar:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                 transient=False)
            self._task = self._bar.add_task(label, total=total_bytes)
            self._bar.start()

    def update(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
            return
        now = time.perf_counter()
        if now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            elapsed = now - self.start
            self.log.info("%s: %s / %s (%.0f%%), %.2f GB/s, ETA %s", self.label, format_bytes(done),
                          format_bytes(self.total), 100 * done / max(self.total, 1), done / GB / elapsed,
                          _eta(done, self.total, elapsed))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

"""Cold-cache read throughput of a pack: raw reads (the disk's ceiling), `safetensors`, and our parallel reader.

Shared by `vllm-exl3 load-bench` (anyone can check their own disk) and `bench/loader.py` (the committed numbers).
Every loader measurement ends with each tensor copied into a destination buffer on the target device, which is
what vLLM's weight loaders do with it; without that, an mmap-based reader would be timed before it read anything.

Cold cache: before each measurement the files' pages are dropped with posix_fadvise(POSIX_FADV_DONTNEED), which
needs no root. It drops clean pages nobody maps; files written just before must be fsynced first (`write_and_sync`).

Pairs: a VM's virtual disk drifts between samples (1.15 to 1.99 GB/s for the same read minutes apart), so the
loader is measured back to back with raw reads of the same files (`paired_reader`) and judged by the median of
per-pair ratios, which cancels drift slower than one pair, rather than by a ratio of medians taken minutes apart.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..format.headers import SafetensorsFile, read_safetensors_header
from ..format.pack import Pack
from ..format.units import GB, MIB
from .buffers import AlignedBuffer
from .options import ReaderOptions
from .progress import last_load_stats
from .reader import read_tensors

RAW_BLOCK_BYTES = 16 * MIB  # like `dd bs=16M`


@dataclass(frozen=True)
class Measurement:
    method: str
    bytes: int
    seconds: float
    idle_seconds: float | None = None  # the loader's: time no read was in flight (LoadStats.idle_seconds)

    @property
    def gbps(self) -> float:
        return self.bytes / GB / self.seconds


def pack_files(path: str | os.PathLike) -> list[SafetensorsFile]:
    """The safetensors files of a model directory (index-aware, validated) or a single file."""
    path = Path(path)
    if path.is_file():
        return [read_safetensors_header(path)]
    return Pack.open(path).files


def drop_page_cache(paths: Sequence[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(method: str, paths: Sequence[Path], run: Callable[[], int], cold: bool) -> Measurement:
    if cold:
        drop_page_cache(paths)
    start = time.perf_counter()
    nbytes = run()
    return Measurement(method, nbytes, time.perf_counter() - start)


def raw_sequential(paths: Sequence[Path], cold: bool = True, fadvise: bool = False) -> Measurement:
    """One thread reading every file front to back in 16 MiB blocks through the page cache (`dd bs=16M`);
    `fadvise`: after posix_fadvise(SEQUENTIAL), which doubles the kernel's read-ahead window (2.9 vs 0.9 GB/s on
    the 2-core guest's virtio disk, where the host may also cache: see bench/notes/loader.md "Where the loader lost
    time")."""
    def run() -> int:
        buf = bytearray(RAW_BLOCK_BYTES)
        view = memoryview(buf)
        total = 0
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                if fadvise:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while n := f.readinto(view):
                    total += n
        return total

    return _timed("raw_sequential_fadvise" if fadvise else "raw_sequential", paths, run, cold)


def raw_parallel_direct(paths: Sequence[Path], workers: int, chunk_bytes: int = RAW_BLOCK_BYTES,
                        cold: bool = True) -> Measurement:
    """`workers` threads reading aligned chunks of every file with O_DIRECT into reused buffers and doing
    nothing else (`fio --rw=read --direct=1 --numjobs=N` style): what the device gives to parallel readers."""
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p), chunk_bytes)]
    lock = threading.Lock()
    total = [0]

    def worker():
        buffer = AlignedBuffer(chunk_bytes)  # held for the whole loop: the view points into it
        view = buffer.view
        fds: dict[Path, int] = {}
        got = 0
        try:
            while True:
                with lock:
                    if not jobs:
                        break
                    path, off = jobs.pop()
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                got += os.preadv(fds[path], [view], off)
        finally:
            for fd in fds.values():
                os.close(fd)
        with lock:
            total[0] += got

    def run() -> int:
        jobs.reverse()  # pop() from the end: files front to back
        threads = [threading.Thread(target=worker) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return total[0]

    return _timed(f"raw_parallel_direct_{workers}", paths, run, cold)


class _ParameterSink:
    """Copies each tensor into a destination on `device`, as vLLM's weight loaders copy into parameters."""

    def __init__(self, files: Sequence[SafetensorsFile], device: torch.device):
        largest = max((r.nbytes for f in files for r in f.tensors.values()), default=0)
        self.device = device
        self.buffer = torch.empty(max(largest, 1), dtype=torch.uint8, device=device)
        self.bytes = 0

    def __call__(self, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.reshape(-1)
        self.buffer[:flat.numel()].copy_(flat)
        self.bytes += flat.numel()

    def finish(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.bytes


def safetensors_default(files: Sequence[SafetensorsFile], device: torch.device, cold: bool = True) -> Measurement:
    """vLLM's default path: `safe_open(...).get_tensor` (mmap) for every tensor, then the copy to the parameter."""
    from safetensors import safe_open

    def run() -> int:
        sink = _ParameterSink(files, device)
        for f in files:
            with safe_open(str(f.path), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    sink(st.get_tensor(name))
        return sink.finish()

    return _timed("safetensors", [f.path for f in files], run, cold)


def parallel_reader(files: Sequence[SafetensorsFile], options: ReaderOptions, device: torch.device,
                    cold: bool = True) -> Measurement:
    def run() -> int:
        sink = _ParameterSink(files, device)
        for _, tensor in read_tensors(files, options, device=device):
            sink(tensor)
            del tensor
        return sink.finish()

    m = _timed(f"loader_{options.workers}", [f.path for f in files], run, cold)
    return dataclasses.replace(m, idle_seconds=last_load_stats().idle_seconds)


# The raw reads a pair holds, each one stream: through the page cache (`dd bs=16M`), the same with the
# sequential hint, and O_DIRECT. Which is fastest depends on the machine (plain dd beat O_DIRECT on the H200
# machine; hinted dd, then O_DIRECT lead on the 2-core guest), so all are measured and the run's fastest by
# median (`raw_method`) is the reference: not the best of each pair, which would pick lucky samples and bias every
# ratio down.
RAW_METHODS = ("raw_sequential", "raw_sequential_fadvise", "raw_direct_1")


def paired_reader(files: Sequence[SafetensorsFile], options: ReaderOptions, device: torch.device,
                  loader_first: bool = False) -> dict[str, float]:
    """Cold-cache GB/s of each raw read and of the loader, back to back on the same files (one pair). Callers
    alternate `loader_first` so that a drift within a pair does not always favour the same side."""
    paths = [f.path for f in files]
    if loader_first:
        loader = parallel_reader(files, options, device)
    raws = {"raw_sequential": raw_sequential(paths).gbps,
            "raw_sequential_fadvise": raw_sequential(paths, fadvise=True).gbps,
            "raw_direct_1": raw_parallel_direct(paths, 1).gbps}
    if not loader_first:
        loader = parallel_reader(files, options, device)
    return {**{k: round(v, 3) for k, v in raws.items()}, "loader": round(loader.gbps, 3),
            "loader_idle_s": round(loader.idle_seconds, 3)}


def raw_method(pairs: Sequence[dict[str, float]]) -> str:
    """The raw read with the higher median over all `pairs` of a run: the reference every ratio is taken against."""
    return max(RAW_METHODS, key=lambda m: statistics.median(p[m] for p in pairs))


def pair_ratio(pairs: Sequence[dict[str, float]], raw: str) -> float:
    """Median over `pairs` of loader / `raw` GB/s."""
    return statistics.median(p["loader"] / p[raw] for p in pairs)


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def limit_files(files: Sequence[SafetensorsFile], limit_bytes: int | None) -> list[SafetensorsFile]:
    """The first files (in order) that hold at least `limit_bytes`, so a 96 GB pack can be sampled."""
    if not limit_bytes:
        return list(files)
    chosen, total = [], 0
    for f in files:
        if total >= limit_bytes:
            break
        chosen.append(f)
        total += f.size
    return chosen


def load_bench(files: Sequence[SafetensorsFile], workers: Sequence[int], base: ReaderOptions, device: torch.device,
               with_safetensors: bool = False, repeats: int = 3) -> dict:
    """`vllm-exl3 load-bench`: cold-cache GB/s of raw reads and of our reader at each worker count, in pairs
    (raw reads, then the reader) repeated `repeats` times round the worker counts; medians, and the median of
    per-pair ratios reader / raw (`loader_vs_raw`)."""
    pairs: dict[str, list[dict[str, float]]] = {str(w): [] for w in workers}
    safetensors = []
    for r in range(repeats):
        for w in workers:
            pairs[str(w)].append(paired_reader(files, dataclasses.replace(base, workers=w), device, r % 2 == 1))
        if with_safetensors:
            safetensors.append(safetensors_default(files, device).gbps)
    every = [p for per in pairs.values() for p in per]
    raw = raw_method(every)
    result = {"bytes": sum(r.nbytes for f in files for r in f.tensors.values()), "files": len(files),
              "device": str(device), "chunk_mib": base.chunk_bytes // MIB, "ring_mib": base.ring_bytes // MIB,
              "direct_io": base.direct_io, "repeats": repeats, "raw_method": raw,
              "raw_gbps": _median(p[raw] for p in every),
              **{f"{m}_gbps": _median(p[m] for p in every) for m in RAW_METHODS},
              "loader_gbps": {w: _median(p["loader"] for p in per) for w, per in pairs.items()},
              "loader_vs_raw": {w: round(pair_ratio(per, raw), 3) for w, per in pairs.items()},
              "pairs": pairs}
    if with_safetensors:
        result["safetensors_gbps"] = _median(safetensors)
    return result


def _median(values) -> float:
    return round(statistics.median(values), 3)

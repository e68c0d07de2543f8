"""Cold-cache read throughput of a pack: raw reads (the disk's ceiling), `safetensors`, and our parallel reader.

Shared by `vllm-exl3 load-bench` (anyone can check their own disk) and `bench/loader.py` (the committed numbers).
Every loader measurement ends with each tensor copied into a destination buffer on the target device, which is
what vLLM's weight loaders do with it; without that, an mmap-based reader would be timed before it read anything.

Cold cache: before each measurement the files' pages are dropped with posix_fadvise(POSIX_FADV_DONTNEED), which
needs no root. It drops clean pages nobody maps; files written just before must be fsynced first (`write_and_sync`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .format import Pack, SafetensorsFile, read_safetensors_header
from .loader import GB, MIB, AlignedBuffer, ReaderOptions, read_tensors

RAW_BLOCK_BYTES = 16 * MIB  # like `dd bs=16M`


@dataclass(frozen=True)
class Measurement:
    method: str
    bytes: int
    seconds: float

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


def raw_sequential(paths: Sequence[Path], cold: bool = True) -> Measurement:
    """One thread reading every file front to back in 16 MiB blocks through the page cache (`dd bs=16M`)."""
    def run() -> int:
        buf = bytearray(RAW_BLOCK_BYTES)
        view = memoryview(buf)
        total = 0
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
        return total

    return _timed("raw_sequential", paths, run, cold)


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

    return _timed(f"loader_{options.workers}", [f.path for f in files], run, cold)


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
               with_safetensors: bool = False) -> dict:
    """`vllm-exl3 load-bench`: cold-cache GB/s of a raw sequential read and of our reader at each worker count."""
    paths = [f.path for f in files]
    result = {"bytes": sum(r.nbytes for f in files for r in f.tensors.values()), "files": len(files),
              "device": str(device), "chunk_mib": base.chunk_bytes // MIB, "ring_mib": base.ring_bytes // MIB,
              "direct_io": base.direct_io, "raw_gbps": round(raw_sequential(paths).gbps, 3), "loader_gbps": {}}
    for w in workers:
        options = dataclasses.replace(base, workers=w)
        result["loader_gbps"][str(w)] = round(parallel_reader(files, options, device).gbps, 3)
    if with_safetensors:
        result["safetensors_gbps"] = round(safetensors_default(files, device).gbps, 3)
    return result

"""Parallel safetensors reader: N threads `pread` large aligned chunks; whole tensors come out in file order.

Why not mmap: on DGX Spark (unified memory) mmap-backed loading is several times slower than explicit reads, and
many small pageable host->device copies are ~50x slower than pinned ones (docs/vllm-notes.md §4.1). So:

* a *plan* (plan.py) cuts every file into chunks: consecutive small tensors share one chunk, a tensor larger
  than a chunk gets several. Chunk boundaries are aligned, so the same plan works with O_DIRECT.
* N worker threads claim chunks in plan order. To a GPU: each chunk is read into the worker's pinned bounce slot,
  then copied to the destination tensors on the worker's stream (a DMA). To host memory: one scatter read
  (`preadv`) per chunk puts the bytes of every large tensor straight into its destination, whose address is
  allocated in the same phase as its file offset modulo `ALIGN` (so O_DIRECT can write there); only the blocks a
  tensor shares with its neighbours, and small tensors, pass through the bounce slot and a memcpy.
* The caller gets each tensor once all its bytes have landed, in file order then offset order, whatever order the
  reads finished in.
* Read-ahead is bounded: destination tensors not yet handed out never exceed `ring_bytes`, plus at most one
  tensor larger than the ring (held outside it, so reading goes on around it while the consumer copies it out).
  Memory is workers x chunk (pinned on CUDA) plus the ring and the largest tensor on the target device, plus on
  the host up to a ring of released destinations kept for reuse: bounded by the options and one tensor, not the
  model.

Every header is validated before the first byte of tensor data is read, so a truncated file fails before anything
is loaded. A failure later (a short read, an I/O error) stops every worker and raises `PackReadError`, naming the
file, the offset and the tensor, in the caller.

Over 400 lines on purpose: `ParallelRead` is one protocol (one lock, two conditions) between the workers, the ring
and the consumer, and its parts share that state; the plan, the options, the buffers, the files and the progress
report are modules of their own (plan.py, options.py, buffers.py, files.py, progress.py).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from ..format.geometry import ceil_to
from ..format.headers import SafetensorsFile, TensorRecord, read_safetensors_header
from ..format.tensors import TORCH_DTYPES
from ..format.units import format_bytes
from .files import OpenFile, PackReadError
from .buffers import HUGE_PAGE, AlignedBuffer, RecycledHostBuffers, advise_huge_pages
from .options import ReaderOptions
from .plan import ALIGN, Chunk, ReadPlan, plan_reads
from .progress import LoadStats, ProgressReporter, record_load_stats

logger = logging.getLogger(__name__)

# Host destinations of at least this many bytes are read in place (no bounce copy). Each costs up to ALIGN bytes
# of over-allocation (<= 3 % at this size) to put its address in phase with its file offset; smaller tensors go
# through the bounce slot, where a copy costs less than the over-allocation and the extra iovecs.
INPLACE_MIN_BYTES = 128 * 1024
# iovecs per scatter read: Linux refuses more than IOV_MAX (1024); the rest of a chunk goes through the slot.
MAX_IOVECS = 512


# ------------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------------
def read_into(fd: int, buffers, offset: int) -> int:
    """One positional read into `buffers`, a writable buffer or a list of them filled in order (a scatter read:
    the seam tests use to inject faults). Releases the GIL."""
    return os.preadv(fd, buffers if isinstance(buffers, list) else [buffers], offset)


def _views(segments: list[tuple[int, int, int]], start: int) -> list:
    """Writable buffers for the bytes of `segments` ((first, end, address): chunk-relative byte ranges in order,
    and where each lands) from chunk-relative byte `start` on."""
    out = []
    for first, end, address in segments:
        skip = max(start - first, 0)
        if end - first > skip:
            out.append((ctypes.c_char * (end - first - skip)).from_address(address + skip))
    return out


class _Aborted(Exception):
    """Another worker failed or the consumer stopped: this worker stops without reporting."""


class ParallelRead:
    """One load in progress. Iterate it once for `(name, tensor)` pairs; see the module docstring."""

    def __init__(self, plan: ReadPlan, options: ReaderOptions, device: torch.device | str | None = None,
                 progress: ProgressReporter | None = None):
        self.plan = plan
        self.options = options
        self.device = torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.progress = progress
        # One lock, two conditions, and notifications only to whoever can now proceed: with tens of thousands of
        # tensors, waking every worker on every event costs more than the reads (16 workers ran at half speed).
        self._lock = threading.Lock()
        self._tensor_done = threading.Condition(self._lock)  # the consumer waits here for `_wanted`
        self._ring_space = threading.Condition(self._lock)  # workers wait here to admit the next tensor
        self._wanted = -1  # the tensor the consumer is waiting for
        self._space_waiters = 0
        self._next_chunk = 0
        self._admitted = 0  # tensors [0, _admitted) have destinations
        self._outstanding = 0  # bytes of ring-sized destinations not yet released by the consumer
        # Bytes of the one tensor larger than the ring that may be outstanding besides it (0: none). Admitting such a
        # tensor only into an empty ring drained the pipeline twice per tensor: the disk idled while the consumer
        # caught up before it, then while it copied the tensor out (0.28 s of a 2.1 s load, 2 GB pack, CPU).
        self._oversized = 0
        self._remaining = [t.nbytes for t in plan.tensors]
        self._dest: list[torch.Tensor | None] = [None] * len(plan.tensors)
        self._error: BaseException | None = None
        self._stopped = False
        self._reading = 0  # reads in flight, for `idle_seconds`
        self._idle_since: float | None = None  # None before the first read
        self._idle = 0.0
        self._files: list[OpenFile] = []
        self._threads: list[threading.Thread] = []
        # On CUDA, destinations are allocated on the consumer's stream, and every worker stream waits for it before
        # writing: a block the consumer freed may still be read by its queued copies into the parameters.
        self._consumer_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._recycled = RecycledHostBuffers(options.ring_bytes) if self._consumer_stream is None else None
        # host tensors read in place: large enough, and at an element-aligned offset (the phased address inherits
        # the offset's alignment; a view as a wider dtype needs it)
        self._inplace = [self._recycled is not None and t.nbytes >= INPLACE_MIN_BYTES
                         and t.offset % TORCH_DTYPES[t.dtype].itemsize == 0
                         for t in plan.tensors]
        self._inplace_bytes = 0

    # -- the consumer side ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        waited = 0.0
        done = 0
        try:
            identities = self.plan.identities or [None] * len(self.plan.files)
            for path, identity in zip(self.plan.files, identities):  # one by one: _stop closes the opened ones
                self._files.append(OpenFile(path, self.options.direct_io, identity))
            # the last tensor of each file: its bytes are the file's last to land (tensors come in file order)
            last_of_file = {}
            for index, rec in enumerate(self.plan.tensors):
                last_of_file[rec.file] = index
            checks = {index: file for file, index in last_of_file.items()}
            for w in range(min(self.options.workers, len(self.plan.chunks))):
                thread = threading.Thread(target=self._work, name=f"exl3-loader-{w}", daemon=True)
                thread.start()
                self._threads.append(thread)
            for index, rec in enumerate(self.plan.tensors):
                wait_start = time.perf_counter()
                with self._lock:
                    if index:
                        self._release(index - 1)
                    self._wanted = index
                    while self._error is None and not self._complete(index):
                        self._tensor_done.wait()
                    self._wanted = -1
                    if self._error is not None:
                        raise self._error
                    dest = self._dest[index]
                if index in checks:
                    self._files[self.plan.files.index(checks[index])].check_unchanged("after reading it")
                waited += time.perf_counter() - wait_start
                tensor = self._as_tensor(dest, rec)
                done += rec.nbytes
                if self.progress is not None:
                    self.progress.update(done)
                yield rec.name, tensor
                del tensor, dest
            seconds = time.perf_counter() - start
            stats = record_load_stats(LoadStats(done, seconds, self.options.workers, self.options.chunk_bytes,
                                    self.options.ring_bytes, all(f.direct for f in self._files), len(self.plan.files),
                                    len(self.plan.tensors), waited, str(self.device), self._idle,
                                    self._inplace_bytes))
            logger.info("loaded %s (%d tensors, %d files) in %.2f s: %.2f GB/s with %d workers%s",
                        format_bytes(done), len(self.plan.tensors), len(self.plan.files), seconds, stats.gbps,
                        self.options.workers, ", O_DIRECT" if stats.direct_io else "")
        finally:
            self._stop()

    def _complete(self, index: int) -> bool:
        if self._remaining[index]:
            return False
        return self.plan.tensors[index].nbytes == 0 or self._dest[index] is not None

    def _as_tensor(self, dest: torch.Tensor | None, rec: TensorRecord) -> torch.Tensor:
        dtype = TORCH_DTYPES[rec.dtype]
        if dest is None:  # a tensor with no bytes
            return torch.empty(rec.storage_shape, dtype=dtype, device=self.device)
        return dest.view(dtype).reshape(rec.storage_shape)

    def _release(self, index: int) -> None:
        if self._dest[index] is not None:
            if self._recycled is not None:
                self._recycled.put(self._dest[index])
            self._dest[index] = None
            nbytes = self.plan.tensors[index].nbytes
            if nbytes > self.options.ring_bytes:
                self._oversized = 0
            else:
                self._outstanding -= nbytes
            if self._space_waiters and self._head_fits():
                self._ring_space.notify_all()

    def _head_fits(self) -> bool:
        """Whether the next tensor to admit fits now: in the ring, or, larger than the ring, as the one oversized."""
        if self._admitted >= len(self.plan.tensors):
            return False
        nbytes = self.plan.tensors[self._admitted].nbytes
        if nbytes > self.options.ring_bytes:
            return not self._oversized
        return self._outstanding + nbytes <= self.options.ring_bytes

    def _wake_everyone(self) -> None:
        self._tensor_done.notify_all()
        self._ring_space.notify_all()

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake_everyone()
        for thread in self._threads:
            thread.join()
        for f in self._files:
            f.close()
        self._files = []
        self._dest = [None] * len(self.plan.tensors)
        self._recycled = None  # give the pooled host memory back now, not when the reader object dies
        if self.progress is not None:
            self.progress.close()

    # -- the worker side --------------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread; allocations follow it
            slot = AlignedBuffer(self.options.chunk_bytes, pinned=cuda)
            stream = torch.cuda.Stream(self.device) if cuda else None
            while True:
                with self._lock:
                    if self._stopped or self._error is not None or self._next_chunk >= len(self.plan.chunks):
                        return
                    chunk = self.plan.chunks[self._next_chunk]
                    self._next_chunk += 1
                self._admit_through(chunk.last_tensor)
                if stream is None:  # host: large tensors' bytes straight into their destinations
                    segments, copies, inplace = self._host_layout(chunk, slot)
                else:  # GPU: the whole chunk into the pinned slot, then DMA
                    segments, copies, inplace = [(0, chunk.length, slot.tensor.data_ptr())], None, 0
                self._reading_starts()
                try:
                    self._read(chunk, segments)
                finally:
                    self._reading_ends()
                if stream is None:
                    for dest, source, nbytes in copies:
                        ctypes.memmove(dest, source, nbytes)  # GIL released
                else:
                    self._scatter(chunk, slot, stream)
                with self._lock:
                    self._inplace_bytes += inplace
                    for piece in chunk.pieces:
                        self._remaining[piece.tensor] -= piece.nbytes
                        if piece.tensor == self._wanted and not self._remaining[piece.tensor]:
                            self._tensor_done.notify()
                self._drop_from_page_cache(chunk)
        except _Aborted:
            return
        except BaseException as e:  # noqa: BLE001 - any failure must reach the consumer, not die with the thread
            with self._lock:
                if self._error is None:
                    self._error = e
                self._wake_everyone()

    def _admit_through(self, last: int) -> None:
        """Allocate destinations, in tensor order, up to `last`, waiting while the ring is full."""
        with self._lock:
            while self._admitted <= last:
                if self._stopped or self._error is not None:
                    raise _Aborted
                if not self._head_fits():
                    self._space_waiters += 1
                    self._ring_space.wait()  # another worker may admit the head meanwhile: look again
                    self._space_waiters -= 1
                    continue
                index = self._admitted
                nbytes = self.plan.tensors[index].nbytes
                if nbytes:
                    phase = self.plan.tensors[index].offset if self._inplace[index] else None
                    self._dest[index] = self._allocate(nbytes, phase)
                    if nbytes > self.options.ring_bytes:
                        self._oversized = nbytes
                    else:
                        self._outstanding += nbytes
                self._admitted += 1
            if self._space_waiters and self._head_fits():
                self._ring_space.notify_all()  # room left for tensors other workers wait to admit

    def _allocate(self, nbytes: int, phase: int | None = None) -> torch.Tensor:
        """A destination of `nbytes`; on the host with `phase` (a file offset), one whose address is congruent to
        it modulo ALIGN, so that the aligned blocks of the file map to aligned addresses of the tensor."""
        if self._consumer_stream is None:
            size = nbytes if phase is None else nbytes + ALIGN
            buffer = self._recycled.take(size)
            if buffer is None:
                buffer = torch.empty(size, dtype=torch.uint8)
                if size >= 2 * HUGE_PAGE:
                    advise_huge_pages(buffer)
            if phase is None:
                return buffer
            skip = (phase - buffer.data_ptr()) % ALIGN
            return buffer[skip:skip + nbytes]
        with torch.cuda.stream(self._consumer_stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _reading_starts(self) -> None:
        with self._lock:
            if not self._reading and self._idle_since is not None:
                self._idle += time.perf_counter() - self._idle_since
            self._reading += 1

    def _reading_ends(self) -> None:
        with self._lock:
            self._reading -= 1
            if not self._reading:
                self._idle_since = time.perf_counter()

    def _host_layout(self, chunk: Chunk, slot: AlignedBuffer) -> tuple[list[tuple[int, int, int]],
                                                                        list[tuple[int, int, int]], int]:
        """Where each byte of `chunk` lands on the host: `segments` ((first, end, address) covering the chunk in
        order) for the scatter read, then `copies` ((to, from, nbytes), from the slot) and the bytes read in place.

        An in-place tensor receives the aligned blocks of its piece directly (its address is phased like its file
        offset, so those blocks are aligned in memory too: O_DIRECT accepts them). The rest of the chunk (blocks
        shared with a neighbour, small tensors, gaps) lands in the slot at its chunk-relative offset; from there a
        tensor's head and tail, and each small tensor whole, are copied out after the read."""
        base = slot.tensor.data_ptr()
        pieces = chunk.pieces
        overlapping = any(a.chunk_offset + a.nbytes > b.chunk_offset for a, b in zip(pieces, pieces[1:]))
        segments, copies = [], []
        pos = inplace = 0  # chunk-relative: the bytes before `pos` have a segment
        for p in pieces:
            address = self._dest[p.tensor].data_ptr() + p.tensor_offset  # of the piece's first byte
            lo, hi = ceil_to(p.chunk_offset, ALIGN), (p.chunk_offset + p.nbytes) // ALIGN * ALIGN
            if self._inplace[p.tensor] and not overlapping and hi > lo and len(segments) + 2 < MAX_IOVECS:
                if lo > pos:
                    segments.append((pos, lo, base + pos))
                segments.append((lo, hi, address + lo - p.chunk_offset))
                pos = hi
                inplace += hi - lo
                if lo > p.chunk_offset:
                    copies.append((address, base + p.chunk_offset, lo - p.chunk_offset))
                if p.chunk_offset + p.nbytes > hi:
                    copies.append((address + hi - p.chunk_offset, base + hi, p.chunk_offset + p.nbytes - hi))
            else:
                copies.append((address, base + p.chunk_offset, p.nbytes))
        if pos < chunk.length:
            segments.append((pos, chunk.length, base + pos))
        return segments, copies, inplace

    def _read(self, chunk: Chunk, segments: list[tuple[int, int, int]]) -> None:
        """Read the chunk's bytes (at least `needed`) into `segments`, resuming after short reads."""
        f = self._files[chunk.file]
        got = 0
        while got < chunk.needed:
            fd, direct = f.handle
            offset = chunk.offset + got
            try:
                n = read_into(fd, _views(segments, got), offset)
            except OSError as e:
                if direct and e.errno == errno.EINVAL and got == 0:
                    f.fall_back_to_buffered(fd)
                    continue
                raise self._read_error(chunk, offset, f"{type(e).__name__}: {e}") from e
            if n <= 0:
                raise self._read_error(chunk, offset, self._end_of_file(fd))
            got += n
            if direct and n % ALIGN and got < chunk.needed:
                # O_DIRECT returns a non-block-multiple count only at end of file
                raise self._read_error(chunk, chunk.offset + got, self._end_of_file(fd))

    def _end_of_file(self, fd: int) -> str:
        return (f"end of file: the file is now {os.fstat(fd).st_size} bytes, not the size its header promised "
                "(truncated or replaced while loading)")

    def _read_error(self, chunk: Chunk, offset: int, found: str) -> PackReadError:
        # name the tensor whose bytes were being read at `offset`
        rel = offset - chunk.offset
        piece = next((p for p in chunk.pieces if p.chunk_offset + p.nbytes > rel), chunk.pieces[-1])
        rec = self.plan.tensors[piece.tensor]
        return PackReadError(self.plan.files[chunk.file], offset, rec.name,
                             f"{chunk.needed - rel} readable bytes", found)

    def _scatter(self, chunk: Chunk, slot: AlignedBuffer, stream) -> None:
        """GPU destinations: the chunk's bytes from the pinned slot, on the worker's stream."""
        with torch.cuda.stream(stream):
            stream.wait_stream(self._consumer_stream)
            for p in chunk.pieces:
                dest = self._dest[p.tensor]
                dest[p.tensor_offset:p.tensor_offset + p.nbytes].copy_(
                    slot.tensor[p.chunk_offset:p.chunk_offset + p.nbytes], non_blocking=True)
        stream.synchronize()  # the slot is reused for the next read; the tensor is complete once this returns

    def _drop_from_page_cache(self, chunk: Chunk) -> None:
        f = self._files[chunk.file]
        if self.options.drop_page_cache and not f.direct and hasattr(os, "posix_fadvise"):
            # on unified memory the page cache competes with the GPU for the same DRAM
            os.posix_fadvise(f.fd, chunk.offset, chunk.length, os.POSIX_FADV_DONTNEED)


# ------------------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------------------
def read_tensors(files: Iterable[SafetensorsFile | str | os.PathLike], options: ReaderOptions | None = None, *,
                 keep: Callable[[str], bool] | None = None, device: torch.device | str | None = None,
                 progress: bool | ProgressReporter | None = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for every tensor of `files` (paths or parsed headers), in file order then offset order.

    Tensors land on `device` (CPU by default). Each yielded tensor owns its memory; the reader drops its own
    reference when the next one is requested. `progress=True` reports through a bar or log lines.
    """
    options = options or ReaderOptions()
    headers = [f if isinstance(f, SafetensorsFile) else read_safetensors_header(f) for f in files]
    plan = plan_reads(headers, options.chunk_bytes, keep)
    if progress is True:
        progress = ProgressReporter(plan.nbytes)
    return iter(ParallelRead(plan, options, device, progress or None))

"""Host memory for the reader: aligned bounce buffers, recycled destinations, huge-page advice."""

from __future__ import annotations

import ctypes
import os

import torch

from ..format.geometry import ceil_to
from ..format.units import MIB
from .plan import ALIGN

# Fresh host destinations of at least two huge pages are advised MADV_HUGEPAGE (the 2 MiB-aligned part of them) before
# their first byte is written: the page faults of 4 KiB pages, not the reads, capped a hot-cache load on the 2-core
# guest at ~4.8 GB/s (14 GB/s with huge pages; bench/notes/loader.md "Host destinations read in place"). A hint: ignored
# where THP is off.
HUGE_PAGE = 2 * MIB
_MADV_HUGEPAGE = 14  # Linux
_madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None) if os.name == "posix" else None




def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Ask for transparent huge pages under the 2 MiB-aligned interior of a host buffer not yet touched."""
    start = ceil_to(buffer.data_ptr(), HUGE_PAGE)
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // HUGE_PAGE * HUGE_PAGE
    if _madvise is None or end <= start or not os.uname().sysname == "Linux":
        return False
    return _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


class AlignedBuffer:
    """An `ALIGN`-aligned read buffer, as a tensor and as a writable memoryview for `os.preadv` (O_DIRECT needs the
    alignment). Each worker owns one; it is pinned when the destination is a GPU, so the H2D copy is a DMA."""

    def __init__(self, nbytes: int, pinned: bool = False):
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
        skip = -raw.data_ptr() % ALIGN
        self.tensor = raw[skip:skip + nbytes]
        # `self.tensor` keeps the storage alive as long as this object, and the view never outlives it
        self.view = memoryview((ctypes.c_char * nbytes).from_address(self.tensor.data_ptr())).cast("B")


class RecycledHostBuffers:
    """Host destinations the consumer has let go of, handed out again for tensors of the same size.

    Fresh host memory costs a page fault per 4 KiB on first touch, which caps one thread at a few GB/s (2.5 GB/s
    measured on a KVM guest), below a fast NVMe. A buffer is reused only when nothing outside this pool still
    references its storage: a consumer that keeps a tensor keeps its memory, and the buffer leaves the pool.
    Expert tensors of one layer share a size, so most bytes of a MoE checkpoint are recycled. GPU destinations
    need none of this: PyTorch's caching allocator already reuses device memory.
    """

    CHECKS_PER_TAKE = 4  # oldest entries first; a still-referenced one is dropped, the scan stays O(1)

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.bytes = 0
        self._by_size: dict[int, list[torch.Tensor]] = {}
        use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; without it, no recycling
        self._use_count = (lambda t: use_count(t.untyped_storage()._cdata)) if use_count else None
        self._unreferenced = self._use_count(torch.empty(1, dtype=torch.uint8)) if use_count else None

    def put(self, buffer: torch.Tensor) -> None:
        if buffer._base is not None:  # an ALIGN-phased view: pool the whole allocation
            buffer = buffer._base
        if self._use_count is not None and self.bytes + buffer.numel() <= self.capacity:
            self._by_size.setdefault(buffer.numel(), []).append(buffer)
            self.bytes += buffer.numel()

    def take(self, nbytes: int) -> torch.Tensor | None:
        same_size = self._by_size.get(nbytes)
        for _ in range(min(self.CHECKS_PER_TAKE, len(same_size or ()))):
            buffer = same_size.pop(0)
            self.bytes -= nbytes
            if self._use_count(buffer) <= self._unreferenced:
                return buffer
        return None

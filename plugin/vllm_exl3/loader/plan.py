"""The read plan: which aligned byte ranges of which file each read fetches, and where each byte lands.

Pure planning from validated headers (no I/O, no threads), so the reader (reader.py) only executes it. Tensors are
ordered by file, then offset; that order is the order tensors are handed to vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..format.errors import Exl3FormatError
from ..format.geometry import ceil_to
from ..format.headers import FileIdentity, SafetensorsFile, TensorRecord
from ..format.tensors import TORCH_DTYPES

# O_DIRECT needs file offset, length and buffer address aligned to the device's logical block size. 4096 covers
# both 512-byte and 4K-native devices, so chunk boundaries and bounce slots use it everywhere.
ALIGN = 4096


@dataclass(frozen=True)
class Piece:
    """Bytes of one tensor inside one chunk."""

    tensor: int  # index into ReadPlan.tensors
    chunk_offset: int
    tensor_offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """One aligned read: `length` bytes at `offset` of `ReadPlan.files[file]`; the first `needed` must exist."""

    file: int
    offset: int
    length: int
    needed: int
    pieces: tuple[Piece, ...]
    last_tensor: int  # tensors up to this index must have destinations before the chunk is read


@dataclass
class ReadPlan:
    files: list[Path]
    tensors: list[TensorRecord]
    chunks: list[Chunk]
    identities: list[FileIdentity | None] = field(default_factory=list)  # of each file when its header was read

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _align_down(n: int) -> int:
    return n - n % ALIGN


def _align_up(n: int) -> int:
    return ceil_to(n, ALIGN)


def plan_reads(files: Iterable[SafetensorsFile], chunk_bytes: int,
               keep: Callable[[str], bool] | None = None) -> ReadPlan:
    """Order tensors (file order, then offset) and cut their bytes into aligned chunks of at most `chunk_bytes`.

    Consecutive tensors whose aligned span fits one chunk share it (one read for many small tensors, reading over
    the few bytes between them); a larger tensor gets chunks of its own. `keep(name)` False skips a tensor unread.
    """
    files = list(files)
    plan = ReadPlan([f.path for f in files], [], [], [f.identity for f in files])
    for file_index, sf in enumerate(files):
        records = sorted((r for r in sf.tensors.values() if keep is None or keep(r.name)),
                         key=lambda r: (r.offset, r.name))
        for rec in records:  # fail in planning, not after gigabytes were read
            try:
                TORCH_DTYPES[rec.dtype]
            except KeyError:
                raise Exl3FormatError(sf.path, rec.name, "a dtype torch can hold", rec.dtype) from None
        i = 0
        while i < len(records):
            first = records[i]
            start = _align_down(first.offset)
            if _align_up(first.offset + first.nbytes) - start > chunk_bytes:
                plan.tensors.append(first)
                plan.chunks.extend(_split_large(file_index, len(plan.tensors) - 1, first, chunk_bytes))
                i += 1
                continue
            group_end = i + 1
            while (group_end < len(records)
                   and _align_up(records[group_end].offset + records[group_end].nbytes) - start <= chunk_bytes):
                group_end += 1
            pieces = []
            for rec in records[i:group_end]:
                plan.tensors.append(rec)
                if rec.nbytes:
                    pieces.append(Piece(len(plan.tensors) - 1, rec.offset - start, 0, rec.nbytes))
            if pieces:
                end = max(p.chunk_offset + p.nbytes for p in pieces)
                plan.chunks.append(Chunk(file_index, start, _align_up(end), end, tuple(pieces),
                                         len(plan.tensors) - 1))
            i = group_end
    return plan


def _split_large(file_index: int, tensor_index: int, rec: TensorRecord, chunk_bytes: int) -> Iterator[Chunk]:
    end = rec.offset + rec.nbytes
    pos = _align_down(rec.offset)
    while pos < end:
        chunk_end = min(pos + chunk_bytes, _align_up(end))
        lo, hi = max(pos, rec.offset), min(chunk_end, end)
        yield Chunk(file_index, pos, chunk_end - pos, hi - pos, (Piece(tensor_index, lo - pos, lo - rec.offset, hi - lo),),
                    tensor_index)
        pos = chunk_end

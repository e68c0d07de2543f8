"""safetensors headers: parse and validate one file's header without touching tensor data, and the one writer of a
safetensors file (`write_safetensors`: the pack tools' shards, `dequant`'s output). Header-only: no torch."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .errors import Exl3FormatError
from .strict import expect_type, loads, open_regular


@dataclass(frozen=True)
class Dtype:
    """One safetensors dtype: bits per element and the torch dtype that holds it (`per_item` elements per torch
    item: F4 packs two per byte, as torch's float4_e2m1fn_x2)."""

    bits: int
    torch_name: str
    per_item: int = 1


# THE dtype table: header validation, `verify`, the loader's planner and torch conversion all read this one.
DTYPES = {
    "BOOL": Dtype(8, "bool"), "U8": Dtype(8, "uint8"), "I8": Dtype(8, "int8"),
    "F8_E4M3": Dtype(8, "float8_e4m3fn"), "F8_E5M2": Dtype(8, "float8_e5m2"), "F8_E8M0": Dtype(8, "float8_e8m0fnu"),
    "F4": Dtype(4, "float4_e2m1fn_x2", 2),
    "I16": Dtype(16, "int16"), "U16": Dtype(16, "uint16"), "F16": Dtype(16, "float16"), "BF16": Dtype(16, "bfloat16"),
    "I32": Dtype(32, "int32"), "U32": Dtype(32, "uint32"), "F32": Dtype(32, "float32"),
    "I64": Dtype(64, "int64"), "U64": Dtype(64, "uint64"), "F64": Dtype(64, "float64"),
}
# A header larger than this is not a real safetensors header (the reference implementation caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes live. `offset` is absolute within `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The shape of the torch tensor that holds it (F4: the last dim halved, two elements per byte)."""
        per = DTYPES[self.dtype].per_item
        return self.shape if per == 1 else (*self.shape[:-1], self.shape[-1] // per)


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one version of a file: a rewrite in place changes the size or mtime, a replace the inode."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class SafetensorsFile:
    path: Path
    tensors: dict[str, TensorRecord]
    metadata: dict[str, str]
    data_start: int
    size: int
    identity: FileIdentity | None = None  # when the header was read


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor; None when the elements do not fill whole bytes (F4 with an odd last dim)."""
    spec = DTYPES[dtype]
    if spec.per_item > 1 and (not shape or shape[-1] % spec.per_item):
        return None
    return math.prod(shape) * spec.bits // 8


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsFile:
    """Parse and validate one safetensors header without touching tensor data.

    Refuses what the reference reader refuses: a non-regular file, a header that is not a JSON object without
    repeated keys, an unknown dtype, a byte range that does not match its shape, tensors whose byte ranges overlap
    (aliasing) or leave holes, bytes after the last tensor, an empty name, metadata that is not strings; and a
    file too short for its tensors (a truncated download fails here, not mid-load).
    """
    path = Path(path)
    try:
        fd = open_regular(path, "a regular safetensors file")
    except FileNotFoundError as e:
        raise Exl3FormatError(path, None, "a readable safetensors file", f"{type(e).__name__}: {e}") from e
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise Exl3FormatError(path, None, "an 8-byte safetensors header length", f"a {size}-byte file")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES or header_len > size - 8:
                raise Exl3FormatError(path, None, f"a header length <= {min(MAX_HEADER_BYTES, size - 8)} bytes",
                                      f"{header_len} (truncated or not a safetensors file)")
            raw = f.read(header_len)
    except OSError as e:
        raise Exl3FormatError(path, None, "a readable safetensors file", f"{type(e).__name__}: {e}") from e
    header = expect_type(loads(raw, path, "a JSON safetensors header", "header", keys_are_tensors=True), dict, path, "a JSON object as header")

    data_start = 8 + header_len
    data_len = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    metadata = expect_type(metadata, dict, path, "__metadata__ as an object of strings")
    for k, v in metadata.items():
        expect_type(v, str, path, f"__metadata__[{k!r}] as a string")
    tensors: dict[str, TensorRecord] = {}
    for name, entry in header.items():
        if not name:
            raise Exl3FormatError(path, None, "a non-empty tensor name", "an entry named ''")
        entry = expect_type(entry, dict, path, "a header entry object {dtype, shape, data_offsets}", name)
        if not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise Exl3FormatError(path, name, "dtype, shape and data_offsets in the header entry", repr(entry)[:120])
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise Exl3FormatError(path, name, f"a safetensors dtype ({', '.join(DTYPES)})", repr(dtype)[:80])
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise Exl3FormatError(path, name, "a shape of non-negative integers", repr(shape)[:80])
        shape = tuple(shape)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise Exl3FormatError(path, name, "data_offsets [begin, end] of integers", repr(offsets)[:80])
        begin, end = offsets
        nbytes = tensor_nbytes(dtype, shape)
        if nbytes is None:
            raise Exl3FormatError(path, name, f"a last dimension that packs {dtype} into whole bytes",
                                  str(list(shape)))
        if end - begin != nbytes or begin < 0:
            raise Exl3FormatError(path, name, f"data_offsets spanning {nbytes} bytes for {dtype}{list(shape)}",
                                  f"[{begin}, {end}]")
        if end > data_len:
            raise Exl3FormatError(path, name, f"bytes [{begin}, {end}) inside the {data_len}-byte data section",
                                  "a tensor past end-of-file (truncated file)")
        tensors[name] = TensorRecord(name, dtype, shape, path, data_start + begin, nbytes)
    _check_layout(path, tensors, data_start, data_len)
    return SafetensorsFile(path, tensors, metadata, data_start, size, FileIdentity.of(st))


def _check_layout(path: Path, tensors: dict[str, TensorRecord], data_start: int, data_len: int) -> None:
    """Tensors tile the data section exactly: no overlap (two tensors sharing bytes), no hole, nothing after."""
    pos = 0
    previous = None
    for rec in sorted(tensors.values(), key=lambda r: (r.offset, r.nbytes, r.name)):
        begin = rec.offset - data_start
        if begin < pos:
            raise Exl3FormatError(path, rec.name, f"bytes of its own from offset {pos} of the data section",
                                  f"[{begin}, {begin + rec.nbytes}), overlapping '{previous}' (aliased bytes)")
        if begin > pos:
            raise Exl3FormatError(path, rec.name, f"to start at offset {pos} of the data section, where "
                                  + (f"'{previous}' ends" if previous else "the data section begins"),
                                  f"offset {begin} (a {begin - pos}-byte hole)")
        pos = begin + rec.nbytes
        if rec.nbytes:
            previous = rec.name
    if pos != data_len:
        raise Exl3FormatError(path, previous, f"the data section to end where the last tensor ends ({pos} bytes)",
                              f"{data_len - pos} bytes after it")


def read_bytes(rec: TensorRecord) -> bytes:
    """Read one tensor's bytes with pread; a short read is a format error naming file and offset."""
    fd = open_regular(rec.file, "a regular safetensors file")
    try:
        data = os.pread(fd, rec.nbytes, rec.offset)
    finally:
        os.close(fd)
    if len(data) != rec.nbytes:
        raise Exl3FormatError(rec.file, rec.name, f"{rec.nbytes} bytes at offset {rec.offset}",
                              f"{len(data)} (file shrank or is truncated)")
    return data


@dataclass(frozen=True)
class NewTensor:
    """One tensor of a safetensors file to write: its bytes follow the previous tensor's."""

    name: str
    dtype: str
    shape: Sequence[int]
    nbytes: int


@contextmanager
def write_safetensors(out: str | os.PathLike, tensors: Sequence[NewTensor],
                      metadata: dict[str, str] | None = None) -> Iterator[BinaryIO]:
    """Write a safetensors file holding `tensors`: the header here, then the caller writes every tensor's bytes, in
    order, into the file it is given. Written as `<out>.partial` and renamed onto `out` once complete, so `out` is
    never half a file (the partial file is removed on failure); a data section of another size than the header
    declares is refused before the rename."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    size = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [size, size + t.nbytes]}
        size += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            yield f
            written = f.tell() - 8 - len(raw)
        if written != size:
            raise ValueError(f"{out}: {written} bytes of tensor data written, the header declares {size}")
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)

"""safetensors headers: parse and validate one file's header without touching tensor data (header-only: no torch)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import Exl3FormatError

# safetensors dtype name -> element size in bytes
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
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


@dataclass
class SafetensorsFile:
    path: Path
    tensors: dict[str, TensorRecord]
    metadata: dict[str, str]
    data_start: int
    size: int


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsFile:
    """Parse and validate one safetensors header without touching tensor data.

    Checks that the header is complete JSON, every tensor has a known dtype and a byte range matching its shape,
    and that the file is long enough to hold every tensor (a truncated download fails here, not mid-load).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
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
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Exl3FormatError(path, None, "a JSON safetensors header", f"corrupt header ({e})") from e
    if not isinstance(header, dict):
        raise Exl3FormatError(path, None, "a JSON object as header", type(header).__name__)

    data_start = 8 + header_len
    data_len = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorRecord] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise Exl3FormatError(path, name, "dtype, shape and data_offsets in the header entry", repr(entry)) from e
        if dtype not in DTYPE_SIZES:
            raise Exl3FormatError(path, name, f"a safetensors dtype ({', '.join(DTYPE_SIZES)})", repr(dtype))
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise Exl3FormatError(path, name, "a shape of non-negative integers", repr(list(shape)))
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != nbytes or begin < 0:
            raise Exl3FormatError(path, name, f"data_offsets spanning {nbytes} bytes for {dtype}{list(shape)}",
                                  f"[{begin}, {end}]")
        if end > data_len:
            raise Exl3FormatError(path, name, f"bytes [{begin}, {end}) inside the {data_len}-byte data section",
                                  "a tensor past end-of-file (truncated file)")
        tensors[name] = TensorRecord(name, dtype, shape, path, data_start + begin, nbytes)
    return SafetensorsFile(path, tensors, metadata, data_start, size)


def read_bytes(rec: TensorRecord) -> bytes:
    """Read one tensor's bytes with pread; a short read is a format error naming file and offset."""
    fd = os.open(rec.file, os.O_RDONLY)
    try:
        data = os.pread(fd, rec.nbytes, rec.offset)
    finally:
        os.close(fd)
    if len(data) != rec.nbytes:
        raise Exl3FormatError(rec.file, rec.name, f"{rec.nbytes} bytes at offset {rec.offset}",
                              f"{len(data)} (file shrank or is truncated)")
    return data

"""Strict readers for everything a pack holds (header-only: no torch): regular files only, JSON without duplicate
keys or runaway nesting, and typed access to the values read. Every refusal is an `Exl3FormatError` naming the file.

A named pipe, a device or a socket where a pack file should be would block `open()` for ever; JSON with a repeated
key silently keeps the last value (one flipped byte can drop a codebook marker). The reference safetensors reader
refuses both; so does every reader of this package, through this module. Numbers too: `NaN`, `Infinity` and a float
that overflows to one are not JSON (RFC 8259) and turn into a crash or a wrong length downstream; an integer beyond
64 bits is no size, count or offset of a pack, and one of thousands of digits stops Python's own parser (its
int-digit limit) with an error that is not a JSON error.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from .errors import Exl3FormatError

# config.json, the index and the sidecar are small; a file beyond this is not one of them.
MAX_JSON_BYTES = 256 * 1024 * 1024
# The widest integer a pack's JSON holds (byte offsets, sizes, the codebook multipliers): 64 bits.
MAX_JSON_INT = 2**64 - 1
_MAX_JSON_INT_DIGITS = len(str(MAX_JSON_INT))
# A \uD800-\uDFFF escape: a lone one decodes to a surrogate, a string no output stream can print.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# The key a value belongs to: `"key":` (and the opening of a list) right before it.
_KEY_BEFORE = re.compile(r'"((?:[^"\\]|\\.){1,200})"\s*:\s*\[?\s*(?:-?\d+\s*,\s*)*$')


def open_regular(path: str | os.PathLike, what: str = "a regular file") -> int:
    """An O_RDONLY descriptor of `path`, refused (without blocking) unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise Exl3FormatError(path, None, what, f"{type(e).__name__}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Exl3FormatError(path, None, what, f"a {_kind(st.st_mode)} (not a regular file)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "named pipe"), (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _no_duplicates(file: str | os.PathLike | None, keys_are_tensors: bool):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                tensor = key if keys_are_tensors and key not in ("dtype", "shape", "data_offsets") else None
                raise Exl3FormatError(file, tensor or None, "JSON without repeated keys",
                                      f"the key {key!r} twice (a reader would silently keep only one)")
            out[key] = value
        return out

    return hook


class _BadNumber(ValueError):
    """A JSON number this package refuses (raised inside the parser, reported as an Exl3FormatError)."""

    def __init__(self, token: str, expected: str, found: str):
        super().__init__(found)
        self.token, self.expected, self.found = token, expected, found

    def where(self, text: str) -> str:
        """The key and the line and column of the number in `text` (its first occurrence: the parser does not
        say which)."""
        at = text.find(self.token)
        if at < 0:
            return ""
        key = _KEY_BEFORE.search(text, max(0, at - 300), at)
        line = text.count("\n", 0, at) + 1
        return (f" for the key {key[1]!r}" if key else "") + \
            f" at line {line} column {at - (text.rfind(chr(10), 0, at) + 1) + 1}"


def _parse_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > _MAX_JSON_INT_DIGITS or abs(int(text)) > MAX_JSON_INT:
        raise _BadNumber(text, "integers of at most 64 bits",
                         text if len(text) <= 24 else f"a {len(digits)}-digit integer")
    return int(text)


# Python's own int-digit limit (sys.int_info.default_max_str_digits): the readers of the files beside the weights
# (transformers' json.load of generation_config.json, tokenizer_config.json) stop on a longer integer.
PYTHON_INT_DIGITS = 4300


def _parse_int_of_python(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > PYTHON_INT_DIGITS:
        raise _BadNumber(text, f"integers of at most {PYTHON_INT_DIGITS} digits (Python's limit)",
                         f"a {len(digits)}-digit integer")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(text, "finite numbers", f"{text[:40]} (beyond the range of a float)")
    return value


def _parse_constant(name: str) -> float:
    raise _BadNumber(name, "finite numbers", f"{name} (not a JSON number)")


def _surrogate_free(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_surrogate_free(k) and _surrogate_free(v) for k, v in value.items())
    if isinstance(value, list):
        return all(map(_surrogate_free, value))
    return True


def loads(raw: bytes | str, file: str | os.PathLike | None, what: str = "valid JSON", noun: str = "JSON",
          keys_are_tensors: bool = False, pack_integers: bool = True) -> Any:
    """JSON text -> value; duplicate keys, bad UTF-8 (lone surrogate escapes included), bad syntax, nesting too deep
    and numbers that are not finite or beyond 64 bits are `Exl3FormatError`s (`keys_are_tensors`: a safetensors
    header, whose repeated key is named as the tensor). pack_integers=False: integers up to Python's limit (the
    files beside the weights: tokenizer_config.json's model_max_length is often int(1e30), beyond 64 bits)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text, object_pairs_hook=_no_duplicates(file, keys_are_tensors), parse_int=_parse_int if pack_integers else _parse_int_of_python,
                           parse_float=_parse_float, parse_constant=_parse_constant)
    except UnicodeDecodeError as e:
        raise Exl3FormatError(file, None, what, f"bytes that are not UTF-8 ({e})") from e
    except json.JSONDecodeError as e:
        raise Exl3FormatError(file, None, what, f"corrupt {noun} ({e})") from e
    except _BadNumber as e:
        raise Exl3FormatError(file, None, f"{what} with {e.expected}", e.found + e.where(text)) from None
    except RecursionError as e:
        raise Exl3FormatError(file, None, what, "JSON nested too deeply to be a pack file") from None
    if _SURROGATE_ESCAPE.search(text) and not _surrogate_free(value):
        raise Exl3FormatError(file, None, what, "a \\u escape of a lone UTF-16 surrogate (text that is not Unicode)")
    return value


def read_pack_file(path: Path, limit: int, what: str = "a regular file") -> bytes:
    """Up to limit + 1 bytes of a regular file of the pack; a missing, special or unreadable one is an
    `Exl3FormatError` naming it."""
    try:
        fd = open_regular(path, what)
    except FileNotFoundError as e:
        raise Exl3FormatError(path, None, "this file in the pack", "missing file") from e
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read(limit + 1)
    except OSError as e:
        raise Exl3FormatError(path, None, f"{what} this process can read", f"{type(e).__name__}: {e}") from e


def read_json_object(path: Path, pack_integers: bool = True) -> dict[str, Any]:
    """A JSON object file of the pack (config.json, the index, the sidecar), read strictly (pack_integers: see
    `loads`)."""
    raw = read_pack_file(path, MAX_JSON_BYTES, "a regular JSON file")
    if len(raw) > MAX_JSON_BYTES:
        raise Exl3FormatError(path, None, f"a JSON file of at most {MAX_JSON_BYTES} bytes", "a larger file")
    return expect_type(loads(raw, path, pack_integers=pack_integers), dict, path, "a JSON object")


_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def expect_type(value: Any, kind: type, file: str | os.PathLike | None, expected: str,
                tensor: str | None = None) -> Any:
    """`value` if it is a `kind` (bool is not an int here), else an `Exl3FormatError` saying `expected`."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Exl3FormatError(file, tensor, expected, f"{type(value).__name__} {_short(value)}")
    return value


def optional(mapping: dict[str, Any], key: str, kind: type, file: str | os.PathLike | None,
             where: str = "") -> Any:
    """`mapping[key]` checked to be a `kind` when present and not null; None otherwise."""
    value = mapping.get(key)
    if value is None:
        return None
    return expect_type(value, kind, file, f"{where}{key} as {_TYPE_NAMES.get(kind, kind.__name__)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""One quantized linear's stored tensors, validated from headers: bits, codebook, geometry, and the ONE marker check
(header-only: no torch; the marker check reads 4 bytes)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .constants import (CODEBOOK_3INST, CODEBOOK_MCG, CODEBOOK_MUL1, EXL3_SUFFIXES, HADAMARD_BLOCK, HALF_INTEGER_BASES,
                        INTEGER_BITS, MARKER_VALUE, TILE)
from .errors import Exl3FormatError
from .headers import TensorRecord, read_bytes


def bits_from_trellis_dim(last_dim: int) -> float | None:
    """Per-tensor bits from the trellis' last dimension (16*b int16 words per tile); None if impossible."""
    if last_dim % TILE == 0 and last_dim // TILE in INTEGER_BITS:
        return float(last_dim // TILE)
    if last_dim % TILE == TILE // 2 and last_dim // TILE in HALF_INTEGER_BASES:
        return last_dim // TILE + 0.5
    return None


def format_bits(bits: float) -> str:
    return f"{bits:g}"


class TrellisGeometry:
    """Padded (stored) features from a trellis [K/16, N/16, 16*bits]: shared by header records and loaded weights."""

    trellis: Any

    @property
    def in_padded(self) -> int:
        return self.trellis.shape[0] * TILE

    @property
    def out_padded(self) -> int:
        return self.trellis.shape[1] * TILE


@dataclass
class Exl3Linear(TrellisGeometry):
    """The stored tensors of one quantized linear, validated. Geometry is the padded (stored) one."""

    prefix: str
    trellis: TensorRecord
    suh: TensorRecord | None
    svh: TensorRecord | None
    su: TensorRecord | None  # legacy sign bitfields (pre-v0.0.2 packs)
    sv: TensorRecord | None
    marker: TensorRecord | None
    bias: TensorRecord | None
    bits: float
    codebook: str


    @property
    def records(self) -> list[TensorRecord]:
        return [r for r in (self.trellis, self.suh, self.svh, self.su, self.sv, self.marker, self.bias) if r]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def legacy_signs(self) -> bool:
        return self.suh is None


def _expect(cond: bool, rec: TensorRecord, expected: str, found: str) -> None:
    if not cond:
        raise Exl3FormatError(rec.file, rec.name, expected, found)


def build_linear(prefix: str, parts: dict[str, TensorRecord]) -> Exl3Linear:
    """Validate the tensors stored under one prefix and derive bits, codebook and geometry."""
    trellis = parts.get("trellis")
    any_part = next(iter(parts.values()))
    if trellis is None:
        raise Exl3FormatError(any_part.file, f"{prefix}.trellis",
                              f"a trellis tensor next to {', '.join(sorted(f'{prefix}.{k}' for k in parts))}",
                              "none (missing companion tensor)")
    _expect(trellis.dtype == "I16", trellis, "dtype I16", trellis.dtype)
    _expect(len(trellis.shape) != 2, trellis, "a linear's 3-D trellis [K/16, N/16, 16*bits]",
            f"{list(trellis.shape)}: ExLlamaV3's row codec for quantized embeddings / n-gram tables "
            "(--embed_bits, docs/format.md §1.8), which this plugin does not serve")
    _expect(len(trellis.shape) == 3, trellis, "a 3-D shape [K/16, N/16, 16*bits]", str(list(trellis.shape)))
    kt, nt, words = trellis.shape
    _expect(kt > 0 and nt > 0, trellis, "non-empty tile dimensions", str(list(trellis.shape)))
    _expect((kt * TILE) % HADAMARD_BLOCK == 0 and (nt * TILE) % HADAMARD_BLOCK == 0, trellis,
            f"padded features that are multiples of {HADAMARD_BLOCK} (trellis dims multiples of 8)",
            str(list(trellis.shape)))
    bits = bits_from_trellis_dim(words)
    if bits is None:
        raise Exl3FormatError(trellis.file, trellis.name,
                              "a last dimension of 16*b (b = 1..8) or 16*b+8 (b = 1, 2, 3; mul1 half-integer)",
                              str(words))

    suh, svh, su, sv = (parts.get(k) for k in ("suh", "svh", "su", "sv"))
    n_pad = nt * TILE
    for scale, signs, tiles, dim, side in ((suh, su, kt, 0, "input"), (svh, sv, nt, 1, "output")):
        if scale is not None and signs is not None:  # one of the two would be silently ignored
            raise Exl3FormatError(signs.file, signs.name, f"either .{scale.name.rsplit('.', 1)[1]} (scales) or the "
                                  f"legacy .{signs.name.rsplit('.', 1)[1]} (sign bits) for '{prefix}'", "both")
        if scale is not None:
            _expect(scale.dtype == "F16", scale, "dtype F16", scale.dtype)
            _expect(scale.shape == (tiles * TILE,), scale, f"shape [{tiles * TILE}] (16 x trellis dim {dim})",
                    str(list(scale.shape)))
        elif signs is not None:
            _expect(signs.dtype == "I16", signs, "dtype I16 (legacy sign bitfield)", signs.dtype)
            _expect(signs.shape == (tiles,), signs, f"shape [{tiles}] (legacy sign bitfield)", str(list(signs.shape)))
        else:
            name = "suh" if dim == 0 else "svh"
            raise Exl3FormatError(trellis.file, f"{prefix}.{name}",
                                  f"an {side}-side scale tensor (.{name} or legacy .{name[:2]})",
                                  "none (missing companion tensor)")

    mcg, mul1 = parts.get("mcg"), parts.get("mul1")
    if mcg is not None and mul1 is not None:
        raise Exl3FormatError(mul1.file, mul1.name, f"at most one codebook marker for '{prefix}'",
                              "both .mcg and .mul1")
    marker = mcg or mul1
    codebook = CODEBOOK_MCG if mcg is not None else CODEBOOK_MUL1 if mul1 is not None else CODEBOOK_3INST
    if marker is not None:
        _expect(marker.dtype == "I32" and marker.shape == (), marker, "a 0-dim I32 marker",
                f"{marker.dtype}{list(marker.shape)}")
    if bits != int(bits) and codebook != CODEBOOK_MUL1:
        raise Exl3FormatError(trellis.file, trellis.name, "half-integer bits only with the mul1 codebook",
                              f"{format_bits(bits)} bits with {codebook}")

    bias = parts.get("bias")
    if bias is not None:
        _expect(bias.dtype in ("F16", "BF16", "F32"), bias, "a float dtype", bias.dtype)
        _expect(len(bias.shape) == 1 and 0 < bias.shape[0] <= n_pad, bias, f"shape [N <= {n_pad}]",
                str(list(bias.shape)))
    return Exl3Linear(prefix, trellis, suh, svh, su, sv, marker, bias, bits, codebook)


EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's index in a tensor name


def tensor_group(name: str) -> str:
    """experts | head | dense (other EXL3 linears) for an EXL3 prefix."""
    if EXPERT_RE.search(name + "."):
        return "experts"
    if name == "lm_head" or name.endswith(".lm_head"):
        return "head"
    return "dense"


def split_suffix(name: str) -> tuple[str, str]:
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


def group_exl3_tensors(tensors: dict[str, TensorRecord]) -> dict[str, dict[str, TensorRecord]]:
    """EXL3 component tensors grouped by module prefix (a lone `.bias` is a plain layer's, not EXL3)."""
    groups: dict[str, dict[str, TensorRecord]] = {}
    for name, rec in tensors.items():
        prefix, suffix = split_suffix(name)
        if suffix in EXL3_SUFFIXES:
            groups.setdefault(prefix, {})[suffix] = rec
    return {p: parts for p, parts in sorted(groups.items()) if not set(parts) <= {"bias"}}


def marker_value_problem(codebook: str, value: int, file, tensor: str) -> Exl3FormatError | None:
    """The one marker check: a codebook marker's stored value (read as int32 or uint32) against the locked value of
    its codebook; None when it matches. Used on the headers' bytes (`marker_problem`) and on the tensors vLLM hands
    the layers (integration/linear.py, moe.py)."""
    value &= 0xFFFFFFFF
    expected = MARKER_VALUE[codebook]
    if value == expected:
        return None
    return Exl3FormatError(file, tensor, f"the locked {codebook} marker value 0x{expected:08X}",
                           f"unknown marker value 0x{value:08X}")


def marker_problem(linear: Exl3Linear) -> Exl3FormatError | None:
    """Check a codebook marker's stored value (4 bytes of I/O); None when fine or absent."""
    if linear.marker is None:
        return None
    value = int.from_bytes(read_bytes(linear.marker), "little", signed=False)
    return marker_value_problem(linear.codebook, value, linear.marker.file, linear.marker.name)


# Names allowed right after an EXL3 linear's prefix: its components, and a stale `.weight` (shape-checked, dropped).
_BESIDE_LINEAR = frozenset(f".{s}" for s in (*EXL3_SUFFIXES, "weight"))


def unknown_suffix_problems(tensors: dict[str, TensorRecord], prefixes: set[str]) -> list[Exl3FormatError]:
    """Tensors named after an EXL3 linear with a suffix it does not have (`down_proj.foo`, `down_proj&mcg`): a
    renamed marker or component would otherwise be silently ignored and the linear decoded with the wrong codebook."""
    problems = []
    for name, rec in tensors.items():
        for i, ch in enumerate(name):
            if (ch.isalnum() or ch == "_") or name[:i] not in prefixes:
                continue
            if name[i:] not in _BESIDE_LINEAR:
                problems.append(Exl3FormatError(
                    rec.file, name, f"only {', '.join(sorted(_BESIDE_LINEAR))} beside the EXL3 linear '{name[:i]}'",
                    f"the unknown suffix {name[i:]!r}"))
            break
    return problems


# F16: exponent bits all ones (0x7C in the high byte) is Inf or NaN. Bytes of a high byte that are finite:
_FINITE_HIGH = bytes(b for b in range(256) if b & 0x7C != 0x7C)


def scale_problem(linear: Exl3Linear) -> Exl3FormatError | None:
    """Non-finite values in `.suh`/`.svh` (F16, checked in their bytes: about 0.1 % of a pack's bytes)."""
    for rec in (linear.suh, linear.svh):
        if rec is None:
            continue
        bad = read_bytes(rec)[1::2].translate(None, _FINITE_HIGH)  # little-endian: odd bytes are the high bytes
        if bad:
            return Exl3FormatError(rec.file, rec.name, "finite F16 scales", f"{len(bad)} NaN or Inf value(s)")
    return None


def ledger_codebook(entry: Any) -> str | None:
    """The codebook the sidecar's `tensor_storage` ledger records for one module; None when not an EXL3 entry."""
    if not isinstance(entry, dict) or entry.get("quant_format") != "exl3":
        return None
    for codebook in (CODEBOOK_MCG, CODEBOOK_MUL1):
        if f"{codebook}_multiplier" in entry:
            return codebook
    return CODEBOOK_3INST

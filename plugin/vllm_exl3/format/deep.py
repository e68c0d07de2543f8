"""`vllm-exl3 verify --deep`: decode every tensor of a pack, one at a time (memory of the largest linear), and
check what headers cannot: finite suh/svh within sane magnitudes, a finite decoded weight, finite plain tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .errors import Exl3FormatError
from .pack import Pack
from .reference import full_weight
from .tensors import load_weights, read_tensor

MAX_SCALE = 1e4  # |suh|, |svh| above this is no real conversion (ExLlamaV3's are O(1) or smaller)
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


@dataclass
class TensorCheck:
    name: str  # an EXL3 linear's prefix, or a plain tensor's name
    kind: str  # exl3 | plain
    max_abs: float | None
    problem: Exl3FormatError | None = None


def _scale_problem(lin, which: str, t: torch.Tensor) -> Exl3FormatError | None:
    rec = getattr(lin, which) or getattr(lin, which[:2])
    t = t.float()
    if not bool(torch.isfinite(t).all()):
        return Exl3FormatError(rec.file, rec.name, "finite scales", f"{int((~torch.isfinite(t)).sum())} NaN/inf")
    if not bool((t != 0).any()):
        return Exl3FormatError(rec.file, rec.name, "non-zero scales", "all zero")
    peak = float(t.abs().max())
    if peak > MAX_SCALE:
        return Exl3FormatError(rec.file, rec.name, f"scales of magnitude <= {MAX_SCALE:g}", f"{peak:.3g}")
    return None


def check_pack(pack: Pack) -> Iterator[TensorCheck]:
    """One TensorCheck per EXL3 linear and per plain floating-point tensor, streaming."""
    for prefix, lin in pack.linears().items():
        w = load_weights(lin)
        problem = _scale_problem(lin, "suh", w.suh) or _scale_problem(lin, "svh", w.svh)
        peak = None
        if problem is None:
            full = full_weight(w)
            finite = torch.isfinite(full)
            if not bool(finite.all()):
                problem = Exl3FormatError(lin.trellis.file, lin.trellis.name, "a finite decoded weight",
                                          f"{int((~finite).sum())} NaN/inf values")
            else:
                peak = float(full.abs().max())
        yield TensorCheck(prefix, "exl3", peak, problem)
    for name, rec in pack.unquantized().items():
        if rec.dtype not in _FLOAT_DTYPES or not rec.numel:
            continue
        t = read_tensor(rec).float()
        finite = torch.isfinite(t)
        problem = None if bool(finite.all()) else Exl3FormatError(rec.file, name, "finite values",
                                                                   f"{int((~finite).sum())} NaN/inf")
        yield TensorCheck(name, "plain", float(t.abs().max()) if problem is None else None, problem)


def count(pack: Pack) -> int:
    return len(pack.linears()) + sum(1 for r in pack.unquantized().values() if r.dtype in _FLOAT_DTYPES and r.numel)


def deep_verify(pack: Pack, progress: Callable[[TensorCheck], None] | None = None) -> list[TensorCheck]:
    out = []
    for c in check_pack(pack):
        out.append(c)
        if progress:
            progress(c)
    return out

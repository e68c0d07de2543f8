"""Write decoded EXL3 weights to a safetensors file (behind `vllm-exl3 dequant`).

The output is streamed: the header is computed from shapes alone, then each tensor is decoded, written and
freed, so a pack of any size dequantizes in the memory of its largest linear.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .headers import NewTensor, write_safetensors
from .pack import Pack
from .records import Exl3Linear
from .tensors import load_weights
from .reference import decode_rotated, full_weight

_DTYPE_NAMES = {torch.float16: "F16", torch.float32: "F32"}


@dataclass
class DequantItem:
    linear: Exl3Linear
    name: str
    shape: tuple[int, ...]  # as written


def plan(pack: Pack, pattern: str | None, rotated: bool, padded: bool) -> list[DequantItem]:
    """Which tensors to write, under which names and shapes.

    Default: `<prefix>.weight`, the full weight in HF (out, in) layout, trimmed to the model's logical sizes
    where the config determines them. `rotated`: Ŵ exactly as ExLlamaV3 reconstructs it, (in, out), padded.
    """
    items = []
    for prefix, lin in pack.linears().items():
        if pattern and not (fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(f"{prefix}.weight", pattern)):
            continue
        if rotated:
            shape = (lin.in_padded, lin.out_padded)
        else:
            k, n = (lin.in_padded, lin.out_padded) if padded else pack.logical_features(lin)
            shape = (n, k)
        items.append(DequantItem(lin, f"{prefix}.weight", shape))
    return items


def write(items: list[DequantItem], out: str | os.PathLike, rotated: bool,
          progress: Callable[[DequantItem], None] | None = None) -> int:
    """Decode and stream `items` into `out`; returns bytes written."""
    dtype = torch.float16 if rotated else torch.float32
    size = torch.empty((), dtype=dtype).element_size()
    metadata = {"format": "pt", "producer": "vllm-exl3 dequant",
                "content": "rotated-basis W_hat (in, out), padded" if rotated else "full weight (out, in), float32"}
    tensors = [NewTensor(it.name, _DTYPE_NAMES[dtype], it.shape, it.shape[0] * it.shape[1] * size) for it in items]
    with write_safetensors(out, tensors, metadata) as f:
        for it in items:
            w = load_weights(it.linear)
            if rotated:
                t = decode_rotated(w.trellis, w.codebook)
            else:
                t = full_weight(w)[: it.shape[1], : it.shape[0]].t()
            f.write(t.contiguous().numpy().tobytes())
            if progress:
                progress(it)
    return Path(out).stat().st_size

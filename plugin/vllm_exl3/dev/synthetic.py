"""Synthetic EXL3 data for tests and benchmarks: random linears and packs written in the real on-disk format.

Any bit pattern is a valid trellis (every 16-bit state decodes), so random int16 tiles plus random suh/svh make
a well-formed linear of any geometry, bit width and codebook. Values are O(1) like real packs (suh/svh carry
the scale), so numerical checks on them are meaningful.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..format.constants import CODEBOOK_3INST, HADAMARD_BLOCK, MARKER_VALUE, TILE
from ..format.geometry import ceil_to
from ..format.tensors import Exl3Weights


def padded(n: int) -> int:
    return ceil_to(n)


def random_weights(in_features: int, out_features: int, bits: float, codebook: str, seed: int = 0,
                   device: str | torch.device = "cpu", scale: float | None = None) -> Exl3Weights:
    """A random EXL3 linear in padded geometry. suh is scaled so outputs stay O(1) for O(1) inputs."""
    g = torch.Generator().manual_seed(seed)
    k, n = padded(in_features), padded(out_features)
    words = int(round(bits * TILE))
    trellis = torch.randint(-(2**15), 2**15, (k // TILE, n // TILE, words), dtype=torch.int16, generator=g)
    scale = scale if scale is not None else 1.0 / math.sqrt(in_features)
    suh = ((torch.rand(k, generator=g) * 0.5 + 0.75) * scale
           * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)).half()
    svh = ((torch.rand(n, generator=g) * 0.5 + 0.75) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)).half()
    svh[out_features:] = 0  # ExLlamaV3 writes svh = 0 on padded output columns (docs/format.md §5.1)
    return Exl3Weights(trellis.to(device), suh.to(device), svh.to(device), codebook, float(bits))


def linear_tensors(prefix: str, w: Exl3Weights) -> dict[str, torch.Tensor]:
    """The safetensors entries ExLlamaV3 writes for one linear."""
    out = {f"{prefix}.trellis": w.trellis.cpu(), f"{prefix}.suh": w.suh.cpu(), f"{prefix}.svh": w.svh.cpu()}
    if w.codebook != CODEBOOK_3INST:
        marker = MARKER_VALUE[w.codebook]
        out[f"{prefix}.{w.codebook}"] = torch.tensor(marker - (1 << 32) if marker >= 1 << 31 else marker,
                                                     dtype=torch.int32)
    if w.bias is not None:
        out[f"{prefix}.bias"] = w.bias.cpu()
    return out


def _codebook_of(tensors: dict[str, Any]) -> dict[str, str]:
    """`{"codebook": ...}` when every EXL3 linear in `tensors` shares one codebook (as the converter writes), else
    nothing (a mixed pack declares none)."""
    prefixes = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".trellis")}
    found = {next((cb for cb in ("mcg", "mul1") if f"{p}.{cb}" in tensors), "3inst") for p in prefixes}
    return {"codebook": found.pop()} if len(found) == 1 else {}


def write_pack(root: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None,
               shards: int = 1, index: bool | None = None) -> Path:
    """Write tensors as a pack: config.json plus one or `shards` safetensors files (+ index when sharded)."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config = dict(config or {})
    config.setdefault("quantization_config", {"quant_method": "exl3", "version": "synthetic", "bits": 4.0,
                                              "head_bits": 6, **_codebook_of(tensors)})
    (root / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    index = shards > 1 if index is None else index
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(root / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    if index:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def expert_stack(weights, experts, i0: int = 0, i1: int | None = None):
    """The ExpertStack one rank holds (moe.py's layout): `weights[e]` (Exl3Weights, padded geometry, in PROJECTIONS
    order: gate, up, down) of the global experts, this rank's `experts` in order, and the intermediate block range
    around [i0, i1) (default: all of it). Trellis records are padded to the widest width, as the layer stores them."""
    from ..kernels.specs import PROJECTIONS, W13, W2, ExpertStack

    def proj(e: int, name: str):
        return weights[e][PROJECTIONS.index(name)]

    i1 = proj(experts[0], "gate").out_padded if i1 is None else i1
    b0, b1 = i0 // HADAMARD_BLOCK * HADAMARD_BLOCK, -(-i1 // HADAMARD_BLOCK) * HADAMARD_BLOCK
    w13_words = max(round(proj(e, p).bits * TILE) for e in experts for p in W13)
    w2_words = max(round(proj(e, W2).bits * TILE) for e in experts)

    def pad(t, words):
        return torch.nn.functional.pad(t, (0, words - t.shape[-1]))

    return ExpertStack(
        torch.stack([torch.stack([pad(proj(e, p).trellis[:, b0 // TILE:b1 // TILE], w13_words) for p in W13])
                     for e in experts]).contiguous(),
        torch.stack([torch.stack([proj(e, p).suh for p in W13]) for e in experts]).contiguous(),
        torch.stack([torch.stack([proj(e, p).svh[b0:b1] for p in W13]) for e in experts]).contiguous(),
        torch.stack([pad(proj(e, W2).trellis[b0 // TILE:b1 // TILE], w2_words) for e in experts]).contiguous(),
        torch.stack([proj(e, W2).suh[b0:b1] for e in experts]).contiguous(),
        torch.stack([proj(e, W2).svh for e in experts]).contiguous(),
        tuple(round(proj(e, p).bits * TILE) for e in experts for p in W13),
        tuple(round(proj(e, W2).bits * TILE) for e in experts),
        tuple(proj(e, p).codebook for e in experts for p in PROJECTIONS), i0 - b0, i1 - i0)

"""What a pack holds, by module prefix: each EXL3 linear's `LinearMeta` (bits, codebook, padded geometry) and the
shapes of the plain weights, read from safetensors headers (local or on the Hub). Header-only: no torch.

Checkpoint names; the vLLM integration renames them with `PackIndex.renamed(apply_vllm_mapper's mapper)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .constants import TILE
from .errors import Exl3FormatError
from .headers import TensorRecord
from .pack import Pack
from .records import Exl3Linear, build_linear, group_exl3_tensors


@dataclass(frozen=True)
class LinearMeta:
    bits: float
    codebook: str
    in_padded: int
    out_padded: int
    legacy_signs: bool = False
    has_marker: bool = False
    has_bias: bool = False

    @classmethod
    def of(cls, lin: Exl3Linear) -> "LinearMeta":
        return cls(lin.bits, lin.codebook, lin.in_padded, lin.out_padded, lin.legacy_signs, lin.marker is not None,
                   lin.bias is not None)

    def stored(self, suffix: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, shape) of the tensor `<prefix>.<suffix>`, as the headers held it (records.build_linear
        checked them there); the layers check what vLLM hands them against it."""
        kt, nt = self.in_padded // TILE, self.out_padded // TILE
        return {"trellis": ("I16", (kt, nt, round(self.bits * TILE))), "suh": ("F16", (self.in_padded,)),
                "svh": ("F16", (self.out_padded,)), "su": ("I16", (kt,)), "sv": ("I16", (nt,)),
                self.codebook: ("I32", ())}[suffix]

    @property
    def suffixes(self) -> set[str]:
        """The tensors this linear is stored as (`<prefix>.<suffix>`): what a load must deliver (a bias aside)."""
        need = {"trellis", "su" if self.legacy_signs else "suh", "sv" if self.legacy_signs else "svh"}
        if self.has_marker:
            need.add(self.codebook)
        return need


@dataclass
class PackIndex:
    exl3: dict[str, LinearMeta] = field(default_factory=dict)  # EXL3 linears
    plain: dict[str, tuple[int, ...]] = field(default_factory=dict)  # `<prefix>.weight` shapes of the rest
    notes: list[str] = field(default_factory=list)  # what the pack's check covered (`Pack.notes`)

    @classmethod
    def from_tensors(cls, tensors: dict[str, TensorRecord]) -> "PackIndex":
        index = cls()
        for prefix, parts in group_exl3_tensors(tensors).items():
            index.exl3[prefix] = LinearMeta.of(build_linear(prefix, parts))
        for name, rec in tensors.items():
            if name.endswith(".weight"):
                index.plain[name[: -len(".weight")]] = rec.shape
        return index

    def renamed(self, mapper) -> "PackIndex":
        """The index under the names vLLM's model gives these modules. Each prefix is mapped as the name of one of
        its tensors (`.trellis`, `.weight`), as vLLM maps the checkpoint: some rules match a name's end (gpt-oss maps
        a name ending `.down_proj` to its fused `.w2_weight`), others need the dot only a tensor name has
        (`"lm_head." -> "language_model.lm_head."` in vLLM's multimodal models). A name whose suffix the mapper
        rewrote is a fused tensor of vLLM's own, not this module: dropped."""

        def rename(d, suffix):
            out = {}
            for k, v in d.items():
                new = mapper.map_name(f"{k}.{suffix}")
                if new is not None and new.endswith(f".{suffix}"):
                    out[new[: -len(suffix) - 1]] = v
            return out

        return PackIndex(rename(self.exl3, "trellis"), rename(self.plain, "weight"), list(self.notes))


def _remote_tensors(repo: str, revision: str | None) -> dict[str, TensorRecord]:
    """Header records of a Hub repository without downloading weights (HTTP range reads of the headers)."""
    from huggingface_hub import get_safetensors_metadata

    meta = get_safetensors_metadata(repo, revision=revision)
    records = {}
    for fname, fmeta in meta.files_metadata.items():
        for name, info in fmeta.tensors.items():
            begin, end = info.data_offsets
            records[name] = TensorRecord(name, info.dtype, tuple(info.shape), Path(fname), begin, end - begin)
    return records


def index_model(model: str, revision: str | None = None) -> PackIndex:
    """Read and validate the pack behind `model` (a local directory or a Hub id): a local pack gets every check
    `verify` makes (`Pack.check` with the scales: headers, markers and the suh/svh bytes, about 0.1 % of the pack)."""
    if os.path.isdir(model):
        pack = Pack.open(model)
        pack.check(finite=True)
        index = PackIndex.from_tensors(pack.tensors)
        index.notes = list(pack.notes)
        return index
    try:
        tensors = _remote_tensors(model, revision)
    except Exception as e:  # noqa: BLE001 - any Hub failure is reported as "cannot index"
        raise Exl3FormatError(model, None, "a local pack directory or a Hub repository with safetensors",
                              f"{type(e).__name__}: {e}") from e
    return PackIndex.from_tensors(tensors)

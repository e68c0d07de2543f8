"""Tools for packs assembled by hand (behind `vllm-exl3 pack …`): regenerate the shard index, derive
`quantization_config` from the tensors, and overlay the routed experts of one pack onto the dense layers of
another (or of the BF16 model). Header-only: no torch; tensor bytes are copied raw.

Every bad input raises `Exl3FormatError` naming the file and the tensor.
"""

from __future__ import annotations

import difflib
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .constants import INDEX_FILE, SIDECAR_FILE
from .contract import Contract, layer_index
from .errors import Exl3ConfigError, Exl3FormatError
from .headers import NewTensor, TensorRecord, read_safetensors_header, write_safetensors
from .index import PackIndex
from .jsonfile import write_json
from .pack import Pack, tensor_group, verify_pack
from .records import build_linear, group_exl3_tensors
from .strict import read_json_object

Progress = Callable[[str], None]  # called with a file name once that file is done


# -- index --------------------------------------------------------------------------------------------------------
def scan_shards(root: str | os.PathLike, progress: Progress | None = None) -> tuple[dict[str, str], int]:
    """(weight_map, total tensor bytes) from the headers of every *.safetensors in `root`; a tensor in two
    files is an error naming both."""
    root = Path(root)
    paths = sorted(root.glob("*.safetensors"))
    if not paths:
        raise Exl3FormatError(root, None, "at least one *.safetensors file", "none")
    weight_map: dict[str, str] = {}
    total = 0
    for path in paths:
        for name, rec in read_safetensors_header(path).tensors.items():
            if name in weight_map:
                raise Exl3FormatError(path, name, "each tensor in exactly one shard",
                                      f"a duplicate also in {root / weight_map[name]}")
            weight_map[name] = path.name
            total += rec.nbytes
        if progress:
            progress(path.name)
    return weight_map, total


def index_drift(root: str | os.PathLike, weight_map: dict[str, str]) -> list[str]:
    """How the index on disk differs from `weight_map` (one line per tensor; empty: in sync)."""
    path = Path(root) / INDEX_FILE
    if not path.exists():
        return [f"{INDEX_FILE} is missing ({len(weight_map)} tensors in the shards)"]
    old = read_json_object(path).get("weight_map")
    if not isinstance(old, dict):
        return [f"{INDEX_FILE} has no 'weight_map' object"]
    lines = [f"+ {n} ({weight_map[n]}): not in the index" for n in sorted(weight_map.keys() - old.keys())]
    lines += [f"- {n}: the index places it in {old[n]}, no shard holds it" for n in sorted(old.keys() - weight_map.keys())]
    lines += [f"~ {n}: the index says {old[n]}, it is in {weight_map[n]}"
              for n in sorted(weight_map.keys() & old.keys()) if old[n] != weight_map[n]]
    return lines


def write_index(root: str | os.PathLike, weight_map: dict[str, str], total: int) -> Path:
    path = Path(root) / INDEX_FILE
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(path, body, indent=2)
    return path


# -- quantization_config ------------------------------------------------------------------------------------------
@dataclass
class DerivedConfig:
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # what could not be declared, and why


def _num(bits: float) -> float | int:
    """4.0 -> 4 (as ExLlamaV3 writes whole widths), 2.5 stays."""
    return int(bits) if float(bits).is_integer() else bits


def _suffix(prefix: str) -> str:
    return prefix.rsplit(".", 1)[-1]


def derive_config(tensors: dict[str, TensorRecord], existing: dict[str, Any] | None = None) -> DerivedConfig:
    """`quantization_config` as the tensors say: codebook (when one), routed experts' `layer_bits`, dense EXL3
    linears in `non_routed_exl3`'s short form, `head_bits`, `bits` (the weight-average) when absent. Keys the
    tensors do not decide (version, calibration, …) are kept from `existing`."""
    linears = {p: build_linear(p, parts) for p, parts in group_exl3_tensors(tensors).items()}
    if not linears:
        raise Exl3FormatError(None, None, "at least one EXL3 linear (a .trellis tensor) to derive a config from",
                              "none")
    qc = dict(existing or {})
    qc["quant_method"] = "exl3"
    notes: list[str] = []
    codebooks = sorted({lin.codebook for lin in linears.values()})
    if len(codebooks) == 1:
        qc["codebook"] = codebooks[0]
    else:
        qc.pop("codebook", None)
        notes.append(f"codebook not declared: the pack mixes {', '.join(codebooks)} (each tensor's marker decides)")

    def per_layer_bits(group: str) -> tuple[dict[int, set[float]], dict[str, set[float]]]:
        by_layer: dict[int, set[float]] = {}
        by_suffix: dict[str, set[float]] = {}
        for p, lin in linears.items():
            if tensor_group(p) == group and layer_index(p) is not None:
                by_layer.setdefault(layer_index(p), set()).add(lin.bits)
                by_suffix.setdefault(_suffix(p), set()).add(lin.bits)
        return by_layer, by_suffix

    experts, _ = per_layer_bits("experts")
    layer_bits = {str(i): _num(next(iter(b))) for i, b in sorted(experts.items()) if len(b) == 1}
    notes += [f"layer {i}: routed experts at several widths ({', '.join(f'{x:g}' for x in sorted(b))}), "
              "no layer_bits entry" for i, b in sorted(experts.items()) if len(b) > 1]
    if layer_bits:
        qc["layer_bits"] = layer_bits
    else:
        qc.pop("layer_bits", None)

    dense, dense_suffixes = per_layer_bits("dense")
    plain_suffixes = {_suffix(n[: -len(".weight")]) for n in tensors
                      if n.endswith(".weight") and tensor_group(n[: -len(".weight")]) == "dense"
                      and n[: -len(".weight")] not in linears}
    modules = sorted(s for s in dense_suffixes if s not in plain_suffixes)
    mixed = sorted(set(dense_suffixes) - set(modules))
    if mixed:
        notes.append(f"non_routed_exl3 leaves out {', '.join(mixed)}: EXL3 in some layers, plain in others")
    if modules:
        bits = Counter(linears[p].bits for p in linears if tensor_group(p) == "dense" and _suffix(p) in modules)
        common = bits.most_common(1)[0][0]
        nr: dict[str, Any] = {"modules": modules}
        uneven = [i for i, b in sorted(dense.items()) if len(b) > 1]
        notes += [f"layer {i}: dense EXL3 linears at several widths, bits not declared for it" for i in uneven]
        if uneven:  # a layer-wide `bits` would be wrong there: declare only the single-width layers
            per_layer = {str(i): _num(next(iter(b))) for i, b in sorted(dense.items()) if len(b) == 1}
        else:
            nr["bits"] = _num(common)
            per_layer = {str(i): _num(next(iter(b))) for i, b in sorted(dense.items()) if b != {common}}
        if per_layer:
            nr["layer_bits"] = per_layer
        qc["non_routed_exl3"] = nr
    else:
        qc.pop("non_routed_exl3", None)
    head = [lin for p, lin in linears.items() if tensor_group(p) == "head"]
    if head:
        qc["head_bits"] = _num(head[0].bits)
    if "bits" not in qc:
        weights = {p: lin.in_padded * lin.out_padded for p, lin in linears.items() if tensor_group(p) != "head"}
        qc["bits"] = round(sum(linears[p].bits * n for p, n in weights.items()) / max(sum(weights.values()), 1), 3)
    _check_contract(qc, tensors)
    return DerivedConfig(qc, notes)


def _check_contract(qc: dict[str, Any], tensors: dict[str, TensorRecord]) -> None:
    """The derived config must pass the same checks the plugin runs at start."""
    try:
        index = PackIndex.from_tensors(tensors)
        Contract.parse(qc).check_pack(index.exl3, set(index.plain))
    except Exl3ConfigError as e:  # a bug in derive_config: say so plainly
        raise Exl3FormatError(None, None, "a derived quantization_config that passes the plugin's checks", str(e))


def config_diff(old: dict[str, Any], new: dict[str, Any], label: str = "quantization_config") -> str:
    dump = (lambda d: json.dumps(d, indent=2, sort_keys=True).splitlines(keepends=True))
    return "".join(difflib.unified_diff(dump(old), dump(new), f"{label} (now)", f"{label} (derived)"))


def write_config(root: str | os.PathLike, qc: dict[str, Any]) -> list[Path]:
    """Put `qc` into config.json (and into the sidecar quantization_config.json when the pack has one)."""
    root = Path(root)
    config = read_json_object(root / "config.json")
    config["quantization_config"] = qc
    write_json(root / "config.json", config, indent=2)
    written = [root / "config.json"]
    if (root / SIDECAR_FILE).exists():
        write_json(root / SIDECAR_FILE, qc, indent=2)
        written.append(root / SIDECAR_FILE)
    return written


# -- overlay ------------------------------------------------------------------------------------------------------
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_experts", "n_routed_experts",
               "num_local_experts", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads")
COPY_CHUNK = 64 << 20


@dataclass
class OverlayResult:
    out: Path
    linked: list[str]  # whole shards linked from a source
    written: list[str]  # shards written with a subset of a source shard's tensors
    copied_bytes: int
    notes: list[str]


def _is_routed(name: str) -> bool:
    return tensor_group(name.rsplit(".", 1)[0]) == "experts"


def write_subset(records: list[TensorRecord], out: Path, metadata: dict[str, str]) -> int:
    """A safetensors file holding `records` (bytes copied raw from their files); returns bytes copied."""
    with write_safetensors(out, [NewTensor(r.name, r.dtype, r.shape, r.nbytes) for r in records], metadata) as f:
        for rec in records:
            fd = os.open(rec.file, os.O_RDONLY)
            try:
                done = 0
                while done < rec.nbytes:
                    data = os.pread(fd, min(COPY_CHUNK, rec.nbytes - done), rec.offset + done)
                    if not data:
                        raise Exl3FormatError(rec.file, rec.name, f"{rec.nbytes} bytes at offset {rec.offset}",
                                              f"{done} (file shrank or is truncated)")
                    f.write(data)
                    done += len(data)
            finally:
                os.close(fd)
    return sum(r.nbytes for r in records)


def _link(src: Path, dst: Path, symlink: bool) -> None:
    try:
        if symlink:
            os.symlink(src.resolve(), dst)
        else:
            os.link(src, dst)
    except OSError as e:
        raise Exl3FormatError(src, None, f"a {'symbolic' if symlink else 'hard'} link at {dst}",
                              f"{type(e).__name__}: {e}" + ("" if symlink else " (another filesystem? use --symlink)")
                              ) from e


def _check_same_model(experts: Pack, dense: Pack) -> None:
    a, b = experts.text_config, dense.text_config
    for key in CONFIG_KEYS:
        if key in a and key in b and a[key] != b[key]:
            raise Exl3FormatError(dense.root / "config.json", None, f"{key} = {a[key]!r} as in "
                                  f"{experts.root / 'config.json'} (the two must be the same model)", repr(b[key]))


def overlay(experts_root: str | os.PathLike, dense_root: str | os.PathLike, out: str | os.PathLike,
            symlink: bool = False, progress: Progress | None = None) -> OverlayResult:
    """A pack at `out` whose routed experts come from `experts_root` (an EXL3 pack) and everything else (dense
    layers, embeddings, norms, routers, head) from `dense_root` (an EXL3 pack or the BF16 model). Shards whose
    every tensor is taken are linked, not copied; config (quantization_config derived from the tensors) and
    index are written; the result is verified."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise Exl3FormatError(out, None, "a new or empty output directory", "it exists and is not empty")
    experts, dense = Pack.open(experts_root), Pack.open(dense_root)
    _check_same_model(experts, dense)
    routed = {n: r for n, r in experts.tensors.items() if _is_routed(n)}
    if not any(n.endswith(".trellis") for n in routed):
        raise Exl3FormatError(experts.root, None, "EXL3 routed experts (…experts.<e>.<proj>.trellis tensors)",
                              "none in this pack")
    rest = {n: r for n, r in dense.tensors.items() if not _is_routed(n)}
    if not rest:
        raise Exl3FormatError(dense.root, None, "dense layers (tensors outside the routed experts)", "none")
    out.mkdir(parents=True, exist_ok=True)
    linked, written, copied, notes = [], [], 0, []
    dropped = len(dense.tensors) - len(rest)
    if dropped:
        notes.append(f"{dropped} routed-expert tensors of {dense.root} not used")
    for tag, pack, chosen in (("experts", experts, routed), ("dense", dense, rest)):
        for f in pack.files:
            take = [r for n, r in f.tensors.items() if n in chosen]
            if not take:
                continue
            dst = out / f"{tag}-{f.path.name}"
            if len(take) == len(f.tensors):
                _link(f.path, dst, symlink)
                linked.append(dst.name)
            else:
                copied += write_subset(take, dst, f.metadata)
                written.append(dst.name)
            if progress:
                progress(dst.name)
    skip = {"config.json", INDEX_FILE, SIDECAR_FILE}
    for src in sorted(experts.root.iterdir()):  # tokenizer, generation config, chat template …
        if src.is_file() and src.suffix != ".safetensors" and src.name not in skip and not src.name.startswith("."):
            _link(src, out / src.name, symlink)
    weight_map, total = scan_shards(out)
    write_index(out, weight_map, total)
    config = dict(experts.config)
    base_qc = experts.quantization_config
    config["quantization_config"] = base_qc
    write_json(out / "config.json", config, indent=2)
    derived = derive_config(Pack.open(out).tensors, {k: v for k, v in base_qc.items() if k != "bits"})
    write_config(out, derived.config)
    notes += derived.notes
    _, problems = verify_pack(out)
    if problems:
        raise problems[0]
    return OverlayResult(out, linked, written, copied, notes)

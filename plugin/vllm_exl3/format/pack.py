"""The EXL3 pack on disk: files, tensors, per-tensor bits and codebook, validation.

An EXL3 pack is a Hugging Face model directory whose quantized linears were replaced by ExLlamaV3's trellis
tensors (docs/format.md §1). Everything here reads only safetensors *headers*: listing or validating a pack of
any size costs a few kilobytes of I/O. Tensor bytes are read on demand (`read_tensor`).

Every problem with a pack raises `Exl3FormatError`, whose message names the file, the tensor and what was
expected, so a user can tell a truncated download from a wrong converter version.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .constants import CODEBOOKS, INDEX_FILE, SIDECAR_FILE
from .errors import Exl3FormatError
from .geometry import ceil_to
from .headers import SafetensorsFile, TensorRecord, read_safetensors_header
from .records import (Exl3Linear, build_linear, group_exl3_tensors, ledger_codebook, marker_problem, scale_problem,
                      unknown_suffix_problems)
from .strict import expect_type, optional, read_json_object


_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


def tensor_group(name: str) -> str:
    """experts | head | dense (other EXL3 linears) for an EXL3 prefix."""
    if _EXPERT_RE.search(name + "."):
        return "experts"
    if name == "lm_head" or name.endswith(".lm_head"):
        return "head"
    return "dense"


@dataclass
class Pack:
    """An EXL3 model directory, read header-only."""

    root: Path
    config: dict[str, Any]
    files: list[SafetensorsFile]
    tensors: dict[str, TensorRecord]
    sidecar: dict[str, Any] | None = None
    index_problems: list[Exl3FormatError] = field(default_factory=list)
    _linears: dict[str, Exl3Linear] | None = field(default=None, repr=False)

    # -- opening --------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike) -> "Pack":
        root = Path(root)
        if not root.is_dir():
            raise Exl3FormatError(root, None, "a pack directory",
                                  "a file (give the folder that holds config.json and the *.safetensors)"
                                  if root.exists() else "no such file or directory")
        config = _checked_config(root / "config.json", read_json_object(root / "config.json"))
        sidecar_path = root / SIDECAR_FILE
        sidecar = _checked_sidecar(sidecar_path, read_json_object(sidecar_path)) if sidecar_path.exists() else None

        index_path = root / INDEX_FILE
        index_problems: list[Exl3FormatError] = []
        if index_path.exists():
            index = read_json_object(index_path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise Exl3FormatError(index_path, None, "a non-empty 'weight_map' object", repr(weight_map)[:80])
            for name, fname in weight_map.items():
                expect_type(fname, str, index_path, "a shard file name (a string) in weight_map", name)
                if not name or fname in ("", ".", ".."):
                    raise Exl3FormatError(index_path, name or None, "a tensor name and a shard file name in the "
                                          "pack directory", repr(fname)[:80])
            names = sorted(set(weight_map.values()))
            for fname in names:
                if not (root / fname).is_file():
                    missing = next(t for t, f in weight_map.items() if f == fname)
                    raise Exl3FormatError(index_path, missing, f"shard file '{fname}' named by the index to exist",
                                          "missing file")
            on_disk = {p.name for p in root.glob("*.safetensors")}
            for extra in sorted(on_disk - set(names)):
                # vLLM filters shards through the index: tensors in an unlisted file are silently never loaded.
                index_problems.append(Exl3FormatError(
                    root / extra, None, f"every *.safetensors file to be named in {INDEX_FILE}",
                    "a file the index omits (vLLM would silently skip its tensors)"))
            paths = [root / n for n in names]
        else:
            weight_map = None
            paths = sorted(root.glob("*.safetensors"))
            if not paths:
                raise Exl3FormatError(root, None, "at least one *.safetensors file", "none")

        files = [read_safetensors_header(p) for p in paths]
        tensors: dict[str, TensorRecord] = {}
        for f in files:
            for name, rec in f.tensors.items():
                if name in tensors:
                    raise Exl3FormatError(f.path, name, "each tensor in exactly one file",
                                          f"a duplicate also in {tensors[name].file.name}")
                tensors[name] = rec
        if weight_map is not None:
            for name, fname in weight_map.items():
                rec = tensors.get(name)
                if rec is None or rec.file.name != fname:
                    raise Exl3FormatError(root / fname, name, f"the tensor that {INDEX_FILE} places in this file",
                                          "not there" if rec is None else f"it is in {rec.file.name}")
        return cls(root, config, files, tensors, sidecar, index_problems)

    # -- configuration --------------------------------------------------------------------------------------
    @property
    def quantization_config(self) -> dict[str, Any]:
        qc = self.config.get("quantization_config")
        if qc is None and self.sidecar is not None:
            qc = self.sidecar
        return dict(qc or {})

    @property
    def text_config(self) -> dict[str, Any]:
        """Model dims (multimodal configs nest them under text_config)."""
        return self.config.get("text_config") or self.config

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else self.config.get("model_type", "unknown")

    # -- tensors --------------------------------------------------------------------------------------------
    def linears(self) -> dict[str, Exl3Linear]:
        """All EXL3 linears by module prefix, validated. Raises on the first malformed one."""
        if self._linears is None:
            self._linears = {p: build_linear(p, parts) for p, parts in group_exl3_tensors(self.tensors).items()}
        return self._linears

    def unquantized(self) -> dict[str, TensorRecord]:
        owned = {r.name for lin in self.linears().values() for r in lin.records}
        return {n: r for n, r in self.tensors.items() if n not in owned}

    def check_markers(self) -> None:
        """Read every codebook marker (4 bytes each) and check its value."""
        for lin in self.linears().values():
            problem = marker_problem(lin)
            if problem:
                raise problem

    def linear_problems(self, finite: bool = False) -> list[Exl3FormatError]:
        """Every problem with the EXL3 linears: their tensors, stray names beside them, markers, the codebook that
        the config and the sidecar's ledger declare, and (`finite`: reads suh/svh) non-finite scales."""
        linears, problems = {}, []
        groups = group_exl3_tensors(self.tensors)
        for prefix, parts in groups.items():
            try:
                linears[prefix] = build_linear(prefix, parts)
            except Exl3FormatError as e:
                problems.append(e)
        problems += unknown_suffix_problems(self.tensors, set(groups))
        problems += [p for p in map(marker_problem, linears.values()) if p]
        problems += self._codebook_problems(linears)
        if finite:
            problems += [p for p in map(scale_problem, linears.values()) if p]
        if not problems:
            self._linears = linears
        return problems

    def check(self, finite: bool = False) -> None:
        """Raise the first problem that would make the pack serve anything but exactly what it stores."""
        problems = self.index_problems + self.linear_problems(finite)
        if problems:
            raise problems[0]

    def _codebook_problems(self, linears: dict[str, Exl3Linear]) -> list[Exl3FormatError]:
        in_config = isinstance(self.config.get("quantization_config"), dict)
        qc_file = self.root / ("config.json" if in_config else SIDECAR_FILE)
        declared = self.quantization_config.get("codebook")
        problems = []
        if declared is not None and declared not in CODEBOOKS:
            return [Exl3FormatError(qc_file, None, f"quantization_config.codebook one of {', '.join(CODEBOOKS)}",
                                    repr(declared)[:80])]
        ledger = (self.sidecar or {}).get("tensor_storage") or {}
        for source, file, wanted in (("quantization_config.codebook", qc_file, lambda p: declared),
                                     ("the tensor_storage ledger", self.root / SIDECAR_FILE,
                                      lambda p: ledger_codebook(ledger.get(p)))):
            wrong = [(p, lin, wanted(p)) for p, lin in linears.items() if wanted(p) not in (None, lin.codebook)]
            if wrong:
                prefix, lin, codebook = wrong[0]
                more = f" (and {len(wrong) - 1} more linears)" if len(wrong) > 1 else ""
                problems.append(Exl3FormatError(
                    lin.trellis.file, (lin.marker or lin.trellis).name,
                    f"the {codebook} codebook that {source} ({file.name}) records for '{prefix}'",
                    f"tensors stored with the {lin.codebook} codebook (the marker decides; decoding as either "
                    f"would give wrong weights for one of them){more}"))
        return problems

    def logical_features(self, linear: Exl3Linear) -> tuple[int, int]:
        """Best guess of a linear's unpadded (in, out) features from the model config.

        The pack stores only padded geometry. A padded dim whose value is not itself a model dimension is
        mapped back to the unique config dimension that pads to it; otherwise the padded value stands.
        """
        dims = self._config_dims()

        def resolve(padded: int) -> int:
            if padded in dims:
                return padded
            cands = {d for d in dims if ceil_to(d) == padded}
            return cands.pop() if len(cands) == 1 else padded

        return resolve(linear.in_padded), resolve(linear.out_padded)

    def _config_dims(self) -> set[int]:
        tc = self.text_config
        dims = {tc.get(k) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                    "shared_expert_intermediate_size", "vocab_size", "q_lora_rank",
                                    "kv_lora_rank")}
        head_dim = tc.get("head_dim") or (tc.get("hidden_size", 0) // max(tc.get("num_attention_heads", 1), 1))
        for k in ("num_attention_heads", "num_key_value_heads"):
            if tc.get(k):
                dims.add(tc[k] * head_dim)
        return {d for d in dims if isinstance(d, int) and d > 0}


_CONFIG_INTS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                "vocab_size", "q_lora_rank", "kv_lora_rank", "head_dim", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers")


def _checked_config(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the types this package reads checked (a wrong type is a format error, not a crash)."""
    optional(config, "quantization_config", dict, path)
    optional(config, "model_type", str, path)
    archs = optional(config, "architectures", list, path)
    for a in archs or ():
        expect_type(a, str, path, "architectures as a list of strings")
    text = optional(config, "text_config", dict, path)
    for tc, where in ((config, ""), (text or {}, "text_config.")):
        optional(tc, "model_type", str, path, where)
        for key in _CONFIG_INTS:
            optional(tc, key, int, path, where)
    _checked_quantization(path, config.get("quantization_config") or {}, "quantization_config.")
    return config


def _checked_quantization(path: Path, qc: dict[str, Any], where: str) -> None:
    optional(qc, "quant_method", str, path, where)
    optional(qc, "codebook", str, path, where)


def _checked_sidecar(path: Path, sidecar: dict[str, Any]) -> dict[str, Any]:
    _checked_quantization(path, sidecar, "")
    ledger = optional(sidecar, "tensor_storage", dict, path) or {}
    for module, entry in ledger.items():
        expect_type(entry, dict, path, f"tensor_storage[{module!r}] as an object")
    return sidecar


def verify_pack(root: str | os.PathLike) -> tuple["Pack | None", list[Exl3FormatError]]:
    """Full structural validation: every file, every tensor. Collects every problem instead of stopping."""
    try:
        pack = Pack.open(root)
    except Exl3FormatError as e:
        return None, [e]
    problems = list(pack.index_problems)
    qc = pack.quantization_config
    if str(qc.get("quant_method", "")).lower() != "exl3":
        problems.append(Exl3FormatError(pack.root / "config.json", None,
                                        "quantization_config.quant_method 'exl3'", repr(qc.get("quant_method"))))
    problems += pack.linear_problems(finite=True)
    if not group_exl3_tensors(pack.tensors) and not problems:
        problems.append(Exl3FormatError(pack.root, None, "at least one EXL3 linear (a .trellis tensor)", "none"))
    return pack, problems

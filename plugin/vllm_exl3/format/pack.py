"""The EXL3 pack on disk: files, tensors, per-tensor bits and codebook, validation.

An EXL3 pack is a Hugging Face model directory whose quantized linears were replaced by ExLlamaV3's trellis
tensors (docs/format.md §1). Everything here reads only safetensors *headers*: listing or validating a pack of
any size costs a few kilobytes of I/O. Tensor bytes are read on demand (`read_tensor`).

Every problem with a pack raises `Exl3FormatError`, whose message names the file, the tensor and what was
expected, so a user can tell a truncated download from a wrong converter version.

Over 400 lines on purpose: `Pack` is the one object every gate asks (verify, inspect, preflight, the serve-time
index), and its checks share its parsed state (config, sidecar, ledger, linears); the per-tensor rules are
records.py's, the per-architecture tables architectures.py's, the quantization_config's contract.py's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .architectures import completeness
from .constants import CODEBOOKS, INDEX_FILE, SIDECAR_FILE
from .contract import Contract
from .errors import Exl3ConfigError, Exl3FormatError
from .families import ARCHITECTURES, family_of
from .family import Family
from .geometry import ceil_to
from .headers import DTYPES, SafetensorsFile, TensorRecord, read_safetensors_header
from .records import (EXPERT_RE, Exl3Linear, build_linear, group_exl3_tensors, ledger_codebook, marker_problem,
                      scale_problem, tensor_group, unknown_suffix_problems)
from .strict import expect_type, optional, read_json_object, read_pack_file

__all__ = ["Pack", "tensor_group", "verify_pack"]

# The longest file name Linux filesystems take (NAME_MAX): a longer shard name in the index is no file of the pack.
MAX_FILE_NAME_BYTES = 255
# Config keys naming the number of routed experts (architectures name it differently; two present must agree).
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
_TORCH_TO_DTYPE = {f"torch.{d.torch_name}": name for name, d in DTYPES.items()}  # the ledger's names -> ours
_LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# Files beside the weights that vLLM and transformers read at boot (when present): JSON objects, and others that
# need only be readable here (the tokenizer libraries parse them).
SIDE_JSON_FILES = ("generation_config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "preprocessor_config.json", "chat_template.json")
SIDE_TEXT_FILES = ("tokenizer.model", "merges.txt", "vocab.txt", "chat_template.jinja")


@dataclass
class Pack:
    """An EXL3 model directory, read header-only."""

    root: Path
    config: dict[str, Any]
    files: list[SafetensorsFile]
    tensors: dict[str, TensorRecord]
    sidecar: dict[str, Any] | None = None
    index_problems: list[Exl3FormatError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what `problems` could not check, and what it did
    _linears: dict[str, Exl3Linear] | None = field(default=None, repr=False)

    # -- opening --------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike) -> "Pack":
        root = Path(root)
        try:
            is_dir, exists = root.is_dir(), root.exists()
        except (OSError, ValueError) as e:  # a name too long, a NUL byte
            raise Exl3FormatError(root, None, "a pack directory", f"a path this system cannot open ({e})") from None
        if not is_dir:
            raise Exl3FormatError(root, None, "a pack directory",
                                  "a file (give the folder that holds config.json and the *.safetensors)"
                                  if exists else "no such file or directory")
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
                if not name or fname in ("", ".", "..") or "/" in fname or "\0" in fname:
                    raise Exl3FormatError(index_path, name or None, "a tensor name and the name of a shard file in "
                                          "the pack directory", repr(fname)[:80])
                size = len(fname.encode("utf-8", "surrogatepass"))
                if size > MAX_FILE_NAME_BYTES:
                    raise Exl3FormatError(index_path, name, f"a shard file name of at most {MAX_FILE_NAME_BYTES} "
                                          "bytes (longer is no file name)", f"{size} bytes")
            names = sorted(set(weight_map.values()))
            for fname in names:
                try:
                    present = (root / fname).is_file()
                except OSError as e:
                    raise Exl3FormatError(root / fname, None, "a shard file the index names",
                                          f"{type(e).__name__}: {e.strerror}") from None
                if not present:
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

    @property
    def family(self) -> Family | None:
        """The model family whose tables cover this pack's architecture (format/families/), None if none does."""
        return family_of(self.architecture)

    def mtp_missing(self) -> str | None:
        """What this pack lacks for vLLM's `mtp` speculative method (a draft from the pack's own MTP layers), as
        the architecture's table says (format/architectures.py); None when it has them, or when no table covers
        its architecture (vLLM decides)."""
        family = self.family
        if family is None:
            return None
        return family.architectures[self.architecture].mtp_missing(self.text_config, self.tensors)

    def mtp_storage(self) -> tuple[int, int]:
        """(MTP layers the config declares, bytes of the MTP layers' stored tensors, as stored): what vLLM's `mtp`
        drafter loads on top of the trunk; (0, 0) without MTP layers or a table for the architecture."""
        family = self.family
        if family is None or self.mtp_missing() is not None:
            return 0, 0
        arch = family.architectures[self.architecture]
        names = arch.mtp_tensors(self.text_config, self.tensors)
        return arch.mtp_layer_count(self.text_config), sum(self.tensors[n].nbytes for n in names)

    # -- tensors --------------------------------------------------------------------------------------------
    @property
    def has_exl3_tensors(self) -> bool:
        """Whether any tensor belongs to an EXL3 linear (a plain model has none: nothing else about it matters)."""
        return bool(group_exl3_tensors(self.tensors))

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

    def problems(self, finite: bool = False) -> list[Exl3FormatError]:
        """Every problem that would make the pack serve anything but exactly the model it stores: the index, the
        EXL3 linears (`finite`: their scales too), config values that break a model, the `quantization_config`
        contract against the tensors, the sidecar's ledger against the headers, and, when all of that holds, the
        tensors against the set the architecture has (`notes` says whether that could be checked)."""
        problems = self.index_problems + self.linear_problems(finite) + self.config_problems() + \
            self.ledger_problems() + self.dtype_problems() + self.side_file_problems()
        if self._linears is not None:
            problems += self.contract_problems(self._linears)
        self.notes = []
        if not problems:
            family = self.family
            found, note = completeness(self.root, self.architecture,
                                       family.architectures[self.architecture] if family else None, ARCHITECTURES,
                                       self.text_config, self.tensors, group_exl3_tensors(self.tensors),
                                       self._recorded())
            problems += found
            self.notes.append(note)
        return problems

    def check(self, finite: bool = False) -> None:
        """Raise the first of `problems`."""
        problems = self.problems(finite)
        if problems:
            raise problems[0]

    @property
    def quantization_config_file(self) -> Path:
        """The file `quantization_config` comes from: config.json, or the sidecar when config.json has none."""
        in_config = isinstance(self.config.get("quantization_config"), dict)
        return self.root / ("config.json" if in_config else SIDECAR_FILE)

    def side_file_problems(self) -> list[Exl3FormatError]:
        """The files beside the weights that vLLM and transformers read while booting (the tokenizer, the generation
        defaults): each one present is read as they will read it, so one they cannot read (unreadable, not a
        file, broken JSON, an integer of thousands of digits) is refused here, not minutes into the boot."""
        problems = []
        for name in SIDE_JSON_FILES + SIDE_TEXT_FILES:
            path = self.root / name
            if not os.path.lexists(path):
                continue
            try:
                if name in SIDE_JSON_FILES:
                    read_json_object(path, pack_integers=False)
                else:
                    read_pack_file(path, 0)  # its first byte: the tokenizer libraries parse the rest
            except Exl3FormatError as e:
                problems.append(e)
        return problems

    def config_problems(self) -> list[Exl3FormatError]:
        """Config values that type-check but make a model this pack cannot be: expert counts that disagree, a top-k
        of no expert or of more experts than exist, layers or experts the pack does not store (an uninitialised
        layer serves NaN, an expert index past the stored ones garbage)."""
        tc, path = self.text_config, self.root / "config.json"
        where = "text_config." if isinstance(self.config.get("text_config"), dict) else ""
        problems = []
        counts = {k: tc[k] for k in EXPERT_COUNT_KEYS if tc.get(k) is not None}
        if len(set(counts.values())) > 1:
            problems.append(Exl3FormatError(path, None, f"{' and '.join(where + k for k in counts)} to agree (each "
                                            "is the number of routed experts)",
                                            ", ".join(f"{k} = {v}" for k, v in counts.items())))
        experts = max(counts.values(), default=0)
        top_k = tc.get("num_experts_per_tok")
        if experts and top_k is not None and not 1 <= top_k <= experts:
            problems.append(Exl3FormatError(path, None, f"{where}num_experts_per_tok between 1 and the {experts} "
                                            "routed experts", str(top_k)))
        numbered = {n: int(m[1]) for n in self.tensors if (m := EXPERT_RE.search(n))}
        stored = set(numbered.values())
        if experts and stored and (max(stored) + 1 != experts or len(stored) != experts):
            beyond = sorted(n for n, e in numbered.items() if e >= experts)
            gap = next((e for e in range(min(experts, max(stored) + 1)) if e not in stored), max(stored) + 1)
            problems.append(Exl3FormatError(
                self.tensors[beyond[0]].file if beyond else path, beyond[0] if beyond else None,
                f"{where}{next(iter(counts))} = {experts} routed experts, numbered 0..{experts - 1} in the pack "
                f"({path.name})", f"a tensor of expert {numbered[beyond[0]]}" if beyond else
                f"no tensor of expert {gap} (the pack stores {len(stored)} numbered {min(stored)}..{max(stored)})"))
        layers = tc.get("num_hidden_layers")
        stored = {int(m[1]) for n in self.tensors if (m := _LAYER_IN_NAME.search(n))}
        if layers is not None and stored:
            empty = [i for i in range(min(layers, max(stored) + 1)) if i not in stored]
            if layers > max(stored) + 1 or empty:
                problems.append(Exl3FormatError(
                    path, None, f"{where}num_hidden_layers = {layers} layers, each with its tensors in the pack",
                    f"none of layer {empty[0] if empty else max(stored) + 1}"
                    f" (the pack stores {len(stored)} layers numbered {min(stored)}..{max(stored)})"))
        if self.family is not None:
            problems += self.family.config_problems(tc, path, where)
        return problems

    def contract_problems(self, linears: dict[str, Exl3Linear]) -> list[Exl3FormatError]:
        """The `quantization_config` contract, parsed and checked against the tensors as the plugin checks it when
        vLLM builds each layer (format/contract.py), so a malformed or contradicting key stops every gate."""
        qc = self.quantization_config
        if str(qc.get("quant_method") or "exl3").lower() != "exl3":
            return []  # not ours: `verify_pack` says so
        plain = {n[: -len(".weight")] for n in self.tensors if n.endswith(".weight")}
        try:
            Contract.parse(qc).check_pack(linears, plain)
        except Exl3ConfigError as e:
            return [Exl3FormatError(self.quantization_config_file, None,
                                    "a quantization_config that holds for this pack", str(e))]
        return []

    def _recorded(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The sidecar's `tensor_storage` ledger: module -> {tensor name: {shape, dtype, …}} (empty without one)."""
        ledger = (self.sidecar or {}).get("tensor_storage") or {}
        return {module: entry["stored_tensors"] for module, entry in ledger.items()
                if isinstance(entry.get("stored_tensors"), dict)}

    def ledger_problems(self) -> list[Exl3FormatError]:
        """The sidecar's `tensor_storage` ledger records each stored tensor's dtype and shape as the converter wrote
        it: a header that says otherwise (F16 relabelled BF16 or I16: the same bytes read as other numbers) is
        refused. (A recorded tensor the pack lacks is a completeness problem: `completeness`.)"""
        ledger = (self.sidecar or {}).get("tensor_storage") or {}
        path, problems = self.root / SIDECAR_FILE, []
        for module, entry in ledger.items():
            stored = entry.get("stored_tensors")
            if stored is not None and (not isinstance(stored, dict)
                                       or not all(isinstance(v, dict) for v in stored.values())):
                problems.append(Exl3FormatError(path, None, f"tensor_storage[{module!r}].stored_tensors as an object "
                                                "of {shape, dtype} objects", repr(stored)[:80]))
        if problems:
            return problems
        for name, recorded in ((n, r) for stored in self._recorded().values() for n, r in stored.items()):
            rec = self.tensors.get(name)
            if rec is None:
                continue
            dtype, shape = recorded.get("dtype"), recorded.get("shape")
            if dtype is not None and dtype != f"torch.{DTYPES[rec.dtype].torch_name}":
                problems.append(Exl3FormatError(
                    rec.file, name, f"the dtype {_TORCH_TO_DTYPE.get(dtype, repr(dtype))} that {SIDECAR_FILE}'s "
                    "tensor_storage ledger records", f"{rec.dtype} (the same bytes would be read as other numbers)"))
            if shape is not None and shape != list(rec.shape):
                problems.append(Exl3FormatError(rec.file, name, f"the shape {shape!r} that {SIDECAR_FILE}'s "
                                                "tensor_storage ledger records", str(list(rec.shape))))
        return problems

    def dtype_problems(self) -> list[Exl3FormatError]:
        """Dtypes the architecture implies, with or without the sidecar's ledger (most packs come without one): a
        header relabelled to another dtype of the same size reads the same bytes as other numbers. Norms,
        embeddings and biases are floating point; the embeddings and the decoder's norms keep the checkpoint's
        dtype (config.json's `dtype`: the converter copies them); and every tensor of a role (one name across the
        layers and experts) has the dtype most of them have."""
        problems: list[Exl3FormatError] = []
        source = _SOURCE_DTYPES.get(self.config.get("dtype") or self.config.get("torch_dtype")
                                    or self.text_config.get("dtype") or self.text_config.get("torch_dtype"))
        roles: dict[str, list[TensorRecord]] = {}
        for name, rec in sorted(self.tensors.items()):
            roles.setdefault(_NUMBERS.sub(".N.", f".{name}")[1:], []).append(rec)
            if _FLOATING_ROLE.search(name) and not DTYPES[rec.dtype].torch_name.startswith(("float", "bfloat")):
                problems.append(Exl3FormatError(rec.file, name, "a floating-point dtype (a norm, an embedding or a "
                                                "bias)", f"{rec.dtype} (the bytes would be read as integers)"))
            elif source and _SOURCE_ROLE.search(name) and rec.dtype != source:
                problems.append(Exl3FormatError(
                    rec.file, name, f"{source}, the checkpoint's dtype (config.json dtype) that embeddings and norms "
                    "keep", f"{rec.dtype} (the same bytes would be read as other numbers)"))
        flagged = {p.tensor for p in problems}
        for role, recs in roles.items():
            counts: dict[str, int] = {}
            for rec in recs:
                counts[rec.dtype] = counts.get(rec.dtype, 0) + 1
            common = max(counts, key=counts.__getitem__)
            if len(counts) == 1 or counts[common] * 2 <= len(recs):
                continue
            problems += [Exl3FormatError(rec.file, rec.name, f"{common}, the dtype of the other {counts[common]} "
                                         f"{role} tensors", f"{rec.dtype} (the same bytes would be read as other "
                                         "numbers)")
                         for rec in recs if rec.dtype != common and rec.name not in flagged]
        return problems

    def _codebook_problems(self, linears: dict[str, Exl3Linear]) -> list[Exl3FormatError]:
        qc_file = self.quantization_config_file
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
        dims = self._config_dims(linear.prefix)

        def resolve(padded: int) -> int:
            if padded in dims:
                return padded
            cands = {d for d in dims if ceil_to(d) == padded}
            return cands.pop() if len(cands) == 1 else padded

        return resolve(linear.in_padded), resolve(linear.out_padded)

    def _config_dims(self, prefix: str = "") -> set[int]:
        tc = self.text_config
        dims = {tc.get(k) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                    "shared_expert_intermediate_size", "vocab_size", "q_lora_rank",
                                    "kv_lora_rank")}
        head_dim = tc.get("head_dim") or (tc.get("hidden_size", 0) // max(tc.get("num_attention_heads", 1), 1))
        for k in ("num_attention_heads", "num_key_value_heads"):
            if tc.get(k):
                dims.add(tc[k] * head_dim)
        if ".linear_attn." in f"{prefix}.":  # the gated delta net's in_proj_qkv(z), in_proj_z, out_proj
            kd = _int(tc.get("linear_num_key_heads")) * _int(tc.get("linear_key_head_dim"))
            vd = _int(tc.get("linear_num_value_heads")) * _int(tc.get("linear_value_head_dim"))
            dims |= {vd, 2 * kd + vd, 2 * kd + 2 * vd} if kd and vd else set()
        elif ".self_attn." in prefix and tc.get("linear_num_key_heads") and tc.get("num_attention_heads"):
            dims.add(2 * tc["num_attention_heads"] * head_dim)  # their gated attention: q_proj holds q and its gate
        return {d for d in dims if isinstance(d, int) and d > 0}


_SOURCE_DTYPES = {"bfloat16": "BF16", "float16": "F16"}  # config dtype -> what embeddings and norms are stored as
# (a float32 checkpoint's may be narrowed to F16 by the converter: only the roles' agreement is checked then)
_SOURCE_ROLE = re.compile(r"(?:^|\.)(?:embed_tokens|input_layernorm|post_attention_layernorm)\.weight$"
                          r"|^model\.(?:language_model\.)?norm\.weight$")
_FLOATING_ROLE = re.compile(r"(?:norm|embed_tokens)\.weight$|(?:^|[._])bias$")
_NUMBERS = re.compile(r"\.\d+\.")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# Config integers this package reads, each with the least value a model can have (a string, a float, a bool or a
# negative count is a format error here, not a crash or a ZeroDivisionError in vLLM).
_CONFIG_INTS = {"hidden_size": 1, "intermediate_size": 0, "moe_intermediate_size": 0,
                "shared_expert_intermediate_size": 0, "vocab_size": 1, "q_lora_rank": 1, "kv_lora_rank": 1,
                "head_dim": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 1,
                "max_position_embeddings": 1, "num_experts": 0, "n_routed_experts": 0, "num_local_experts": 0,
                "num_experts_per_tok": 0, "first_k_dense_replace": 0, "decoder_sparse_step": 1, "n_shared_experts": 0,
                "num_nextn_predict_layers": 0}
_CONFIG_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_qk_norm")
_CONFIG_INT_LISTS = ("mlp_only_layers",)


def _checked_config(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the types (and least values) this package reads checked: a wrong one is a format error
    naming the key, not a crash."""
    optional(config, "quantization_config", dict, path)
    optional(config, "model_type", str, path)
    archs = optional(config, "architectures", list, path)
    for a in archs or ():
        expect_type(a, str, path, "architectures as a list of strings")
    text = optional(config, "text_config", dict, path)
    for tc, where in ((config, ""), (text or {}, "text_config.")):
        optional(tc, "model_type", str, path, where)
        for key, least in _CONFIG_INTS.items():
            value = optional(tc, key, int, path, where)
            if value is not None and value < least:
                raise Exl3FormatError(path, None, f"{where}{key} of at least {least}", str(value))
        for key in _CONFIG_BOOLS:
            optional(tc, key, bool, path, where)
        for key in _CONFIG_INT_LISTS:
            for item in optional(tc, key, list, path, where) or ():
                if expect_type(item, int, path, f"{where}{key} as a list of layer indices") < 0:
                    raise Exl3FormatError(path, None, f"{where}{key} as a list of layer indices", str(item))
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
    """Full validation, every file and tensor (`Pack.problems`, scales included), and the pack must be EXL3.
    Collects every problem instead of stopping; `pack.notes` says what completeness covered."""
    try:
        pack = Pack.open(root)
    except Exl3FormatError as e:
        return None, [e]
    problems = []
    qc = pack.quantization_config
    if str(qc.get("quant_method", "")).lower() != "exl3":
        problems.append(Exl3FormatError(pack.root / "config.json", None,
                                        "quantization_config.quant_method 'exl3'", repr(qc.get("quant_method"))))
    if not pack.has_exl3_tensors:  # a plain model: what else is wrong with it is beside the point
        return pack, pack.index_problems + problems + [
            Exl3FormatError(pack.root, None, "at least one EXL3 linear (a .trellis tensor)", "none")]
    return pack, problems + pack.problems(finite=True)

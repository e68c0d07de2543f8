"""`Exl3Config`: the `quantization_config` contract and the per-layer decision (EXL3 / plain / delegated).

Native ExLlamaV3 packs need nothing but `quant_method: exl3`: which linears are EXL3, and each one's bits,
codebook and padded geometry, are read from the pack's safetensors headers (`maybe_update_config`), never from
config keys. The extended contract other EXL3 tools write (prior-art.md) is honoured on top:

- `codebook`, `layer_bits` ({layer index: bits} for routed experts), `non_routed_exl3` (which dense linears are
  EXL3, long form by vLLM module prefix with `bits` / `bf16_shards`, short form by suffix): declarations that
  are *checked* against the tensors; a contradiction is an error, never a silent re-interpretation.
- `non_routed_quantization`: a vLLM quantization config serving the layers that carry no EXL3 tensors
  (e.g. block-FP8 dense layers of a DeepSeek pack).
- `non_routed_dtype_policy: "bf16_as_stored"`: dense layers without EXL3 tensors stay plain (unquantized) even
  when a `non_routed_quantization` delegate exists (it then serves only expert layers without EXL3 tensors).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..format.pack import (
    CODEBOOKS,
    SIDECAR_FILE,
    Exl3FormatError,
    Exl3Linear,
    Pack,
    TensorRecord,
    build_linear,
    group_exl3_tensors,
)

logger = logging.getLogger("vllm_exl3")

POLICY_BF16_AS_STORED = "bf16_as_stored"
POLICY_SOURCE_NATIVE = "official_source_native"  # dense layers in their source format -> the delegate
NON_ROUTED_POLICIES = ("", POLICY_BF16_AS_STORED, POLICY_SOURCE_NATIVE)


class Exl3ConfigError(ValueError):
    """A `quantization_config` that contradicts itself or the pack it describes."""


# ------------------------------------------------------------------------------------------------------------
# What the pack holds, by module prefix (checkpoint names, renamed to vLLM names by apply_vllm_mapper)
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearMeta:
    bits: float
    codebook: str
    in_padded: int
    out_padded: int
    legacy_signs: bool = False
    has_marker: bool = False

    @classmethod
    def of(cls, lin: Exl3Linear) -> "LinearMeta":
        return cls(lin.bits, lin.codebook, lin.in_padded, lin.out_padded, lin.legacy_signs, lin.marker is not None)


@dataclass
class PackIndex:
    exl3: dict[str, LinearMeta] = field(default_factory=dict)  # EXL3 linears
    plain: dict[str, tuple[int, ...]] = field(default_factory=dict)  # `<prefix>.weight` shapes of the rest

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
        def rename(d):
            out = {}
            for k, v in d.items():
                new = mapper.map_name(k)
                if new is not None:
                    out[new] = v
            return out

        return PackIndex(rename(self.exl3), rename(self.plain))


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
    """Read and validate the pack behind `model` (a local directory or a Hub id), headers only."""
    if os.path.isdir(model):
        pack = Pack.open(model)
        if pack.index_problems:
            raise pack.index_problems[0]
        pack.check_markers()
        return PackIndex.from_tensors(pack.tensors)
    try:
        tensors = _remote_tensors(model, revision)
    except Exception as e:  # noqa: BLE001 - any Hub failure is reported as "cannot index"
        raise Exl3FormatError(model, None, "a local pack directory or a Hub repository with safetensors",
                              f"{type(e).__name__}: {e}") from e
    return PackIndex.from_tensors(tensors)


# ------------------------------------------------------------------------------------------------------------
# The extended contract's `non_routed_exl3`
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseDeclaration:
    """What `non_routed_exl3` says about one vLLM module: EXL3 at `bits`, except the BF16 `bf16_shards`."""

    bits: float | None
    bf16_shards: tuple[int, ...] = ()


def _parse_non_routed_exl3(raw: Any) -> tuple[dict[str, DenseDeclaration], tuple[str, ...], float | None,
                                               dict[int, float]]:
    """-> (long form by prefix, short-form suffixes, short-form bits, short-form layer_bits)."""
    if raw is None:
        return {}, (), None, {}
    if not isinstance(raw, dict):
        raise Exl3ConfigError(f"non_routed_exl3 must be an object, got {type(raw).__name__}")
    layers = {}
    for prefix, spec in (raw.get("layers") or {}).items():
        if not isinstance(spec, dict):
            raise Exl3ConfigError(f"non_routed_exl3.layers[{prefix!r}] must be an object, got {spec!r}")
        bits = spec.get("bits")
        shards = spec.get("bf16_shards") or []
        if not all(isinstance(s, int) and s >= 0 for s in shards):
            raise Exl3ConfigError(f"non_routed_exl3.layers[{prefix!r}].bf16_shards must list shard indices, "
                                  f"got {shards!r}")
        layers[prefix] = DenseDeclaration(float(bits) if bits is not None else None, tuple(shards))
    modules = tuple(raw.get("modules") or ())
    bits = raw.get("bits")
    return layers, modules, (float(bits) if bits is not None else None), _parse_layer_bits(
        raw.get("layer_bits"), "non_routed_exl3.layer_bits")


def _parse_layer_bits(raw: Any, key: str) -> dict[int, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise Exl3ConfigError(f"{key} must map layer indices to bits, got {raw!r}")
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except (TypeError, ValueError) as e:
        raise Exl3ConfigError(f"{key} must map layer indices to bits, got {raw!r}") from e


def layer_index(prefix: str) -> int | None:
    for part in prefix.split("."):
        if part.isdigit():
            return int(part)
    return None


# ------------------------------------------------------------------------------------------------------------
# Parsed contract (independent of vLLM so it can be tested and used by the CLI)
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Contract:
    codebook: str | None = None
    bits: float | None = None  # informational: native packs write the *average* bpw here
    layer_bits: dict[int, float] = field(default_factory=dict)
    non_routed_quantization: dict[str, Any] | None = None
    non_routed_dtype_policy: str = ""
    dense_layers: dict[str, DenseDeclaration] = field(default_factory=dict)
    dense_modules: tuple[str, ...] = ()
    dense_bits: float | None = None
    dense_layer_bits: dict[int, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> "Contract":
        method = str(raw.get("quant_method", "exl3")).lower()
        if method != "exl3":
            raise Exl3ConfigError(f"quant_method must be 'exl3', got {method!r}")
        codebook = raw.get("codebook")
        if codebook is not None and codebook not in CODEBOOKS:
            raise Exl3ConfigError(f"codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")
        policy = str(raw.get("non_routed_dtype_policy") or "")
        if policy not in NON_ROUTED_POLICIES:
            raise Exl3ConfigError(f"non_routed_dtype_policy must be one of {[p for p in NON_ROUTED_POLICIES if p]}"
                                  f", got {policy!r}")
        delegate = raw.get("non_routed_quantization")
        if delegate is not None:
            if not isinstance(delegate, dict) or not delegate.get("quant_method"):
                raise Exl3ConfigError("non_routed_quantization must be a quantization_config object with a "
                                      f"quant_method, got {delegate!r}")
            if str(delegate["quant_method"]).lower() == "exl3":
                raise Exl3ConfigError("non_routed_quantization cannot itself be exl3")
        elif policy == POLICY_SOURCE_NATIVE:
            raise Exl3ConfigError(f"non_routed_dtype_policy {policy!r} needs non_routed_quantization to say "
                                  "which vLLM method serves the source-format layers")
        layers, modules, dense_bits, dense_layer_bits = _parse_non_routed_exl3(raw.get("non_routed_exl3"))
        bits = raw.get("bits")
        return cls(codebook=codebook, bits=float(bits) if bits is not None else None,
                   layer_bits=_parse_layer_bits(raw.get("layer_bits"), "layer_bits"),
                   non_routed_quantization=delegate, non_routed_dtype_policy=policy,
                   dense_layers=layers, dense_modules=modules, dense_bits=dense_bits,
                   dense_layer_bits=dense_layer_bits)

    # -- checks against the pack ----------------------------------------------------------------------------
    def check_codebooks(self, index: PackIndex) -> None:
        if self.codebook is None:
            return
        for name, meta in index.exl3.items():
            if meta.codebook != self.codebook:
                raise Exl3ConfigError(
                    f"quantization_config.codebook is {self.codebook!r} but '{name}' is stored with the "
                    f"{meta.codebook} codebook (its marker tensor decides; decoding it as {self.codebook} "
                    "would give wrong weights)")

    def check_expert_bits(self, layer_prefix: str, metas: list[tuple[str, LinearMeta]]) -> None:
        layer = layer_index(layer_prefix)
        declared = self.layer_bits.get(layer) if layer is not None else None
        if declared is None:
            return
        for name, meta in metas:
            if meta.bits != declared:
                raise Exl3ConfigError(f"layer_bits declares {declared:g} bits for layer "
                                      f"{layer_index(layer_prefix)} but '{name}' is stored at {meta.bits:g} bits")

    def dense_declaration(self, prefix: str, shard_names: list[str]) -> DenseDeclaration | None:
        """The `non_routed_exl3` entry covering the vLLM module `prefix` (long form wins), if any."""
        if prefix in self.dense_layers:
            return self.dense_layers[prefix]
        suffixes = [prefix.rsplit(".", 1)[-1]] + [s.rsplit(".", 1)[-1] for s in shard_names]
        if any(s in self.dense_modules for s in suffixes):
            layer = layer_index(prefix)
            bits = self.dense_layer_bits.get(layer, self.dense_bits) if layer is not None else self.dense_bits
            return DenseDeclaration(bits)
        return None

    def check_dense(self, prefix: str, shards: list[tuple[str, LinearMeta | None]]) -> None:
        decl = self.dense_declaration(prefix, [s for s, _ in shards])
        if decl is None:
            return
        for i, (name, meta) in enumerate(shards):
            if i in decl.bf16_shards:
                if meta is not None:
                    raise Exl3ConfigError(f"non_routed_exl3 lists shard {i} of '{prefix}' as BF16 but '{name}' "
                                          "carries EXL3 tensors")
                continue
            if meta is None:
                raise Exl3ConfigError(f"non_routed_exl3 declares '{prefix}' EXL3 but shard '{name}' has no "
                                      "EXL3 tensors (.trellis/.suh/.svh) in the pack")
            if decl.bits is not None and meta.bits != decl.bits:
                raise Exl3ConfigError(f"non_routed_exl3 declares {decl.bits:g} bits for '{prefix}' but "
                                      f"'{name}' is stored at {meta.bits:g} bits")



# ------------------------------------------------------------------------------------------------------------
# The vLLM quantization config
# ------------------------------------------------------------------------------------------------------------
from . import compat  # noqa: E402  (vLLM from here on)


class Exl3Config(compat.QuantizationConfig):
    """`quant_method: exl3`. Registered by `vllm_exl3.register()`; vLLM picks it from config.json."""

    def __init__(self, raw: dict[str, Any] | None = None):
        super().__init__()
        self.raw = dict(raw or {})
        self.contract = Contract.parse(self.raw)
        self.index: PackIndex | None = None
        self._delegate = None

    # -- vLLM's QuantizationConfig surface ------------------------------------------------------------------
    def get_name(self) -> str:
        return "exl3"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # mma.sync m16n8k16, cp.async (Ampere and newer; GB10 is 121)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [SIDECAR_FILE]  # only consulted when config.json carries no quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Exl3Config":
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Read the pack's headers: which linears are EXL3 and their bits/codebook/geometry.

        Runs while vLLM builds its config, before any weight is loaded: a broken pack stops the start here with
        our error naming the file and tensor."""
        try:
            self.index = index_model(model_name, revision)
            self.contract.check_codebooks(self.index)
        except (Exl3FormatError, Exl3ConfigError) as e:
            logger.error("EXL3 pack %s cannot be served: %s", model_name, e)
            raise
        n_experts = sum(1 for k in self.index.exl3 if ".experts." in k)
        logger.info("EXL3 pack %s: %d EXL3 linears (%d routed-expert projections)", model_name,
                    len(self.index.exl3), n_experts)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.index is not None:
            self.index = self.index.renamed(hf_to_vllm_mapper)

    # -- per-layer decision ---------------------------------------------------------------------------------
    @property
    def delegate(self):
        if self._delegate is None and self.contract.non_routed_quantization is not None:
            cfg = dict(self.contract.non_routed_quantization)
            cls = compat.get_quantization_config(str(cfg["quant_method"]).lower())
            self._delegate = cls.from_config(cfg)
            self._delegate.packed_modules_mapping = self.packed_modules_mapping
        return self._delegate

    def _require_index(self, prefix: str) -> PackIndex:
        if self.index is None:
            raise Exl3ConfigError(f"{prefix}: the EXL3 pack was never indexed (maybe_update_config did not run)")
        return self.index

    def _shards(self, prefix: str) -> tuple[list[str], list]:
        """Checkpoint prefixes and vLLM shard ids of the linears fused into vLLM module `prefix`."""
        head, _, proj = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(proj)
        if not parts:
            return [prefix], [None]
        names = [f"{head}.{p}" if head else p for p in parts]
        ids = ["q", "k", "v"] if proj == "qkv_proj" and len(parts) == 3 else list(range(len(parts)))
        return names, ids

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from .linear import Exl3LinearMethod
        from .moe import Exl3MoEMethod

        if isinstance(layer, compat.RoutedExperts):
            index = self._require_index(prefix)
            names = {(e, p): f"{prefix}.{e}.{ckpt}" for e in range(layer.global_num_experts)
                     for p, ckpt in enumerate((layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name,
                                               layer.ckpt_down_proj_name))}
            metas = {k: index.exl3.get(n) for k, n in names.items()}
            present = [k for k, m in metas.items() if m is not None]
            if not present:
                return self.delegate.get_quant_method(layer, prefix) if self.delegate else None
            if len(present) != len(metas):
                missing = [names[k] for k, m in metas.items() if m is None]
                raise Exl3FormatError(None, missing[0], f"EXL3 tensors for every expert projection of {prefix}",
                                      f"{len(missing)} projections without them (e.g. {', '.join(missing[:3])})")
            self.contract.check_expert_bits(prefix, [(names[k], metas[k]) for k in present])
            return Exl3MoEMethod(layer.moe_config, prefix, names, metas)

        if isinstance(layer, (compat.LinearBase, compat.ParallelLMHead)):
            index = self._require_index(prefix)
            names, ids = self._shards(prefix)
            metas = [index.exl3.get(n) for n in names]
            self.contract.check_dense(prefix, list(zip(names, metas)))
            if any(m is not None for m in metas):
                return Exl3LinearMethod(prefix, names, ids, metas, [index.plain.get(n) for n in names])
            if compat.is_lm_head(layer):
                return self._plain_head(layer, index.plain.get(prefix))
            if self.contract.non_routed_dtype_policy != POLICY_BF16_AS_STORED and self.delegate is not None:
                return self.delegate.get_quant_method(layer, prefix)
            return compat.UnquantizedLinearMethod()

        if self.delegate is not None and compat.is_attention(layer):
            return self.delegate.get_quant_method(layer, prefix)
        return None

    @staticmethod
    def _plain_head(layer, stored_shape):
        """An unquantized head keeps ExLlamaV3's padded input columns (exl3-format.md §E.2): drop them."""
        if stored_shape is None or len(stored_shape) != 2 or stored_shape[1] == layer.embedding_dim:
            return None  # vLLM's own unquantized embedding method
        from .lm_head import PaddedHeadMethod

        return PaddedHeadMethod(layer.embedding_dim, stored_shape[1])

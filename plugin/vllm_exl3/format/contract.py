"""The `quantization_config` contract, parsed and checked against a pack's index (independent of vLLM, so the CLI
and tests use it too). Which keys exist and what they mean: `integration/config.py`'s docstring. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .constants import CODEBOOKS
from .errors import Exl3ConfigError
from .records import tensor_group

if TYPE_CHECKING:
    from .index import LinearMeta

POLICY_BF16_AS_STORED = "bf16_as_stored"
POLICY_SOURCE_NATIVE = "official_source_native"  # dense layers in their source format -> the delegate
NON_ROUTED_POLICIES = ("", POLICY_BF16_AS_STORED, POLICY_SOURCE_NATIVE)
# vLLM fuses these checkpoint linears into one module (its models' packed_modules_mapping): a long-form
# `non_routed_exl3` entry names the fused module, its `bf16_shards` index these shards in this order.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_NON_ROUTED_EXL3_KEYS = ("layers", "modules", "bits", "layer_bits")
_LAYER_SPEC_KEYS = ("bits", "bf16_shards")


@dataclass(frozen=True)
class DenseDeclaration:
    """What `non_routed_exl3` says about one vLLM module: EXL3 at `bits`, except the BF16 `bf16_shards`."""

    bits: float | None
    bf16_shards: tuple[int, ...] = ()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bits(value: Any, key: str) -> float | None:
    """A declared bit width: a finite positive number (a string, a bool or NaN is a malformed config)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise Exl3ConfigError(f"{key} must be a positive number of bits, got {_short(value)}")
    return float(value)


def _mapping(value: Any, key: str, what: str, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Exl3ConfigError(f"{key} must be {what}, got {_short(value)}")
    unknown = sorted(set(value) - set(keys)) if keys is not None else []
    if unknown:  # a misspelt key would silently declare nothing
        raise Exl3ConfigError(f"{key} has unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(keys)}")
    return value


def _parse_non_routed_exl3(raw: Any) -> tuple[dict[str, DenseDeclaration], tuple[str, ...], float | None,
                                               dict[int, float]]:
    """-> (long form by prefix, short-form suffixes, short-form bits, short-form layer_bits)."""
    raw = _mapping(raw, "non_routed_exl3", "an object", _NON_ROUTED_EXL3_KEYS)
    layers = {}
    for prefix, spec in _mapping(raw.get("layers"), "non_routed_exl3.layers", "an object of vLLM modules").items():
        key = f"non_routed_exl3.layers[{prefix!r}]"
        spec = _mapping(spec, key, "an object {bits, bf16_shards}", _LAYER_SPEC_KEYS)
        shards = spec.get("bf16_shards") or []
        if not isinstance(shards, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                   for s in shards):
            raise Exl3ConfigError(f"{key}.bf16_shards must list shard indices, got {_short(shards)}")
        layers[prefix] = DenseDeclaration(_bits(spec.get("bits"), f"{key}.bits"), tuple(shards))
    modules = raw.get("modules") or []
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise Exl3ConfigError(f"non_routed_exl3.modules must list module names (e.g. [\"q_proj\", \"o_proj\"]), "
                              f"got {_short(modules)}")
    return layers, tuple(modules), _bits(raw.get("bits"), "non_routed_exl3.bits"), _parse_layer_bits(
        raw.get("layer_bits"), "non_routed_exl3.layer_bits")


def _parse_layer_bits(raw: Any, key: str) -> dict[int, float]:
    out = {}
    for k, v in _mapping(raw, key, "an object mapping layer indices to bits").items():
        if not (k.isascii() and k.isdigit()):
            raise Exl3ConfigError(f"{key} must map layer indices to bits, got the key {_short(k)}")
        out[int(k)] = _bits(v, f"{key}[{k!r}]")
    return out


def layer_index(prefix: str) -> int | None:
    for part in prefix.split("."):
        if part.isdigit():
            return int(part)
    return None


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
        """The contract from a `quantization_config` object; every malformed value is an `Exl3ConfigError` naming
        the key (never a TypeError or ValueError from deep inside)."""
        if not isinstance(raw, dict):
            raise Exl3ConfigError(f"quantization_config must be an object, got {_short(raw)}")
        for key in ("quant_method", "codebook", "non_routed_dtype_policy"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise Exl3ConfigError(f"{key} must be a string, got {_short(raw[key])}")
        method = (raw.get("quant_method") or "exl3").lower()
        if method != "exl3":
            raise Exl3ConfigError(f"quant_method must be 'exl3', got {method!r}")
        codebook = raw.get("codebook")
        if codebook is not None and codebook not in CODEBOOKS:
            raise Exl3ConfigError(f"codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")
        policy = raw.get("non_routed_dtype_policy") or ""
        if policy not in NON_ROUTED_POLICIES:
            raise Exl3ConfigError(f"non_routed_dtype_policy must be one of {[p for p in NON_ROUTED_POLICIES if p]}"
                                  f", got {policy!r}")
        delegate = raw.get("non_routed_quantization")
        if delegate is not None:
            method = delegate.get("quant_method") if isinstance(delegate, dict) else None
            if not isinstance(method, str) or not method:
                raise Exl3ConfigError("non_routed_quantization must be a quantization_config object with a "
                                      f"quant_method, got {_short(delegate)}")
            if method.lower() == "exl3":
                raise Exl3ConfigError("non_routed_quantization cannot itself be exl3")
        elif policy == POLICY_SOURCE_NATIVE:
            raise Exl3ConfigError(f"non_routed_dtype_policy {policy!r} needs non_routed_quantization to say "
                                  "which vLLM method serves the source-format layers")
        layers, modules, dense_bits, dense_layer_bits = _parse_non_routed_exl3(raw.get("non_routed_exl3"))
        _bits(raw.get("head_bits"), "head_bits")  # informational, but a malformed value is a malformed config
        return cls(codebook=codebook, bits=_bits(raw.get("bits"), "bits"),
                   layer_bits=_parse_layer_bits(raw.get("layer_bits"), "layer_bits"),
                   non_routed_quantization=delegate, non_routed_dtype_policy=policy,
                   dense_layers=layers, dense_modules=modules, dense_bits=dense_bits,
                   dense_layer_bits=dense_layer_bits)

    # -- checks against the pack ----------------------------------------------------------------------------
    def check_pack(self, linears: Mapping[str, "LinearMeta"], plain: set[str]) -> None:
        """Every declaration against the stored tensors, by checkpoint name (`linears`: the EXL3 linears, with bits
        and codebook; `plain`: prefixes of plain `.weight`s): the codebook, the routed experts' `layer_bits`, and
        `non_routed_exl3` for each checkpoint linear (short form) and each fused module of the long form whose
        shards the pack stores (a long-form name vLLM renames is checked when vLLM builds the layer)."""
        self.check_codebooks(linears)
        by_layer: dict[str, list] = {}
        for name, meta in linears.items():
            if tensor_group(name) == "experts":
                by_layer.setdefault(name.rsplit(".experts.", 1)[0], []).append((name, meta))
        for prefix, metas in by_layer.items():
            self.check_expert_bits(prefix, metas)
        stored = set(linears) | plain
        modules: dict[str, list[str]] = {}  # vLLM module -> its checkpoint shards, as vLLM builds them
        for name in sorted(stored):
            if tensor_group(name) == "experts":
                continue
            head, _, proj = name.rpartition(".")
            fused = next((f for f, shards in FUSED_MODULES.items() if proj in shards), None)
            shards = [f"{head}.{p}" if head else p for p in FUSED_MODULES[fused]] if fused else []
            if fused and all(s in stored for s in shards):
                modules[f"{head}.{fused}" if head else fused] = shards
            else:
                modules[name] = [name]
        for prefix in self.dense_layers:  # long-form names that are not vLLM's fused ones: as written
            modules.setdefault(prefix, [prefix])
        for module, shards in modules.items():
            if any(s in stored for s in shards):
                self.check_dense(module, [(s, linears.get(s)) for s in shards])

    def check_codebooks(self, linears: Mapping[str, "LinearMeta"]) -> None:
        if self.codebook is None:
            return
        for name, meta in linears.items():
            if meta.codebook != self.codebook:
                raise Exl3ConfigError(
                    f"quantization_config.codebook is {self.codebook!r} but '{name}' is stored with the "
                    f"{meta.codebook} codebook (its marker tensor decides; decoding it as {self.codebook} "
                    "would give wrong weights)")

    def check_expert_bits(self, layer_prefix: str, metas: list[tuple[str, "LinearMeta"]]) -> None:
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

    def check_dense(self, prefix: str, shards: list[tuple[str, "LinearMeta | None"]]) -> None:
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

"""The `quantization_config` contract, parsed and checked against a pack's index (independent of vLLM, so the CLI
and tests use it too). Which keys exist and what they mean: `integration/config.py`'s docstring. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .constants import CODEBOOKS
from .index import LinearMeta, PackIndex

POLICY_BF16_AS_STORED = "bf16_as_stored"
POLICY_SOURCE_NATIVE = "official_source_native"  # dense layers in their source format -> the delegate
NON_ROUTED_POLICIES = ("", POLICY_BF16_AS_STORED, POLICY_SOURCE_NATIVE)


class Exl3ConfigError(ValueError):
    """A `quantization_config` that contradicts itself or the pack it describes."""


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

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
from typing import Any

import torch

from ..format.architectures import NOT_CHECKED
from ..format.constants import SIDECAR_FILE
from ..format.contract import POLICY_BF16_AS_STORED, Contract, layer_index
from ..format.errors import Exl3ConfigError, Exl3FormatError
from ..format.geometry import ceil_to
from ..format.index import PackIndex, index_model
from ..kernels.selection import router_gate_on
from ..kernels.specs import PROJECTIONS
from . import compat, compile_key, families, mla

logger = logging.getLogger(__name__)




def parse_contract(raw: Any) -> Contract:
    """The contract (format/contract.py), and what only vLLM can say of it: the `non_routed_quantization`
    delegate names a method this vLLM has. Otherwise the first layer it serves fails minutes into the load with
    vLLM's "Invalid quantization method"; preflight and `vllm-exl3 serve` ask this before the boot
    (integration/vllm_cli.py)."""
    contract = Contract.parse(raw)
    delegate = contract.non_routed_quantization
    if delegate is not None:
        method = str(delegate["quant_method"]).lower()
        if method not in compat.QUANTIZATION_METHODS:
            raise Exl3ConfigError(f"non_routed_quantization: quant_method {method!r} is not a quantization method "
                                  "of this vLLM (`vllm serve --help` lists them under --quantization)")
    return contract


MTP_PREFIX = "mtp."  # Qwen3-Next's and Qwen3.5/3.6's MTP module, beside the trunk (format/families/qwen3_next.py)


def mtp_layer(prefix: str, num_layers: int | None) -> str | None:
    """Which MTP layer vLLM module `prefix` is in ("MTP layer N" past num_hidden_layers, GLM's layout; "MTP module
    mtp" under `mtp.`), None for the trunk's modules (or when num_hidden_layers is unknown)."""
    if prefix.startswith(MTP_PREFIX):
        return "MTP module mtp"
    layer = layer_index(prefix)
    if num_layers is None or layer is None or layer < num_layers:
        return None
    return f"MTP layer {layer}"


class Exl3Config(compat.QuantizationConfig):
    """`quant_method: exl3`. Registered by `vllm_exl3.register()`; vLLM picks it from config.json."""

    def __init__(self, raw: dict[str, Any] | None = None):
        super().__init__()
        self.raw = dict(raw or {})
        # A malformed contract is reported by `maybe_update_config`, which vLLM calls right after this and which
        # knows the pack: for a local pack the same problem comes out of the pack check naming the file.
        try:
            self.contract, self._contract_error = parse_contract(self.raw), None
        except Exl3ConfigError as e:
            self.contract, self._contract_error = Contract(), e
        self.index: PackIndex | None = None
        self._num_layers: int | None = None  # the config's num_hidden_layers (maybe_update_config)
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
            text = getattr(hf_config, "get_text_config", lambda: hf_config)() if hf_config is not None else None
            layers = getattr(text, "num_hidden_layers", None)
            self._num_layers = layers if isinstance(layers, int) else None
            architectures = getattr(hf_config, "architectures", None) or []
            if architectures:
                self.index = families.under_vllm_prefixes(self.index, architectures[0])
            if self._contract_error is not None:
                raise self._contract_error
            self.contract.check_codebooks(self.index.exl3)
        except (Exl3FormatError, Exl3ConfigError) as e:
            logger.error("EXL3 pack %s cannot be served: %s", model_name, e)
            raise
        for note in self.index.notes:
            logger.log(logging.WARNING if note.startswith(NOT_CHECKED) else logging.INFO,
                       "EXL3 pack %s: %s", model_name, note)
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

    def _shards(self, prefix: str, layer=None) -> tuple[list[str], list]:
        """Checkpoint prefixes and vLLM shard ids of the linears fused into vLLM module `prefix`."""
        head, _, proj = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(proj)
        if not parts:
            return [prefix], [None]
        names = [f"{head}.{p}" if head else p for p in parts]
        if proj == "qkv_proj" and len(parts) == 3:
            return names, ["q", "k", "v"]
        sizes = getattr(layer, "output_sizes", None)
        if sizes is not None and len(sizes) != len(parts):
            return names, self._stacked_ids(prefix, names, sizes)
        return names, list(range(len(parts)))

    def _stacked_ids(self, prefix: str, names: list[str], sizes: list[int]) -> list:
        """Shard ids of checkpoint linears that each fill one or more consecutive `output_sizes` entries of a merged
        layer (vLLM's stacked weights mapper passes a tuple for several: Qwen3.5's `in_proj_qkv` is (0, 1, 2) of
        `in_proj_qkvz`, `in_proj_z` is 3). Found from the widths the pack stores: the one split of `sizes` into
        consecutive runs whose sums match every linear (an EXL3 linear stores its width padded to 128)."""
        index = self._require_index(prefix)
        if not any(n in index.exl3 for n in names):
            return list(range(len(names)))  # served plain by vLLM's own method, which needs no ids from us
        widths = []
        for n in names:
            if (meta := index.exl3.get(n)) is not None:
                widths.append((meta.out_padded, True))
            elif (shape := index.plain.get(n)) is not None:
                widths.append((shape[0], False))
            else:
                raise Exl3FormatError(None, n, f"an EXL3 linear or a plain .weight (a part of {prefix})", "none")

        def splits(i: int, k: int) -> list[list[tuple[int, int]]]:
            if k == len(names):
                return [[]] if i == len(sizes) else []
            out = []
            for j in range(i + 1, len(sizes) + 1):
                total, padded = sum(sizes[i:j]), widths[k][1]
                if (ceil_to(total) if padded else total) == widths[k][0]:
                    out += [[(i, j)] + rest for rest in splits(j, k + 1)]
            return out

        found = splits(0, 0)
        if len(found) != 1:
            raise Exl3FormatError(None, prefix, f"one way to place {', '.join(names)} (widths "
                                  f"{[w for w, _ in widths]}) on vLLM's output sizes {list(sizes)}",
                                  f"{len(found)} ways")
        return [i if j == i + 1 else tuple(range(i, j)) for i, j in found[0]]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from .linear import Exl3LinearMethod
        from .moe import Exl3MoEMethod

        if self._contract_error is not None:  # never built on a contract that did not parse
            raise self._contract_error
        compile_key.capture(compat.current_vllm_config())

        if isinstance(layer, compat.RoutedExperts):
            index = self._require_index(prefix)
            names = {(e, p): f"{prefix}.{e}.{ckpt}" for e in range(layer.global_num_experts)
                     for p, ckpt in zip(PROJECTIONS, (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name,
                                                      layer.ckpt_down_proj_name))}
            metas = {k: index.exl3.get(n) for k, n in names.items()}
            present = [k for k, m in metas.items() if m is not None]
            if not present:
                self._require_draft_tensors(prefix, list(names.values()))
                return self.delegate.get_quant_method(layer, prefix) if self.delegate else None
            if len(present) != len(metas):
                missing = [names[k] for k, m in metas.items() if m is None]
                raise Exl3FormatError(None, missing[0], f"EXL3 tensors for every expert projection of {prefix}",
                                      f"{len(missing)} projections without them (e.g. {', '.join(missing[:3])})")
            self.contract.check_expert_bits(prefix, [(names[k], metas[k]) for k in present])
            method = Exl3MoEMethod(layer.moe_config, prefix, names, metas)
            method.last_block = self._in_last_block(prefix)
            return method

        if isinstance(layer, (compat.LinearBase, compat.ParallelLMHead)):
            index = self._require_index(prefix)
            names, ids = self._shards(prefix, layer)
            metas = [index.exl3.get(n) for n in names]
            self.contract.check_dense(prefix, list(zip(names, metas)))
            if any(m is not None for m in metas):
                method = Exl3LinearMethod(prefix, names, ids, metas, [index.plain.get(n) for n in names])
                method.last_block = self._in_last_block(prefix)
                method.decode_at_load = mla.decoded_at_load(prefix, compat.current_vllm_config())
                return method
            if compat.is_lm_head(layer):
                return self._plain_head(layer, index.plain.get(prefix))
            self._require_draft_tensors(prefix, names)
            if self.contract.non_routed_dtype_policy != POLICY_BF16_AS_STORED and self.delegate is not None:
                return self.delegate.get_quant_method(layer, prefix)
            if compat.is_router_gate(layer) and router_gate_on():
                from .router_gate import RouterGateMethod

                return RouterGateMethod(prefix, self._in_last_block(prefix))
            return compat.UnquantizedLinearMethod()

        if self.delegate is not None and compat.is_attention(layer):
            return self.delegate.get_quant_method(layer, prefix)
        return None

    def _require_draft_tensors(self, prefix: str, names: list[str]) -> None:
        """A layer past num_hidden_layers (GLM's layout) or under `mtp.` (Qwen3-Next's, Qwen3.5's) is one of the
        pack's MTP layers, built only by vLLM's `mtp` drafter: served plain when the pack stores plain weights for it,
        but never from nothing. Without a tensor for it, vLLM would load nothing into it and draft with the memory it
        allocated (drafts never accepted, silently); the preflight's check (format/architectures.py mtp_missing)
        looks for the MTP layers' marks, not for each of their linears."""
        index = self._require_index(prefix)
        where = mtp_layer(prefix, self._num_layers)
        if where is None:
            return
        if not any(n in index.exl3 or n in index.plain for n in names):
            raise Exl3FormatError(None, prefix, f"tensors for this linear of {where} (EXL3, or a plain "
                                  f"{names[0]}.weight), which vLLM's mtp drafter builds",
                                  "none in the pack: the draft would run on uninitialised weights")

    def _in_last_block(self, prefix: str) -> bool:
        """Is `prefix` in the highest-numbered served block holding EXL3 tensors (the parity gate checks all of it)?
        Layers past num_hidden_layers (multi-token prediction) are built only by vLLM's `mtp` drafter: not them."""
        if not hasattr(self, "_last_block"):
            served = self._num_layers if self._num_layers is not None else float("inf")
            found = [layer_index(n) for n in self._require_index(prefix).exl3 if not n.startswith(MTP_PREFIX)]
            found = [i for i in found if i is not None and i < served]
            self._last_block = max(found) if found else None
        return self._last_block is not None and not prefix.startswith(MTP_PREFIX) \
            and layer_index(prefix) == self._last_block

    @staticmethod
    def _plain_head(layer, stored_shape):
        """An unquantized head keeps ExLlamaV3's padded input columns (docs/format.md §5.2): drop them."""
        if stored_shape is None or len(stored_shape) != 2 or stored_shape[1] == layer.embedding_dim:
            return None  # vLLM's own unquantized embedding method
        from .lm_head import PaddedHeadMethod

        return PaddedHeadMethod(layer.embedding_dim, stored_shape[1])

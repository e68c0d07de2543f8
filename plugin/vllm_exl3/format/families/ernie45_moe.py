"""ERNIE-4.5-MoE (ERNIE-4.5-21B-A3B, 300B-A47B): MoE layers from `moe_layer_start_index` to `moe_layer_end_index`
every `moe_layer_interval`, shared experts, a softmax router whose correction bias (`moe_statics`) only picks."""

from __future__ import annotations

from ..architectures import Architecture, Flag, linear, plain
from ..family import COMMON, Family, Key
from .common import GATED, HEAD, MLP, NORMS, attention

_BIAS = Flag("use_bias")

ERNIE45_MOE = Architecture(
    HEAD, NORMS + attention(_BIAS, _BIAS), MLP,
    sparse_mlp=(linear("mlp.gate"),
                *(linear(f"mlp.shared_experts.{p}", present=Flag("moe_num_shared_experts")) for p in GATED),
                plain("mlp.moe_statics", "e_score_correction_bias", optional=True),
                plain("mlp.gate", "e_score_correction_bias", optional=True)),
    expert=GATED, experts_keys=("moe_num_experts",), dense_first_key="moe_layer_start_index",
    dense_after_key="moe_layer_end_index", sparse_every_key="moe_layer_interval", sparse_every_offset=1)

FAMILY = Family(
    "ERNIE-4.5-MoE", {"Ernie4_5_MoeForCausalLM": ERNIE45_MOE},
    COMMON + (Key("moe_num_experts", least=1, required=True, reads="vLLM's Ernie4_5_Moe"),
              Key("moe_k", least=1, required=True, reads="vLLM's Ernie4_5_Moe router"),
              Key("moe_layer_interval", least=1, reads="vLLM's Ernie4_5_Moe")),
    examples=("ERNIE-4.5-21B-A3B-PT", "ERNIE-4.5-300B-A47B-PT"),
    notes=("ExLlamaV3 1.6.5 packs hold no routing correction bias (moe_statics): experts are picked by the "
           "softmax scores alone, as ExLlamaV3 serves them",))

"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM): dense first layers, routed experts with a sigmoid router
and its correction bias, shared experts, partial rotary; MTP layers after the last may be stored."""

from __future__ import annotations

from ..architectures import Architecture, Flag, linear, plain
from ..family import COMMON, GROUPED, TOP_K, Family, GroupedRouting, Key
from .common import ATTENTION_BIAS, GATED, HEAD, MLP, MTP_MARKS, NORMS, attention

FAMILY = Family(
    "GLM-4.5", {"Glm4MoeForCausalLM": Architecture(
        HEAD, NORMS + attention(ATTENTION_BIAS, False, qk_norm=Flag("use_qk_norm")), MLP,
        sparse_mlp=(linear("mlp.gate"), plain("mlp.gate", "e_score_correction_bias"),
                    *(linear(f"mlp.shared_experts.{p}", present=Flag("n_shared_experts")) for p in GATED)),
        expert=GATED, experts_keys=("n_routed_experts",), dense_first_key="first_k_dense_replace",
        spare_layers_key="num_nextn_predict_layers", spare_layer_marks=MTP_MARKS)},
    COMMON + GROUPED + (TOP_K, Key("first_k_dense_replace", least=0, required=True, reads="vLLM's Glm4Moe")),
    examples=("GLM-4.5-Air", "GLM-4.6", "GLM-4.5"),
    rules=(GroupedRouting("n_routed_experts"),))

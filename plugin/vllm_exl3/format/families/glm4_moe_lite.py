"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM): multi-head latent attention (MLA: q_a/q_b with a norm between them, or
one q_proj without `q_lora_rank`; kv_a_proj_with_mqa, its norm, kv_b_proj), dense first layers, routed experts with
a sigmoid router and correction bias, shared experts; MTP layers after the last may be stored.

ExLlamaV3 1.6.5 stores kv_b_proj plain and the other projections as EXL3 linears; a pack that quantizes kv_b_proj is
served too (vLLM's MLA then gets its weight decoded once at load)."""

from __future__ import annotations

from ..architectures import Architecture, Flag, Not, linear, plain
from ..family import COMMON, GROUPED, TOP_K, Family, GroupedRouting, Key
from .common import GATED, HEAD, MLP, MTP_MARKS, NORMS

_Q_LORA = Flag("q_lora_rank")


def leading_dense_layers(types: list) -> int | None:
    """`first_k_dense_replace` (that many dense layers, then sparse ones: the released checkpoints' key, the one vLLM
    0.33's Glm4MoeLite reads) from newer transformers' per-layer `mlp_layer_types`; None where the list is not
    dense layers followed by sparse ones, a layout Glm4MoeLite does not build."""
    dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    return dense if all(t == "sparse" for t in types[dense:]) else None


def _dense_layers_from_types(config) -> str | None:
    """For a config without `first_k_dense_replace`: the value to add, or why none fits."""
    types = config.get("mlp_layer_types")
    if not isinstance(types, list) or not types:
        return None
    dense = leading_dense_layers(types)
    if dense is None:
        return (f"none, and its mlp_layer_types {types!r} is not dense layers followed by sparse ones, the only "
                "layout vLLM's Glm4MoeLite builds")
    return (f"none; its mlp_layer_types (newer transformers' form, which vLLM's Glm4MoeLite does not read) has "
            f'{dense} leading dense layer{"s" if dense != 1 else ""}: add "first_k_dense_replace": {dense}')


MLA = (linear("self_attn.q_a_proj", present=_Q_LORA), plain("self_attn.q_a_layernorm", present=_Q_LORA),
       linear("self_attn.q_b_proj", present=_Q_LORA), linear("self_attn.q_proj", present=Not(_Q_LORA)),
       linear("self_attn.kv_a_proj_with_mqa"), plain("self_attn.kv_a_layernorm"), linear("self_attn.kv_b_proj"),
       linear("self_attn.o_proj"))

FAMILY = Family(
    "GLM-4.7-Flash", {"Glm4MoeLiteForCausalLM": Architecture(
        HEAD, NORMS + MLA, MLP,
        sparse_mlp=(linear("mlp.gate"), plain("mlp.gate", "e_score_correction_bias"),
                    *(linear(f"mlp.shared_experts.{p}", present=Flag("n_shared_experts")) for p in GATED)),
        expert=GATED, experts_keys=("n_routed_experts",), dense_first_key="first_k_dense_replace",
        spare_layers_key="num_nextn_predict_layers", spare_layer_marks=MTP_MARKS)},
    COMMON + GROUPED + (TOP_K, Key("first_k_dense_replace", least=0, required=True, reads="vLLM's Glm4MoeLite",
                             missing=_dense_layers_from_types),
              Key("kv_lora_rank", least=1, required=True, reads="vLLM's MLA attention"),
              Key("qk_nope_head_dim", least=1, required=True, reads="vLLM's MLA attention"),
              Key("qk_rope_head_dim", least=1, required=True, reads="vLLM's MLA attention"),
              Key("v_head_dim", least=1, required=True, reads="vLLM's MLA attention")),
    examples=("GLM-4.7-Flash",),
    rules=(GroupedRouting("n_routed_experts"),))

# The only latent width (kv_lora_rank + qk_rope_head_dim: 512 + 64, the released models') vLLM 0.33's MLA kernels
# take, on the GPU and in its CPU build. A pack with another latent (tools/exl3-packs' tiny GLM-4.7-Flash models:
# 128 + 32) is served by vLLM's per-head attention instead (VLLM_MLA_DISABLE=1).
MLA_KERNEL_LATENT = 576


def mla_kernels_take(config: dict) -> bool:
    """Whether vLLM's MLA kernels take this config's latent (true for a config without MLA)."""
    if "kv_lora_rank" not in config:
        return True
    return config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0) == MLA_KERNEL_LATENT

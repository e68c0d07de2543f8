"""Table pieces several families share: the head, the norms, attention, the dense MLP."""

from __future__ import annotations

from ..architectures import All, Condition, Flag, Module, linear, plain

HEAD = (plain("model.embed_tokens"), plain("model.norm"), linear("lm_head", optional=Flag("tie_word_embeddings")))
NORMS = (plain("input_layernorm"), plain("post_attention_layernorm"))
MLP = (linear("mlp.gate_proj"), linear("mlp.up_proj"), linear("mlp.down_proj"))
GATED = ("gate_proj", "up_proj", "down_proj")  # an expert's (or a shared expert's) projections
ATTENTION_BIAS = Flag("attention_bias")
MTP_MARKS = ("eh_proj", "enorm", "hnorm")  # what a GLM MTP layer (num_nextn_predict_layers) has beside a decoder's


def attention(qkv_bias: Condition, o_bias: Condition, qk_norm: Condition = False,
              present: Condition = True) -> tuple[Module, ...]:
    """q, k, v, o (and q/k norms where `qk_norm` holds) of layers where `present` holds."""
    norm = qk_norm if present is True else All((qk_norm, present))
    return (linear("self_attn.q_proj", qkv_bias, present), linear("self_attn.k_proj", qkv_bias, present),
            linear("self_attn.v_proj", qkv_bias, present), linear("self_attn.o_proj", o_bias, present),
            plain("self_attn.q_norm", present=norm), plain("self_attn.k_norm", present=norm))

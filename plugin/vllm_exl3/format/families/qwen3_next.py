"""Qwen3-Next (Qwen3-Next-80B-A3B) and Qwen3.5 / Qwen3.6 MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B): hybrid layers —
gated delta net ("linear_attention") and, every `full_attention_interval`-th layer, gated attention (q_proj twice
as wide: query and gate) — routed experts beside a shared expert behind a sigmoid gate.

The two differ in the delta net's input projections: Qwen3-Next stores `in_proj_qkvz` (q, k, v, z interleaved per
key-head group) and `in_proj_ba`; Qwen3.5 stores `in_proj_qkv`, `in_proj_z`, `in_proj_a` and `in_proj_b`, under
`model.language_model` (its conditional-generation packs keep the vision tower under `model.visual`, and MTP
modules under `mtp`: other parts of the model, not checked here)."""

from __future__ import annotations

from ..architectures import Architecture, Flag, LayerType, linear, plain
from ..family import COMMON, TOP_K, Family, Key
from .common import GATED, MLP, NORMS, attention

_FULL = LayerType("full_attention", "full_attention_interval", every="full_attention")
_LINEAR = LayerType("linear_attention", "full_attention_interval", every="full_attention")
_SHARED = Flag("shared_expert_intermediate_size")
_DELTA_NET = (plain("linear_attn.conv1d", present=_LINEAR), plain("linear_attn", "A_log", "dt_bias", present=_LINEAR),
              plain("linear_attn.norm", present=_LINEAR), linear("linear_attn.out_proj", present=_LINEAR))
_SPARSE = (linear("mlp.gate"), *(linear(f"mlp.shared_expert.{p}", present=_SHARED) for p in GATED),
           linear("mlp.shared_expert_gate", present=_SHARED))


def _hybrid(head_prefix: str, layers: str, in_proj: tuple[str, ...], spare: tuple[str, ...],
            mtp_key: str) -> Architecture:
    """`mtp_key`: where vLLM's MTP drafter (Qwen3NextMTP, Qwen3_5MoeMTP) reads the number of the `mtp.` layers."""
    head = (plain(f"{head_prefix}.embed_tokens"), plain(f"{head_prefix}.norm"),
            linear("lm_head", optional=Flag("tie_word_embeddings")))
    return Architecture(
        head, NORMS + attention(False, False, qk_norm=True, present=_FULL)
        + tuple(linear(f"linear_attn.{p}", present=_LINEAR) for p in in_proj) + _DELTA_NET, MLP,
        sparse_mlp=_SPARSE, expert=GATED, experts_keys=("num_experts",), dense_list_key="mlp_only_layers",
        sparse_every_key="decoder_sparse_step", sparse_every_offset=1, layers=layers, spare_prefixes=spare,
        mtp_prefixes=("mtp.",), mtp_key=mtp_key)


_LINEAR_KEYS = tuple(Key(k, least=1, required=True, reads="vLLM's gated delta net") for k in (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim"))
_MOE_KEYS = (TOP_K, Key("num_experts", least=1, required=True, reads="vLLM's Qwen3-Next MoE"),
             Key("moe_intermediate_size", least=1, required=True, reads="vLLM's Qwen3-Next MoE"))

QWEN3_NEXT = Family(
    "Qwen3-Next", {"Qwen3NextForCausalLM": _hybrid("model", "model.layers", ("in_proj_qkvz", "in_proj_ba"), (),
                                             "num_nextn_predict_layers")},
    COMMON + _LINEAR_KEYS + _MOE_KEYS, examples=("Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B-Thinking"))

_QWEN35 = _hybrid("model.language_model", "model.language_model.layers",
                  ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"), ("model.visual.",),
                  "mtp_num_hidden_layers")
QWEN3_5_MOE = Family(
    "Qwen3.5-MoE", {"Qwen3_5MoeForCausalLM": _QWEN35, "Qwen3_5MoeForConditionalGeneration": _QWEN35},
    COMMON + _LINEAR_KEYS + _MOE_KEYS, examples=("Qwen3.5-35B-A3B", "Qwen3.6-35B-A3B", "Qwen3.5-122B-A10B"),
    notes=("the vision tower (model.visual) and MTP modules are served as vLLM loads them: their tensors are not "
           "checked here",))

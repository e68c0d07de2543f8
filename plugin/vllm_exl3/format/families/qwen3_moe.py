"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): routed experts, optionally a shared expert
behind a sigmoid gate, q/k norms."""

from __future__ import annotations

from ..architectures import Architecture, Flag, linear, plain
from ..family import COMMON, TOP_K, Family, Key
from .common import ATTENTION_BIAS, GATED, HEAD, MLP, NORMS, attention

_SHARED = Flag("shared_expert_intermediate_size")

QWEN3_MOE = Architecture(
    HEAD, NORMS + attention(ATTENTION_BIAS, ATTENTION_BIAS, qk_norm=True), MLP,
    sparse_mlp=(linear("mlp.gate"), *(linear(f"mlp.shared_expert.{p}", present=_SHARED) for p in GATED),
                plain("mlp.shared_expert_gate", present=_SHARED)),
    expert=GATED, experts_keys=("num_experts", "num_local_experts"), dense_list_key="mlp_only_layers",
    sparse_every_key="decoder_sparse_step", sparse_every_offset=1)

FAMILY = Family(
    "Qwen3-MoE", {"Qwen3MoeForCausalLM": QWEN3_MOE},
    COMMON + (TOP_K, Key("moe_intermediate_size", least=1, required=True, reads="vLLM's Qwen3MoE experts")),
    examples=("Qwen3-30B-A3B", "Qwen3-Coder-30B-A3B-Instruct", "Qwen3-235B-A22B"))

"""Mixtral (Mixtral-8x7B, 8x22B): every layer routes, softmax router, experts named w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from ..architectures import Architecture, linear
from ..family import COMMON, TOP_K, Family, Key
from .common import HEAD, NORMS, attention

W_GATE_DOWN_UP = ("w1", "w2", "w3")  # Mixtral's names of an expert's gate, down and up projections

MIXTRAL = Architecture(
    HEAD, NORMS + attention(False, False), (), sparse_mlp=(linear("block_sparse_moe.gate"),),
    expert=W_GATE_DOWN_UP, experts_keys=("num_local_experts", "num_experts"), experts_path="block_sparse_moe.experts")

FAMILY = Family(
    "Mixtral", {"MixtralForCausalLM": MIXTRAL},
    COMMON + (TOP_K, Key("num_local_experts", least=1, required=True, reads="vLLM's Mixtral")),
    examples=("Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x22B-Instruct-v0.1"))

"""MiniMax-M2 (230B total, 10B active): Mixtral's names (block_sparse_moe, w1/w2/w3), a sigmoid router with a
routing correction bias, q/k RMSNorm over all heads at once, partial rotary given as `rotary_dim`.

ExLlamaV3 1.6.5 reads the correction bias as `block_sparse_moe.gate.e_score_correction_bias`, while MiniMax-M2
checkpoints store `block_sparse_moe.e_score_correction_bias`: its converter writes none, and its router then picks
experts by the sigmoid scores alone. The plugin serves such a pack the same way (no correction); a pack that holds
the bias under the checkpoints' name is served with it (vLLM loads no other name: ExLlamaV3's is refused as a tensor
this model does not have)."""

from __future__ import annotations

from ..architectures import Architecture, linear, plain
from ..family import COMMON, TOP_K, Family, Key
from .common import HEAD, NORMS, attention
from .mixtral import W_GATE_DOWN_UP

MINIMAX_M2 = Architecture(
    HEAD, NORMS + attention(False, False, qk_norm=True), (),
    sparse_mlp=(linear("block_sparse_moe.gate"), plain("block_sparse_moe", "e_score_correction_bias", optional=True)),
    expert=W_GATE_DOWN_UP, experts_keys=("num_local_experts", "num_experts"), experts_path="block_sparse_moe.experts")

FAMILY = Family(
    "MiniMax-M2", {"MiniMaxM2ForCausalLM": MINIMAX_M2},
    COMMON + (TOP_K, Key("num_local_experts", least=1, required=True, reads="vLLM's MiniMaxM2"),
              Key("rotary_dim", least=1, required=True, reads="vLLM's MiniMaxM2 attention (partial rotary)"),
              Key("scoring_func", kinds=(str,), choices=("sigmoid", "softmax"), required=True,
                  reads="vLLM's MiniMaxM2 router")),
    examples=("MiniMax-M2", "MiniMax-M2.1"),
    notes=("ExLlamaV3 1.6.5 packs hold no routing correction bias (its converter looks under another name): "
           "experts are picked by the sigmoid scores alone, as ExLlamaV3 serves them",))

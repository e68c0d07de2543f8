"""Dense decoders (no routed experts) whose EXL3 packs the plugin serves: Llama, Mistral, Qwen2, Qwen3."""

from __future__ import annotations

from ..architectures import Architecture, Flag, linear
from ..family import COMMON, Family
from .common import ATTENTION_BIAS, HEAD, MLP, NORMS, attention

_LLAMA = Architecture(HEAD, NORMS + attention(ATTENTION_BIAS, ATTENTION_BIAS),
                      tuple(linear(m.name, Flag("mlp_bias")) for m in MLP))

FAMILIES = (
    Family("Llama / Mistral", {"LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA}, COMMON),
    Family("Qwen2", {"Qwen2ForCausalLM": Architecture(HEAD, NORMS + attention(True, False), MLP)}, COMMON),
    Family("Qwen3", {"Qwen3ForCausalLM": Architecture(
        HEAD, NORMS + attention(ATTENTION_BIAS, ATTENTION_BIAS, qk_norm=True), MLP)}, COMMON),
)

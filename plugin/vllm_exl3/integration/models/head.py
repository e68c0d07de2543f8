"""The LM head of a vLLM model class that builds it without the quantization config."""

from __future__ import annotations

from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import maybe_prefix


def exl3_head(model, quant_config, prefix: str) -> ParallelLMHead:
    """The head vLLM built without `quant_config`, built again with it (so `Exl3Config.get_quant_method` gives it the
    EXL3 linear method, or the padded-head method, as every model that passes its quant_config to the head gets).
    The unquantized [vocab, hidden] weight is released first; no weight has been loaded yet."""
    config = model.config
    model.lm_head = None
    return ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                          prefix=maybe_prefix(prefix, "lm_head"))

"""Model classes the plugin registers over vLLM's own, for architectures whose vLLM class cannot hold an EXL3 pack.

vLLM's `Qwen3NextForCausalLM` (models/qwen3_next.py, `__init__`) builds its `ParallelLMHead` without the quantization
config, so the pack's EXL3 head (`lm_head.trellis`, `.suh`, `.svh`, marker) has no parameters to load into ("There is
no module or parameter named 'lm_head.mul1'"). The subclass here is vLLM's class with, only when the model is served
with `quantization: exl3`, the head built again with the config (so `Exl3Config.get_quant_method` gives it the EXL3
linear method, as every other vLLM model that passes its quant_config to the head gets). Any other quantization, or
none, gets vLLM's class unchanged.

Registered by `register.register_models` (see there) as `vllm_exl3.integration.models:<class>`: this module imports
vLLM's model module, so only vLLM's registry imports it, when it resolves the architecture.
"""

from __future__ import annotations

from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from .config import Exl3Config


def _exl3_head(model, quant_config, prefix: str) -> ParallelLMHead:
    """The head vLLM built without `quant_config`, built again with it. The unquantized [vocab, hidden] weight is
    released first; no weight has been loaded yet."""
    config = model.config
    model.lm_head = None
    return ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                          prefix=maybe_prefix(prefix, "lm_head"))


class Exl3Qwen3NextForCausalLM(Qwen3NextForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if isinstance(vllm_config.quant_config, Exl3Config):
            self.lm_head = _exl3_head(self, vllm_config.quant_config, prefix)

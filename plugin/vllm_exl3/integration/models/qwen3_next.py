"""Qwen3-Next: vLLM's `Qwen3NextForCausalLM` (models/qwen3_next.py, `__init__`) builds its `ParallelLMHead` without
the quantization config, so the pack's EXL3 head (`lm_head.trellis`, `.suh`, `.svh`, marker) has no parameters to
load into ("There is no module or parameter named 'lm_head.mul1'"). Here the head is built again with the config,
only under `quantization: exl3`."""

from __future__ import annotations

from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from ..config import Exl3Config
from .head import exl3_head


class Exl3Qwen3NextForCausalLM(Qwen3NextForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if isinstance(vllm_config.quant_config, Exl3Config):
            self.lm_head = exl3_head(self, vllm_config.quant_config, prefix)

"""Qwen3.5/3.6-MoE's MTP drafter (`--speculative-config '{"method": "mtp", ...}'`): vLLM's `Qwen3_5MoeMTP`
(models/qwen3_5_mtp.py) builds every linear of the pack's `mtp.` module through the quantization config under the
checkpoint's own names (`mtp.fc`, `mtp.layers.N.…`; its loader renames `mtp.` to `model.` in the parameter names,
not in the prefixes), so `Exl3Config.get_quant_method` serves each as the pack stores it: EXL3 where it stores EXL3
tensors (ExLlamaV3 1.6.5: fc, attention, shared expert and routed experts at `mtp_bits`), vLLM's unquantized
method where it stores a plain weight (the router, `shared_expert_gate`; every linear at `--mtp_bits 16`). Nothing
to rebuild, unlike GLM's eh_proj (integration/models/glm4_moe_mtp.py); this class only adds, once loaded, the log
line GLM's drafter writes: per MTP layer, which linears run EXL3 and which plain (`mtp.fc` on the first)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MoeMTP

from ..config import Exl3Config
from .glm4_moe_mtp import stored_as

logger = logging.getLogger(__name__)


class Exl3Qwen3_5MoeMTP(Qwen3_5MoeMTP):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        if isinstance(self.quant_config, Exl3Config):
            fc_exl3, fc_plain = stored_as(self.model.fc)
            for idx, layer in enumerate(self.model.layers):
                exl3, plain = stored_as(layer)
                if idx == 0:
                    exl3, plain = fc_exl3 + exl3, fc_plain + plain
                logger.info("EXL3 MTP layer %s: EXL3 %s; plain %s", idx, ", ".join(exl3) or "none",
                            ", ".join(plain) or "none")
        return loaded

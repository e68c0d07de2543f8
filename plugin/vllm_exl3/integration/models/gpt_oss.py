"""gpt-oss: vLLM's `GptOssForCausalLM` (models/gpt_oss.py) builds its `ParallelLMHead` without the quantization
config (the pack's EXL3 head would have nowhere to load), and its loader knows the experts only as fused 3-D tensors
(`experts.gate_up_proj`, MXFP4 blocks, ...): ExLlamaV3 stores one linear per expert and projection
(`experts.<e>.gate_proj.trellis`, ...), which its loader passes over without a word (a name it does not know is
skipped), leaving every expert unloaded. Here, only under `quantization: exl3`, the head is built with the config
and each expert's tensors go to the plugin's MoE layer's own loader (integration/moe.py), as vLLM's loader hands
other models' per-expert tensors to it; everything else loads as vLLM's class loads it."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

from ..config import Exl3Config
from ..moe import SHARD_PROJECTION
from .head import exl3_head

_EXPERT_TENSOR = re.compile(r"^(?P<stem>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                            r"\.(?P<suffix>\w+)$")
_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # vLLM's expert shard ids (SHARD_PROJECTION)
assert {SHARD_PROJECTION[s] for s in _SHARD.values()} == {"gate", "up", "down"}


class Exl3GptOssForCausalLM(GptOssForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._exl3 = isinstance(vllm_config.quant_config, Exl3Config)
        if self._exl3:
            self.lm_head = exl3_head(self, vllm_config.quant_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if not self._exl3:
            return super().load_weights(weights)
        params = dict(self.named_parameters())
        routed: set[str] = set()

        def others():
            for name, tensor in weights:
                target = self._expert_param(params, name)
                if target is None:
                    yield name, tensor
                    continue
                param_name, shard_id, expert = target
                param = params[param_name]
                param.weight_loader(param, tensor, weight_name=param_name, shard_id=shard_id, expert_id=expert)
                routed.add(param_name)

        return super().load_weights(others()) | routed

    @staticmethod
    def _expert_param(params: dict[str, torch.nn.Parameter], name: str) -> tuple[str, str, int] | None:
        """(the MoE layer's parameter, vLLM's shard id, the expert) a per-expert tensor of the pack goes to, None for
        any other tensor."""
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            return None
        stem = "w2" if m["proj"] == "down_proj" else "w13"
        for layer in (f"{m['stem']}.routed_experts", m["stem"]):  # vLLM's MoE runner holds the experts' layer
            param_name = f"{layer}.{stem}_{m['suffix']}"
            if param_name in params:
                return param_name, _SHARD[m["proj"]], int(m["expert"])
        return None

"""GLM-4.5's MTP drafter (`--speculative-config '{"method": "mtp", ...}'`): vLLM's `Glm4MoeMTP`
(models/glm4_moe_mtp.py) builds each MTP layer's `eh_proj` as a torch `nn.Linear`, outside the quantization config.
A pack whose eh_proj is an EXL3 linear (the layout docs/speculative.md describes) then has nowhere to load it: vLLM's
worker stops with `KeyError: 'model.layers.N.eh_proj.mcg'`. Here, only under `quantization: exl3`, eh_proj is built
again as vLLM's ReplicatedLinear with the config and the checkpoint's own prefix, so `Exl3Config.get_quant_method`
gives it the EXL3 method when the pack stores it EXL3 and vLLM's unquantized method when it stores a plain weight.

Every other layer of the drafter already gets the config under the checkpoint's names: vLLM builds the MTP layer's
decoder block with the prefix `model.layers.N` (its loader adds `.mtp_block` to the parameter names, not to the
prefix), with N from the target's config (the drafter is built with the target's VllmConfig, so `self.config` is the
target's: GLM-4.7-Flash's draft config says num_hidden_layers 0, which only its layer construction reads), and
shares the target's embedding and LM head with the draft after loading (v1/spec_decode). Once loaded, one log line
per MTP layer says which of its linears run EXL3 and which plain: what the pack stores, nothing else."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.glm4_moe_mtp import Glm4MoeMTP
from vllm.model_executor.models.utils import maybe_prefix

from .. import compat
from ..config import Exl3Config
from ..linear import Exl3LinearMethod
from ..moe import Exl3MoEMethod

logger = logging.getLogger(__name__)


class Exl3MtpEhProj:
    """Mixed in before vLLM's GLM drafter class (this module's and integration/models/glm4_moe_lite_mtp.py's): under
    `quantization: exl3`, each MTP layer's eh_proj built through the config, and the log line once loaded."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        quant_config = vllm_config.quant_config
        self._exl3 = isinstance(quant_config, Exl3Config)
        if not self._exl3:
            return
        hidden = self.config.hidden_size
        for idx, layer in self.model.layers.items():  # keyed by the checkpoint's layer number (num_hidden_layers...)
            layer.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False, quant_config=quant_config,
                                             prefix=f"{maybe_prefix(prefix, 'model')}.layers.{idx}.eh_proj",
                                             return_bias=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        if self._exl3:
            for idx, layer in self.model.layers.items():
                exl3, plain = stored_as(layer)
                logger.info("EXL3 MTP layer %s: EXL3 %s; plain %s", idx, ", ".join(exl3) or "none",
                            ", ".join(plain) or "none")
        return loaded


class Exl3Glm4MoeMTP(Exl3MtpEhProj, Glm4MoeMTP):
    pass


def stored_as(module: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The linears (and routed experts) under `module`, by their quantization prefix: those the plugin's EXL3
    methods serve, and those vLLM's unquantized methods serve."""
    exl3, plain = [], []
    for sub in module.modules():
        if not isinstance(sub, (compat.LinearBase, compat.RoutedExperts)):
            continue
        method = sub.quant_method
        if isinstance(method, (Exl3LinearMethod, Exl3MoEMethod)):
            exl3.append(method.prefix)
        else:
            plain.append(getattr(sub, "prefix", None) or getattr(sub, "layer_name", None) or type(sub).__name__)
    return exl3, plain

"""GLM-4.7-Flash's MTP drafter: vLLM's `Glm4MoeLiteMTP` (models/glm4_moe_lite_mtp.py) builds each MTP layer's
`eh_proj` as a torch `nn.Linear`, as GLM-4.5's drafter does, and an EXL3 eh_proj stops the load the same way
(`KeyError: 'model.layers.N.eh_proj.mcg'`): the same remedy (integration/models/glm4_moe_mtp.py)."""

from __future__ import annotations

from vllm.model_executor.models.glm4_moe_lite_mtp import Glm4MoeLiteMTP

from .glm4_moe_mtp import Exl3MtpEhProj


class Exl3Glm4MoeLiteMTP(Exl3MtpEhProj, Glm4MoeLiteMTP):
    pass

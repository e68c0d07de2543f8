"""What `vllm_exl3.register()` does once vLLM has loaded the plugin: the version gate, the quantization config,
the custom ops, the parallel model loader and the model classes that replace vLLM's for some architectures."""

from __future__ import annotations

# architecture -> the plugin's class (each module of integration/models/ says why), as `module:class` so that vLLM's
# registry imports it (and vLLM's model module under it) only when it resolves that architecture.
MODEL_OVERRIDES = {
    "Qwen3NextForCausalLM": "vllm_exl3.integration.models.qwen3_next:Exl3Qwen3NextForCausalLM",
    "GptOssForCausalLM": "vllm_exl3.integration.models.gpt_oss:Exl3GptOssForCausalLM",
    "Glm4MoeMTPModel": "vllm_exl3.integration.models.glm4_moe_mtp:Exl3Glm4MoeMTP",  # GLM-4.5's `mtp` drafter
    "Glm4MoeLiteMTPModel": "vllm_exl3.integration.models.glm4_moe_lite_mtp:Exl3Glm4MoeLiteMTP",  # GLM-4.7-Flash's
    "Qwen3_5MoeMTP": "vllm_exl3.integration.models.qwen3_5_mtp:Exl3Qwen3_5MoeMTP",  # Qwen3.5/3.6-MoE's (log line)
}


def register_all() -> None:
    from . import compat  # fails here, with the supported range, on an unsupported vLLM
    from ..kernels import ops  # noqa: F401  (registers the vllm_exl3:: custom ops)
    from .config import Exl3Config
    from .model_loader import register_loader

    compat.register_quantization_config("exl3")(Exl3Config)
    register_loader()
    register_models()


def register_models() -> None:
    """Runs in every vLLM process (vLLM's general plugin hook: API server, engine core, every worker, and the registry's
    model-inspection subprocess). `ModelRegistry.register_model` overwrites an architecture vLLM already has (a
    debug-level log line); our classes behave as vLLM's unless the model is served with `quantization: exl3`."""
    from vllm import ModelRegistry

    for arch, target in MODEL_OVERRIDES.items():
        ModelRegistry.register_model(arch, target)

"""What `vllm_exl3.register()` does once vLLM has loaded the plugin: the version gate, the quantization config,
the custom ops and the parallel model loader."""

from __future__ import annotations


def register_all() -> None:
    from . import compat  # fails here, with the supported range, on an unsupported vLLM
    from ..kernels import ops  # noqa: F401  (registers the vllm_exl3:: custom ops)
    from .config import Exl3Config
    from .model_loader import register_loader

    compat.register_quantization_config("exl3")(Exl3Config)
    register_loader()

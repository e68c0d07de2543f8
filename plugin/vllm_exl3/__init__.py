"""vLLM plugin for EXL3 (ExLlamaV3 trellis) quantized models."""

__version__ = "0.1.0"


def register() -> None:
    """`vllm.general_plugins` entry point (registration of the `exl3` quant method lands with the plugin)."""
    from .model_loader import register_loader

    register_loader()

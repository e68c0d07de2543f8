"""vLLM plugin for EXL3 (ExLlamaV3 trellis) quantized models."""

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """`vllm.general_plugins` entry point: vLLM calls it in every process (API server, engine core, every
    worker, both nodes of a multi-node run), so it must be idempotent and cheap."""
    global _registered
    if _registered:
        return
    _attach_logging()
    from .integration.register import register_all

    register_all()
    _registered = True


def _attach_logging() -> None:
    """Show our log lines next to vLLM's (vLLM configures only its own `vllm` logger)."""
    import logging
    import os

    log = logging.getLogger("vllm_exl3")
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("VLLM_EXL3_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "INFO")).upper())
    log.propagate = False

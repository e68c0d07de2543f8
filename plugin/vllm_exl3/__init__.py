"""vLLM plugin for EXL3 (ExLlamaV3 trellis) quantized models."""

from .base.version import __version__

__all__ = ["__version__", "register"]

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

    from .base import settings

    log = logging.getLogger(__name__)  # the package's logger: every module's logger is its child
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel((settings.get("VLLM_EXL3_LOGGING_LEVEL") or os.environ.get("VLLM_LOGGING_LEVEL") or "INFO").upper())
    log.propagate = False

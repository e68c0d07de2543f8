"""Which kernel backends exist: every backend module imported once (each adds itself to interface.REGISTRY), and a
backend by name. The backend modules import interface.py, never this module, so importing them here makes no cycle
(the import-linter contracts in pyproject.toml keep it so)."""

from __future__ import annotations

import logging

from .interface import REGISTRY, Backend

logger = logging.getLogger(__name__)

__all__ = ["REGISTRY", "get_backend", "load_backends"]


def get_backend(name: str) -> Backend:
    load_backends()
    return REGISTRY[name]


_backends_loaded = False


def load_backends() -> None:
    """Import every backend module once (each registers itself), whatever was imported before."""
    global _backends_loaded
    if _backends_loaded:
        return
    _backends_loaded = True
    from .backends import torch_ref as torch_backend  # noqa: F401  (registers "torch")

    for module in ("backends.native", "backends.exllamav3"):
        try:
            __import__(f"{__package__}.{module}")
        except ImportError as e:  # a backend module itself must import; its *library* may be missing
            logger.debug("backend module %s not importable: %s", module, e)

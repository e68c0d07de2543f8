"""Where a process importing vLLM's qwen3_5 modules needs the torchvision stand-in (qwen3_vl_imports/sitecustomize.py
says why): one rule for every test that serves, inspects or imports a Qwen3.5 model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

STAND_IN = Path(__file__).resolve().parent / "qwen3_vl_imports"  # a folder: its sitecustomize.py runs at start-up


def needed() -> bool:
    return importlib.util.find_spec("torchvision") is None


def pythonpath() -> str:
    """PYTHONPATH for a child process (a server, vLLM's model inspection) that must import Qwen3.5's modules."""
    return os.pathsep.join(p for p in (str(STAND_IN) if needed() else None, os.environ.get("PYTHONPATH")) if p)

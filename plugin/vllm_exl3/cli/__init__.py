"""The top layer: the `vllm-exl3` subcommands (parse, call, render). Nothing inside the package imports it."""

from .main import main

__all__ = ["main"]

"""What every command prints with: the consoles, text that Rich prints as it is, the progress bar, byte sizes, and
`UsageError` (a mistake the user can fix, printed as one paragraph by main.py)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from ..format.units import format_bytes

console = Console()
err_console = Console(stderr=True)


class UsageError(Exception):
    """A mistake the user can fix: printed as one paragraph (no traceback), exit status `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def gib(n: int) -> str:
    return format_bytes(n, binary=True, digits=2)


def lit(value: object) -> str:
    """`value` as text that Rich prints as it is. Tensor names, config strings, error messages and paths come from
    a pack or the command line: a tensor named '[/]' is not markup (Rich would stop with a MarkupError)."""
    return escape(str(value))


def progress_bar(total: int | None, description: str):
    """A progress bar on stderr (hidden when stderr is not a terminal) and its task."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, disable=not err_console.is_terminal)
    return prog, prog.add_task(description, total=total)


def worker_counts(text: str) -> list[int]:
    """`--workers 1,8` -> [1, 8]; anything but positive integers is refused (argparse type)."""
    try:
        counts = [int(w) for w in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers (e.g. 1,8)")
    return counts

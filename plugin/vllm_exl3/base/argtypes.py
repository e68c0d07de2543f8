"""argparse types for the commands' numeric options: a value out of range is a usage error naming the option
(argparse's own message and exit 2), never an OverflowError or a ZeroDivisionError later."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """A TCP port, 1..65535 (0 would let the kernel pick one nobody knows)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1 (a size, a count)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value

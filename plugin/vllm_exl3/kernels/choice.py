"""Which backend the user asked for: `VLLM_EXL3_KERNEL`, parsed in this one place (torch-free, so the launcher's
preflight checks it without importing torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping

KERNEL_ENV = "VLLM_EXL3_KERNEL"
STRICT_ENV = "VLLM_EXL3_KERNEL_STRICT"
CHOICES = ("auto", "native", "exllamav3", "torch")
PREFERENCE = ("native", "exllamav3", "torch")  # `auto` takes the first that is available and supports the layer


def parse_kernel(value: str | None) -> str:
    """'' / None -> 'auto'; case and spaces ignored; anything outside CHOICES is a ValueError naming the variable."""
    value = (value or "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{KERNEL_ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def requested_kernel(environ: Mapping[str, str] | None = None) -> str:
    return parse_kernel((os.environ if environ is None else environ).get(KERNEL_ENV))

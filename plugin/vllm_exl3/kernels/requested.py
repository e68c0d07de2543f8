"""What the user asked of the kernels: which backend (`VLLM_EXL3_KERNEL`) and whether a layer it cannot serve may
fall back (`VLLM_EXL3_KERNEL_STRICT`), read through base/settings.py in this one place. Torch-free, so the launcher's
preflight checks the choice without importing torch. Which backend then serves each layer: selection.py."""

from __future__ import annotations

from collections.abc import Mapping

from ..base import settings

KERNEL_ENV = "VLLM_EXL3_KERNEL"
STRICT_ENV = "VLLM_EXL3_KERNEL_STRICT"
CHOICES = ("auto", "native", "exllamav3", "torch")
PREFERENCE = ("native", "exllamav3", "torch")  # `auto` takes the first that is available and supports the layer


def parse_kernel(value: str | None) -> str:
    """'' / None -> 'auto'; case and spaces ignored; anything outside CHOICES is a SettingError naming the
    variable."""
    value = (value or "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise settings.SettingError(KERNEL_ENV, value, f"one of {', '.join(CHOICES)}")
    return value


def requested_kernel(environ: Mapping[str, str] | None = None) -> str:
    return parse_kernel(settings.get(KERNEL_ENV, environ))


def strict(environ: Mapping[str, str] | None = None) -> bool:
    """True: a named backend that cannot serve a layer type is an error, not a fallback."""
    return settings.get_bool(STRICT_ENV, environ)

"""`ReaderOptions`: how the parallel reader reads, from `--model-loader-extra-config` keys, then environment
variables, then their defaults: the variables, their defaults and their parsers are base/settings.py's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..base import settings
from ..base.settings import parse_bool, parse_positive_int
from ..format.units import MIB
from .plan import ALIGN

# user-facing knob -> (environment variable, parser). `--model-loader-extra-config` keys beat environment variables,
# environment variables beat the defaults (the settings table's, which ReaderOptions' own defaults are).
OPTION_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "workers": ("VLLM_EXL3_LOAD_WORKERS", parse_positive_int),
    "chunk_mib": ("VLLM_EXL3_LOAD_CHUNK_MIB", parse_positive_int),
    "ring_mib": ("VLLM_EXL3_LOAD_RING_MIB", parse_positive_int),
    "direct_io": ("VLLM_EXL3_LOAD_DIRECT_IO", parse_bool),
    "drop_page_cache": ("VLLM_EXL3_LOAD_DROP_PAGE_CACHE", parse_bool),
}


def _default(key: str):
    env, parse = OPTION_KEYS[key]
    return parse(settings.default(env))


@dataclass(frozen=True)
class ReaderOptions:
    """How to read. 16 MiB reads match fastsafetensors' bounce buffer (docs/vllm-notes.md §4.2); the best worker count
    depends on the drive: `vllm-exl3 load-bench PACK --workers 1,2,4,8,16` measures it."""

    workers: int = _default("workers")
    chunk_bytes: int = _default("chunk_mib") * MIB  # one pread, one bounce slot
    ring_bytes: int = _default("ring_mib") * MIB  # tensors read ahead of the consumer (host: plus as much again recycled)
    direct_io: bool = _default("direct_io")  # O_DIRECT where the filesystem allows it (tmpfs and some overlays refuse)
    drop_page_cache: bool = _default("drop_page_cache")  # buffered reads: fadvise(DONTNEED) each chunk once copied

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.chunk_bytes < ALIGN or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {self.chunk_bytes}")
        if self.ring_bytes < self.chunk_bytes:
            # a chunk of small tensors is admitted whole; a ring smaller than a chunk could never hold it
            raise ValueError(f"ring_bytes ({self.ring_bytes}) must be >= chunk_bytes ({self.chunk_bytes})")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None,
                    environ: Mapping[str, str] | None = None) -> ReaderOptions:
        """Options from user-facing keys (`workers`, `chunk_mib`, `ring_mib`, `direct_io`, `drop_page_cache`)."""
        config = dict(config or {})
        unknown = sorted(set(config) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"unknown loader option(s) {unknown}; known: {sorted(OPTION_KEYS)}")
        values: dict[str, Any] = {}
        for key, (env, parse) in OPTION_KEYS.items():
            source, raw = (key, config[key]) if key in config else (env, settings.lookup(env, environ))
            if raw is None or raw == "":
                continue
            try:
                values[key] = parse(raw)
            except ValueError as e:
                raise ValueError(f"loader option {source}: {e}") from None
        chunk = values.pop("chunk_mib", None)
        ring = values.pop("ring_mib", None)
        if chunk is not None:
            values["chunk_bytes"] = chunk * MIB
        if ring is not None:
            values["ring_bytes"] = ring * MIB
        elif chunk is not None and chunk * MIB > cls.ring_bytes:
            values["ring_bytes"] = chunk * MIB
        return cls(**values)

"""The pack's facts for the exporter: name, codebooks, bits histogram, bytes by group (format/summary.py), read
header-only once per exporter (a pack does not change under a running server)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from ...format.errors import Exl3FormatError
from ...format.pack import Pack
from ...format.summary import PackSummary, summarize

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def pack_summary(path: str) -> PackSummary | None:
    """The summary of the pack at `path`, or None (logged once) when there is none or it does not read."""
    if not path or not Path(path).is_dir():
        logger.info("metrics: no pack at %r; the pack metrics stay empty", path)
        return None
    try:
        return summarize(Pack.open(path))
    except (Exl3FormatError, OSError, ValueError) as e:
        logger.warning("metrics: cannot summarize the pack %s (%s); the pack metrics stay empty", path, e)
        return None

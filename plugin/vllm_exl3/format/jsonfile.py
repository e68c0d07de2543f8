"""The ONE way this package writes a JSON file that others read while it changes (pack files the tools rewrite,
state files the appliance's programs and the exporter share, the parity report): a temp file beside it, then a
rename, so a reader sees the old document or the new one, never half of one. The temp name carries the writer's
pid, so two writers never share one. Header-only (no torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, body: Any, indent: int | None = None, make_parent: bool = False) -> Path:
    """Write `body` as JSON to `path` atomically (OSError on failure: callers decide whether that matters)."""
    path = Path(path)
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(json.dumps(body, indent=indent) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the write or the rename failed
    return path

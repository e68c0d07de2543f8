"""The settings table (base/settings.py) lists every VLLM_EXL3_* variable the repository uses, docs/settings.md
is generated from it, and the defaults written elsewhere (README's loader table, ReaderOptions) agree with it."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_exl3.base import settings

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bVLLM_EXL3_[A-Z0-9_]*[A-Z0-9]\b")
SOURCES = ["plugin/**/*.py", "csrc/*", "deploy/**/*", "healthchecks/*", "docker-compose.yml", "Dockerfile", "setup.py",
           "README.md", "docs/*.md", "bench/*.py", "bench/*.sh"]


def test_settings_md_is_generated_from_the_table():
    assert (ROOT / "docs" / "settings.md").read_text() == settings.document(), \
        "run: python -m vllm_exl3.base.settings > docs/settings.md"


def test_every_variable_in_the_repository_is_in_the_table():
    known = set(settings.BY_NAME) | set(settings.NOT_VARIABLES)
    missing = {}
    for pattern in SOURCES:
        for path in ROOT.glob(pattern):
            if path.is_file():
                for name in set(NAME.findall(path.read_text(errors="replace"))) - known:
                    missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"add these to base/settings.py: {missing}"


def test_loader_table_and_reader_defaults_agree():
    """docs/performance.md's loader table (the `--model-loader-extra-config` keys) against the settings table."""
    rows = re.findall(r"^\| `(\w+)` \| `(VLLM_EXL3_\w+)` \| ([^|]+) \|", (ROOT / "docs" / "performance.md").read_text(), re.M)
    assert rows
    for _key, name, value in rows:
        assert value.strip() == settings.default(name), name
    from vllm_exl3.format.units import MIB
    from vllm_exl3.loader.options import ReaderOptions

    o = ReaderOptions()
    assert (o.workers, o.chunk_bytes // MIB, o.ring_bytes // MIB) == tuple(
        int(settings.default(f"VLLM_EXL3_LOAD_{k}")) for k in ("WORKERS", "CHUNK_MIB", "RING_MIB"))
    assert (str(o.direct_io).lower(), str(o.drop_page_cache).lower()) == (
        settings.default("VLLM_EXL3_LOAD_DIRECT_IO"), settings.default("VLLM_EXL3_LOAD_DROP_PAGE_CACHE"))

"""The fixture packs under tests/fixtures/exl3 (each with ExLlamaV3's golden outputs): where they are and their names."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exl3"
PACKS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "golden").is_dir())


def pack_dir(name: str) -> Path:
    return FIXTURES / name

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "exl3"
PACKS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "golden").is_dir())


def pack_dir(name: str) -> Path:
    return FIXTURES / name


@pytest.fixture(params=PACKS)
def fixture_pack(request) -> Path:
    return pack_dir(request.param)

"""Fixtures only: helpers the tests import live in tests/support/."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.fixtures import PACKS, pack_dir


@pytest.fixture(params=PACKS)
def fixture_pack(request) -> Path:
    return pack_dir(request.param)

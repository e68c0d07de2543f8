"""Fixtures of the container tests: the CPU image, built once per session."""

from __future__ import annotations

import pytest
from support.container import IMAGE, build_image, engine


@pytest.fixture(scope="session")
def cpu_image(tmp_path_factory) -> str:
    engine()
    seconds = build_image(tmp_path_factory.mktemp("image") / "build.log")
    print(f"\nCPU image {IMAGE} built in {seconds:.0f} s")
    return IMAGE

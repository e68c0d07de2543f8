"""Fixtures of the container tests: the CPU image and the metrics images, built once per session."""

from __future__ import annotations

import pytest
from support.container import IMAGE, METRICS_IMAGES, build_image, build_metrics_images, engine


@pytest.fixture(scope="session")
def cpu_image(tmp_path_factory) -> str:
    engine()
    seconds = build_image(tmp_path_factory.mktemp("image") / "build.log")
    print(f"\nCPU image {IMAGE} built in {seconds:.0f} s")
    return IMAGE


@pytest.fixture(scope="session")
def metrics_images(tmp_path_factory) -> tuple[str, ...]:
    """Prometheus and the node exporter from Debian's packages (docker-compose.cpu.yml's defaults)."""
    engine()
    seconds = build_metrics_images(tmp_path_factory.mktemp("metrics-images") / "build.log")
    print(f"\nmetrics images {', '.join(METRICS_IMAGES)} built in {seconds:.0f} s")
    return METRICS_IMAGES

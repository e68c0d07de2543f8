"""Containers that must not serve: a broken pack, the exllamav3 profile on the CPU image.

Needs a Docker engine (BuildKit builds, host networking); without one the tests skip, and fail in CI
(VLLM_EXL3_REQUIRE_TOOLS=1). Every address used is 127.0.0.1 on this host. The image: conftest.py's cpu_image.
"""

from __future__ import annotations

import shutil
import time

import pytest

from support.container import Appliance, compose_plugin_config, docker
from vllm_exl3 import demo

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]


def first_exit(app: Appliance, service: str, timeout: float = 300) -> tuple[int, str]:
    """The container's first exit code (`docker wait`: Docker's restart policy starts it again right after) and
    its log up to then."""
    code = int(docker("wait", app.container(service), timeout=timeout).stdout.strip())
    return code, app.logs(service)


@pytest.fixture(scope="module")
def broken(cpu_image, tmp_path_factory):
    """`single` on a pack whose config.json is not JSON: (exit code, log) of its first exit."""
    tmp = tmp_path_factory.mktemp("broken")
    pack = tmp / "broken-pack"
    shutil.copytree(demo.PACK, pack)
    (pack / "config.json").write_text("{ not json")
    with compose_plugin_config():
        app = Appliance(tmp, ["single"], MODEL_DIR=str(pack))
        try:
            app.start()
            result = first_exit(app, "single")
        finally:
            app.down()  # now: Docker's restart policy would start it again and again beside the next tests
    return result


def test_a_broken_pack_ends_the_container_with_the_preflights_message(broken):
    _, logs = broken
    assert "FAIL pack" in logs and "/model/config.json: expected valid JSON" in logs, logs
    assert logs.count("exit status 78") == 4  # the first start and supervisord's 3 retries, each refused
    assert "program vllm is FATAL" in logs  # then the listener ends the container: no loop inside it


def test_a_broken_packs_container_exits_with_the_preflights_code(broken):
    code, _ = broken
    assert code == 78


def wait_for_log(app: Appliance, service: str, text: str, timeout: float = 300) -> str:
    """The service's whole log once it holds `text` (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while text not in (logs := app.logs(service, last=None)) and time.monotonic() < deadline:
        time.sleep(2)
    return logs


def test_single_exllamav3_on_the_cpu_image_says_it_needs_a_gpu(cpu_image, tmp_path):
    """Its first start is refused with the reason and the preflight's code (the broken pack above shows how the
    retries end: the same path)."""
    with compose_plugin_config():
        app = Appliance(tmp_path, ["single-exllamav3"])
        try:
            app.start()
            logs = wait_for_log(app, "single-exllamav3", "exited: vllm (exit status 78")
            assert "FAIL kernel backend: exllamav3: no CUDA device" in logs, logs[-4000:]
            assert "exited: vllm (exit status 78" in logs, logs[-4000:]
            assert "Application startup complete" not in logs  # never served on another backend
        finally:
            app.down()

"""`head` and `worker` in a real Docker engine: two containers on one host, host networking, loopback only.

Needs a Docker engine (BuildKit builds, host networking); without one the tests skip, and fail in CI
(VLLM_EXL3_REQUIRE_TOOLS=1). Every address used is 127.0.0.1 on this host. The image: conftest.py's cpu_image.
"""

from __future__ import annotations

import pytest

from support.container import Appliance, compose_plugin_config, wait_for
from support.servers import free_port

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]


def test_head_and_worker_on_one_host_serve_and_the_head_turns_red_without_its_worker(cpu_image, tmp_path):
    """Two containers, host networking, loopback only: TP 2 over gloo, the worker's heartbeat to the head."""
    with compose_plugin_config():
        app = Appliance(tmp_path, ["head", "worker"], files=("tests/appliance/two-nodes-one-host.yml",),
                        HEAD_ADDR="127.0.0.1", VLLM_HOST_IP="127.0.0.1", NCCL_SOCKET_IFNAME="lo",
                        GLOO_SOCKET_IFNAME="lo", MASTER_PORT=str(free_port()), HEARTBEAT_PORT=str(free_port()),
                        WORKER_METRICS_PORT=str(free_port()), PEER_SECRET="container-pair-secret-0123456789",
                        HEAD_WAIT="240")
        try:
            app.up()  # both report healthy: the head only while its worker's heartbeat says ready
            assert app.health("head") == app.health("worker") == "healthy"
            assert app.exec("head", "id", "-u").stdout.strip() == "2000"  # the image's own non-root user
            reply = app.post("/v1/completions", prompt="Hello", max_tokens=4)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text
            assert "--nnodes 2 --node-rank 1 --headless" in app.logs("worker", last=None)
            worker_vllm = app.vllm_pid("worker")
            app.kill_9("worker", worker_vllm)
            # docs/appliance.md: no "ready" heartbeat for 15 s, or one saying "not ready" (every 2 s), is red
            red_after = wait_for("the head's readiness to turn red", lambda: not app.ready("head"), 20, app,
                                 poll=0.5)
            print(f"head red {red_after:.1f} s after its worker's vLLM was killed")
            wait_for("the pair healthy again", lambda: app.vllm_pid("worker") not in ("", worker_vllm)
                     and app.ready("worker") and app.ready("head"), 420, app)
            assert app.post("/v1/completions", prompt="Hello", max_tokens=4).status_code == 200
        finally:
            app.down()

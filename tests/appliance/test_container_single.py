"""`single` in a real Docker engine (the CPU image, docker-compose.yml + docker-compose.cpu.yml, the bundled demo
pack), one container for the module, checked from outside as a user would: Docker's health, the API, the key,
metrics, the user and mounts, then faults inside it (kill -9 of vLLM's API server and of its engine core) and
last `docker stop`.

Needs a Docker engine (BuildKit builds, host networking); without one the tests skip, and fail in CI
(VLLM_EXL3_REQUIRE_TOOLS=1). Every address used is 127.0.0.1 on this host. The image: conftest.py's cpu_image.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from support.container import Appliance, compose_plugin_config, demo_chat_template, docker, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]
KEY = "container-test-key-0123456789"
# The pids of vLLM's engine core processes (their title), read from /proc: the image has no procps.
ENGINE_PIDS = ("import os\n"
               "for p in filter(str.isdigit, os.listdir('/proc')):\n"
               "    try: c = open(f'/proc/{p}/cmdline', 'rb').read()\n"
               "    except OSError: continue\n"
               "    if c.startswith(b'VLLM::EngineCore'): print(p)\n")


@pytest.fixture(scope="module")
def single(cpu_image, tmp_path_factory):
    """`single` with an API key: every interface, key required (docs/appliance.md, Network exposure)."""
    with compose_plugin_config():
        # under a uid the image does not know, in group 0 (OpenShift's rule; the image's own user 2000 runs the
        # pair, test_container_pair.py): one container for both, each boot costs a minute of CI
        app = Appliance(tmp_path_factory.mktemp("single"), ["single"], files=("tests/appliance/arbitrary-uid.yml",),
                        VLLM_API_KEY=KEY,
                        VLLM_EXTRA_ARGS=f"--enforce-eager --chat-template {demo_chat_template()}")
        try:
            app.up()
            yield app
        finally:
            app.down()


def engine_pids(app: Appliance) -> set[str]:
    return set(app.exec("single", "python3", "-c", ENGINE_PIDS).stdout.split())


def vllm_pid(app: Appliance) -> str:
    return app.vllm_pid("single")


def kill_9(app: Appliance, pid: str) -> None:
    app.kill_9("single", pid)


def test_single_is_healthy_and_answers_completion_chat_and_stream(single):
    assert single.health("single") == "healthy"  # Docker's own view, from the image's HEALTHCHECK
    reply = single.post("/v1/completions", KEY, prompt="Hello", max_tokens=8, temperature=0).json()
    assert reply["usage"]["completion_tokens"] == 8
    chat = single.post("/v1/chat/completions", KEY, max_tokens=8,
                       messages=[{"role": "user", "content": "Hi"}]).json()
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] <= 8
    with single.post("/v1/completions", KEY, stream=True, prompt="Hello", max_tokens=8, ignore_eos=True) as r:
        assert r.status_code == 200
        events = [line[len(b"data: "):] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) >= 9  # 8 tokens, then [DONE]


def test_the_api_refuses_without_the_key_and_metrics_are_open(single):
    assert single.post("/v1/completions", prompt="Hello", max_tokens=4).status_code == 401
    assert single.post("/v1/completions", "wrong-key", prompt="Hello", max_tokens=4).status_code == 401
    assert requests.get(single.url("/health"), timeout=30).status_code == 200  # OPEN_PATHS
    metrics = requests.get(single.url("/metrics"), timeout=30)
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    exl3 = requests.get(f"http://127.0.0.1:{single.metrics_port}/metrics", timeout=30).text
    assert 'vllm_exl3_backend_info{' in exl3 and 'backend="torch"' in exl3  # the CPU image's backend


def test_runs_under_an_arbitrary_uid_in_group_0_with_the_model_read_only(single):
    assert single.exec("single", "id", "-u").stdout.strip() == "4242"
    assert single.exec("single", "id", "-g").stdout.strip() == "0"
    write = single.exec("single", "touch", "/model/written-by-the-container")
    assert write.returncode != 0 and "Read-only file system" in write.stderr


def test_kill_9_of_the_api_server_is_restarted_without_an_orphaned_engine(single):
    before_pid, before_engines = vllm_pid(single), engine_pids(single)
    assert before_pid and before_engines
    kill_9(single, before_pid)
    wait_for("a new vLLM", lambda: vllm_pid(single) not in ("", before_pid), 240, single)
    wait_for("serving again", lambda: single.ready("single") and single.serves(KEY), 300, single)
    wait_for("Docker's health back to healthy", lambda: single.health("single") == "healthy", 120, single)
    assert not engine_pids(single) & before_engines  # the old engine core is gone, not left holding memory


def test_kill_9_of_the_engine_core_recovers(single):
    (engine,) = engine_pids(single)
    kill_9(single, engine)
    wait_for("the old engine gone and a new one serving", lambda: engine not in engine_pids(single)
             and single.ready("single") and single.serves(KEY), 420, single)
    wait_for("Docker's health back to healthy", lambda: single.health("single") == "healthy", 120, single)


def test_docker_stop_drains_in_flight_streams_and_refuses_new_requests(single):
    """Last in this module: it stops the container."""
    max_len = requests.get(single.url("/v1/models"), headers={"Authorization": f"Bearer {KEY}"},
                           timeout=30).json()["data"][0]["max_model_len"]
    tokens = max_len - 8
    stream: dict = {}

    def read_stream():
        with single.post("/v1/completions", KEY, stream=True, prompt="Hi", max_tokens=tokens, ignore_eos=True,
                         temperature=0) as r:
            stream["status"] = r.status_code
            stream["events"] = [line for line in r.iter_lines() if line.startswith(b"data: ")]

    reader = threading.Thread(target=read_stream)
    reader.start()
    time.sleep(1.0)  # the request is in flight
    stopped: dict = {}
    stopper = threading.Thread(target=lambda: stopped.update(
        start=time.monotonic(), r=docker("stop", "--time", "150", single.container("single"), timeout=200),
        end=time.monotonic()))
    stopper.start()
    refused = []
    wait_for("a new request refused with 503 while draining", lambda: refused.append(
        single.post("/v1/completions", KEY, prompt="Hi", max_tokens=2).status_code) or refused[-1] == 503,
        60, single, poll=0.2)
    reader.join(200)
    stopper.join(200)
    assert stream["status"] == 200 and stream["events"][-1] == b"data: [DONE]", stream.get("events", [])[-3:]
    last = json.loads(stream["events"][-2][len(b"data: "):])
    assert last["choices"][0]["finish_reason"] == "length"  # ran to its end, not aborted
    assert stopped["end"] - stopped["start"] < 150  # within the stop timeout: no SIGKILL
    assert single.inspect("single")["State"]["ExitCode"] == 0

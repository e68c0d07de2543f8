"""`single` in a real Docker engine (the CPU image, docker-compose.yml + docker-compose.cpu.yml, the bundled demo
pack), one container for the module, checked from outside as a user would: Docker's health, the API, the key,
metrics, the user and mounts, then faults inside it (kill -9 of vLLM's API server and of its engine core) and
last `docker stop`. Beside it the `metrics` profile: Prometheus and the node exporter from Debian's packages
(scripts/build-image --metrics), Grafana left out (tests/appliance/metrics-without-grafana.yml).

Needs a Docker engine (BuildKit builds, host networking); without one the tests skip, and fail in CI
(VLLM_EXL3_REQUIRE_TOOLS=1). Every address used is 127.0.0.1 on this host. The images: conftest.py's cpu_image
and metrics_images.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import yaml

from support.appliance import ROOT, SERVED_NAME
from support.container import (Appliance, compose_plugin_config, demo_chat_template, docker, prometheus_config,
                               wait_for)
from support.servers import free_port

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]
KEY = "container-test-key-0123456789"
# The pids of vLLM's engine core processes (their title), read from /proc: the image has no procps.
ENGINE_PIDS = ("import os\n"
               "for p in filter(str.isdigit, os.listdir('/proc')):\n"
               "    try: c = open(f'/proc/{p}/cmdline', 'rb').read()\n"
               "    except OSError: continue\n"
               "    if c.startswith(b'VLLM::EngineCore'): print(p)\n")


@pytest.fixture(scope="module")
def single(cpu_image, metrics_images, tmp_path_factory):
    """`single` with an API key: every interface, key required (docs/appliance.md, Network exposure); and the
    `metrics` profile scraping it (Prometheus reads a copy of deploy/prometheus with this test's ports)."""
    tmp = tmp_path_factory.mktemp("single")
    with compose_plugin_config():
        # under a uid the image does not know, in group 0 (OpenShift's rule; the image's own user 2000 runs the
        # pair, test_container_pair.py): one container for both, each boot costs a minute of CI
        app = Appliance(tmp, ["single", "metrics"],
                        files=("tests/appliance/arbitrary-uid.yml", "tests/appliance/metrics-without-grafana.yml",
                               "tests/appliance/fast-restart.yml"),
                        VLLM_API_KEY=KEY,
                        VLLM_EXTRA_ARGS=f"--enforce-eager --chat-template {demo_chat_template()}",
                        PROMETHEUS_PORT=str(free_port()), NODE_EXPORTER_PORT=str(free_port()),
                        PROMETHEUS_TEST_CONFIG=str(tmp / "prometheus"))
        prometheus_config(tmp / "prometheus", {"vllm": app.port, "vllm-exl3": app.metrics_port,
                                               "node": int(app.settings["NODE_EXPORTER_PORT"])})
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
    reply = single.post("/v1/completions", KEY, prompt="Hello", max_tokens=8, temperature=0, ignore_eos=True).json()
    assert reply["usage"]["completion_tokens"] == 8
    chat = single.post("/v1/chat/completions", KEY, max_tokens=8,
                       messages=[{"role": "user", "content": "Hi"}]).json()
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] <= 8
    with single.post("/v1/completions", KEY, stream=True, prompt="Hello", max_tokens=8, temperature=0,
                     ignore_eos=True) as r:
        assert r.status_code == 200
        events = [line[len(b"data: "):] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) >= 9  # 8 tokens, then [DONE]
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == reply["choices"][0]["text"]  # the stream carries the same greedy text
    models = requests.get(single.url("/v1/models"), headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [reply["model"]]


def test_the_api_refuses_without_the_key_and_metrics_are_open(single):
    assert single.post("/v1/completions", prompt="Hello", max_tokens=4).status_code == 401
    assert single.post("/v1/completions", "wrong-key", prompt="Hello", max_tokens=4).status_code == 401
    assert requests.get(single.url("/health"), timeout=30).status_code == 200  # OPEN_PATHS
    metrics = requests.get(single.url("/metrics"), timeout=30)
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    exl3 = requests.get(f"http://127.0.0.1:{single.metrics_port}/metrics", timeout=30).text
    assert 'vllm_exl3_backend_info{' in exl3 and 'backend="torch"' in exl3  # the CPU image's backend


def prometheus(app: Appliance, path: str, **params) -> dict:
    reply = requests.get(f"http://127.0.0.1:{app.settings['PROMETHEUS_PORT']}/api/v1/{path}", params=params,
                         timeout=30).json()
    assert reply["status"] == "success", reply
    return reply["data"]


def test_prometheus_scrapes_every_target_and_evaluates_its_rules(single):
    """The `metrics` profile on the CPU image's Debian Prometheus: vLLM's /metrics (open with the key, OPEN_PATHS),
    the EXL3 exporter and the node exporter all up; every rule group of deploy/prometheus/rules loaded and
    evaluated without error; a recording rule has computed a series from vLLM's counters."""
    jobs = {"vllm": single.port, "vllm-exl3": single.metrics_port,
            "node": int(single.settings["NODE_EXPORTER_PORT"])}

    def targets() -> dict[str, dict]:
        return {t["labels"]["job"]: t for t in prometheus(single, "targets")["activeTargets"]}

    # scrape_interval is 5 s: three intervals and some for a target Prometheus has not scraped since vLLM came up
    wait_for("every target up", lambda: all(t["health"] == "up" for t in targets().values()), 20, single, poll=1)
    found = targets()
    assert set(found) == set(jobs), found
    for job, port in jobs.items():
        assert found[job]["scrapeUrl"] == f"http://localhost:{port}/metrics", found[job]
        assert found[job]["labels"]["role"] == "single" and found[job]["lastError"] == ""

    expected = {g["name"]: len(g["rules"]) for f in ("recording.yml", "alerts.yml")
                for g in yaml.safe_load((ROOT / "deploy/prometheus/rules" / f).read_text())["groups"]}

    def groups() -> dict[str, list[dict]]:
        return {g["name"]: g["rules"] for g in prometheus(single, "rules")["groups"]}

    # evaluation_interval is 15 s: a rule not yet evaluated reports health "unknown"
    wait_for("every rule evaluated", lambda: all(r["health"] == "ok" for rules in groups().values() for r in rules),
             40, single, poll=1)
    loaded = groups()
    assert {name: len(rules) for name, rules in loaded.items()} == expected
    kinds = {r["type"] for rules in loaded.values() for r in rules}
    assert kinds == {"recording", "alerting"}

    # rate() over 1m needs two scrapes in the window, then an evaluation
    series = "vllm_exl3:generation_tokens_per_second:rate1m"
    wait_for(f"{series} recorded", lambda: prometheus(single, "query", query=series)["result"], 40, single, poll=1)
    (result,) = prometheus(single, "query", query=series)["result"]
    assert result["metric"]["job"] == "vllm" and result["metric"]["model_name"] == SERVED_NAME, result
    assert float(result["value"][1]) >= 0


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
    # reaped by the new launch before its preflight, whose memory plan would have counted the orphan's memory
    log = single.logs("single", last=None)
    reaped = f"the previous vLLM (process group {before_pid}) left"
    assert reaped in log and log.index(reaped) < log.rindex("preflight: ok   pack"), log[-4000:]


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

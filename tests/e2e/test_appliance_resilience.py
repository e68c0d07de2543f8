"""The appliance under abuse, for real: one supervised box (supervisord with deploy/supervisord.conf, the launcher,
vLLM's CPU build on the demo pack, an API key) shared by the module. Which paths the key guards, bad requests, a
bounded streaming load with the memory of vLLM's process tree watched, and a stop in the middle of a stream.

The load test runs VLLM_EXL3_TEST_LOAD_SECONDS (30) with VLLM_EXL3_TEST_LOAD_CLIENTS (16) concurrent streaming
clients; set them higher for a longer run by hand.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from support.appliance import SERVED_NAME, appliance_env, required, supervised, tail, tool, wait_until
from support.servers import free_port
from vllm_exl3.appliance.health import descendants
from vllm_exl3.base.settings import default

pytestmark = pytest.mark.e2e
KEY = "resilience-test-key"
# The appliance's default: a shorter one also closed fresh connections whose request head the API server had not
# yet read while 64 streams kept its event loop busy on a 2-core CI machine (RemoteDisconnected under load)
IDLE_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    required("supervisord (PyPI supervisor)", tool("supervisord"))
    tmp = tmp_path_factory.mktemp("box")
    port = free_port()
    meminfo = tmp / "meminfo"  # what the memory watchdog reads: this machine's, until a test says memory is short
    meminfo.write_text(Path("/proc/meminfo").read_text())
    env = appliance_env("single", tmp / "run", VLLM_EXL3_PORT=str(port), VLLM_API_KEY=KEY,
                        VLLM_EXL3_HOST="",  # with a key and no host: every interface; the guard covers every path
                        VLLM_EXL3_HTTP_IDLE_TIMEOUT=str(IDLE_TIMEOUT_S), VLLM_EXL3_MEMINFO=str(meminfo),
                        VLLM_EXL3_MEM_STOP_GRACE="90",  # above the preset's --shutdown-timeout: a whole drain
                        # the drain test must see the watchdog act while its 1000-token stream still runs: on a
                        # loaded 2-core machine, a 1 s reading plus a 1 s log poll once outlasted the stream
                        VLLM_EXL3_WATCHDOG_INTERVAL="0.2",
                        # the liveness monitor checks often: a drain it counted as a death (3 x 0.5 s) would end the
                        # box during the stop tests below instead of restarting vLLM
                        VLLM_EXL3_LIVENESS_INTERVAL="0.5")
    with supervised(env, tmp / "supervisord.log") as b:
        b.wait_healthy()
        b.port = port
        b.base = f"http://127.0.0.1:{port}"
        b.meminfo = meminfo
        yield b


def auth(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def body(**extra) -> dict:
    return {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 8, "temperature": 0} | extra


def test_the_key_guards_every_path_but_health_and_metrics(box):
    assert "--host 0.0.0.0" in box.log.read_text() and "--middleware vllm_exl3.appliance.api_guard" in box.log.read_text()
    # vLLM alone would serve these without the key (its check covers /v1, /v2, /inference, /cohere only)
    calls = {"/invocations": ("post", body()), "/tokenize": ("post", {"model": SERVED_NAME, "prompt": "Hi"}),
             "/detokenize": ("post", {"model": SERVED_NAME, "tokens": [1, 2]}), "/version": ("get", None),
             "/ping": ("get", None), "/v1/models": ("get", None), "/v1/completions": ("post", body())}
    for path, (method, payload) in calls.items():
        r = requests.request(method, box.base + path, json=payload, timeout=60)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
        r = requests.request(method, box.base + path, json=payload, headers=auth(), timeout=60)
        assert r.status_code == 200, (path, r.status_code, r.text[:200])
    assert requests.get(box.base + "/health", timeout=10).status_code == 200  # Docker's health check
    metrics = requests.get(box.base + "/metrics", timeout=10)  # Prometheus (VLLM_EXL3_OPEN_PATHS)
    assert metrics.status_code == 200 and "vllm:" in metrics.text


def test_open_paths_are_open_to_reads_only_and_options_is_no_way_round_the_key(box):
    """/metrics answers every method with the full scrape: OPTIONS (and any method but GET/HEAD) needs the key."""
    for method in ("OPTIONS", "POST", "PUT", "DELETE"):
        r = requests.request(method, box.base + "/metrics", timeout=10)
        assert r.status_code == 401 and "vllm:" not in r.text, (method, r.status_code, r.text[:200])
    assert requests.head(box.base + "/metrics", timeout=10).status_code == 200
    assert requests.options(box.base + "/metrics", headers=auth(), timeout=10).status_code == 200
    # a browser's CORS preflight carries no key: the guard lets it pass and vLLM's CORS middleware answers it,
    # no route runs (vLLM 0.32 allows no origin by default: --allowed-origins)
    r = requests.options(box.base + "/metrics", timeout=10,
                         headers={"Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
    assert r.status_code == 400 and r.text == "Disallowed CORS origin", (r.status_code, r.text[:200])


def test_one_request_cannot_ask_for_more_sequences_than_the_engine_runs(box):
    """A huge `n` starved /health past the health check's timeout; n is bounded by --max-num-seqs (8 here)."""
    for n in (9, 10**6):
        r = requests.post(box.base + "/v1/completions", json=body(n=n, temperature=1.0, stream=True),
                          headers=auth(), timeout=60)
        assert r.status_code == 400 and "n must be at most 8" in r.text, (n, r.status_code, r.text[:300])
    slowest, done = [0.0], threading.Event()

    def probe():
        while not done.is_set():
            t0 = time.monotonic()
            assert requests.get(box.base + "/health", timeout=30).status_code == 200
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            time.sleep(0.2)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with requests.post(box.base + "/v1/completions", stream=True, headers=auth(), timeout=120,
                           json=body(n=8, temperature=1.0, max_tokens=200, ignore_eos=True, stream=True)) as r:
            chunks = sum(1 for line in r.iter_lines() if line.startswith(b"data: {"))
    finally:
        done.set()
        prober.join(60)
    print(f"a stream of n=8 x 200 tokens: {chunks} chunks, slowest /health {slowest[0]:.2f}s")
    assert r.status_code == 200 and chunks >= 8 * 200
    assert slowest[0] < float(default("VLLM_EXL3_HEALTH_TIMEOUT")), slowest


def test_connections_that_send_nothing_are_closed(box):
    """Idle, unauthenticated connections were never closed; now after VLLM_EXL3_HTTP_IDLE_TIMEOUT seconds."""
    idle = [socket.create_connection(("127.0.0.1", box.port)) for _ in range(300)]
    started = time.monotonic()
    try:
        assert requests.get(box.base + "/health", timeout=10).status_code == 200  # served meanwhile
        for s in idle:
            s.settimeout(max(0.1, IDLE_TIMEOUT_S + 5 - (time.monotonic() - started)))
            assert s.recv(1) == b""  # closed by the server
        took = time.monotonic() - started
    finally:
        for s in idle:
            s.close()
    print(f"300 idle connections closed after {took:.1f}s (VLLM_EXL3_HTTP_IDLE_TIMEOUT={IDLE_TIMEOUT_S})")
    assert took >= IDLE_TIMEOUT_S - 0.5


@pytest.mark.parametrize("what,send", [
    ("invalid JSON", lambda b: requests.post(b + "/v1/completions", data=b"{not json", timeout=60,
                                             headers=auth() | {"Content-Type": "application/json"})),
    ("unknown model", lambda b: requests.post(b + "/v1/completions", json=body(model="nope"), headers=auth(),
                                              timeout=60)),
    ("max_tokens beyond the context", lambda b: requests.post(b + "/v1/completions", json=body(max_tokens=10**6),
                                                              headers=auth(), timeout=60)),
    ("a 1 MB prompt", lambda b: requests.post(b + "/v1/completions", json=body(prompt="hello " * 174763),
                                              headers=auth(), timeout=120)),
    ("a negative temperature", lambda b: requests.post(b + "/v1/completions", json=body(temperature=-1),
                                                       headers=auth(), timeout=60)),
])
def test_bad_requests_get_4xx_and_the_server_stays_up(box, what, send):
    pid = box.vllm_pid
    r = send(box.base)
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    assert box.vllm_pid == pid and requests.get(box.base + "/health", timeout=10).status_code == 200
    ok = requests.post(box.base + "/v1/completions", json=body(), headers=auth(), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def stream(base: str, max_tokens: int, timeout: float = 120, on_chunk=None) -> tuple[str, str | None, int]:
    """One streaming completion read to its end: (text, finish_reason, chunks)."""
    text, finish, chunks = "", None, 0
    with requests.post(base + "/v1/completions", json=body(max_tokens=max_tokens, stream=True,
                                                           ignore_eos=True), headers=auth(), stream=True,
                       timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice.get("finish_reason") or finish
            chunks += 1
            if on_chunk:
                on_chunk(chunks)
    return text, finish, chunks


def tree_rss(pid: int) -> int:
    total = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def test_bounded_streaming_load_without_errors_and_flat_memory(box):
    seconds = float(os.environ.get("VLLM_EXL3_TEST_LOAD_SECONDS") or default("VLLM_EXL3_TEST_LOAD_SECONDS"))
    clients = int(os.environ.get("VLLM_EXL3_TEST_LOAD_CLIENTS") or default("VLLM_EXL3_TEST_LOAD_CLIENTS"))
    stream(box.base, 8)  # warm
    deadline = time.monotonic() + seconds
    done, errors, lock = [0], [], threading.Lock()
    rss: list[int] = []

    def client():
        while time.monotonic() < deadline:
            try:
                _, finish, chunks = stream(box.base, 24)
                assert finish == "length" and chunks >= 1, (finish, chunks)
                with lock:
                    done[0] += 1
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        rss.append(tree_rss(box.vllm_pid))
        time.sleep(1)
    for t in threads:
        t.join(150)
    assert not errors, errors[:5]
    warm = rss[len(rss) // 4:]  # past the first quarter: the allocator has taken what the batch needs
    growth = max(warm) - warm[0]
    print(f"load: {clients} clients x {seconds:.0f}s: {done[0]} streams, 0 errors; vLLM tree RSS "
          f"{warm[0] / 2**20:.0f} -> {warm[-1] / 2**20:.0f} MiB (max {max(warm) / 2**20:.0f})")
    assert done[0] >= clients, done[0]
    assert growth < 0.05 * warm[0] + 64 * 2**20, [r // 2**20 for r in rss]
    assert requests.get(box.base + "/health", timeout=10).status_code == 200


def long_stream(base: str) -> tuple[threading.Thread, dict]:
    """A 1000-token stream (the demo model's context is 1024) in a thread, returned once it is under way; the dict
    gets "out" (stream()'s answer) or "error", and "last_chunk" (monotonic time)."""
    started, result = threading.Event(), {}

    def on_chunk(n: int) -> None:
        result["last_chunk"] = time.monotonic()
        if n == 5:
            started.set()

    def client():
        try:
            result["out"] = stream(base, 1000, on_chunk=on_chunk)
        except Exception as e:  # noqa: BLE001 - reported by the test
            result["error"] = repr(e)
        started.set()

    t = threading.Thread(target=client)
    t.start()
    assert started.wait(120)
    return t, result


def test_a_memory_watchdog_stop_drains_and_new_requests_get_503(box):
    """Below the hard floor the memory watchdog stops vLLM as supervisord does: the running stream finishes
    (it was cut when the watchdog signalled the whole group), and new requests meanwhile get 503 (they got 500:
    vLLM had already shut the executors they need) until vLLM is gone; then it is restarted."""
    original = box.meminfo.read_text()
    for attempt in range(3):
        pid = box.vllm_pid
        t, result = long_stream(box.base)
        box.meminfo.write_text(re.sub(r"^MemAvailable:.*$", "MemAvailable:      65536 kB", original, flags=re.M))
        statuses: list[int] = []
        try:
            # Ask only once the watchdog has acted: a request sent before it is served (200) and, on a loaded
            # machine, can outlast the stream, leaving nothing asked during the drain.
            wait_until("the watchdog's stop", lambda: f"stopping vLLM (pid {pid})" in box.log.read_text(), 60,
                       box.proc, box.log, poll=0.1)
            while t.is_alive():
                try:
                    r = requests.post(box.base + "/v1/completions", json=body(), headers=auth(), timeout=30)
                except requests.ConnectionError:
                    break  # the drain is over: vLLM has closed its port
                statuses.append(r.status_code)
                if r.status_code == 503:
                    assert r.headers.get("retry-after") and "shutting down" in r.text
                    try:  # readiness goes red, unless the drain ended (port closed) between the two requests
                        assert requests.get(box.base + "/health", timeout=10).status_code == 503
                    except requests.ConnectionError:
                        break
                time.sleep(0.2)
            t.join(180)
        finally:
            box.meminfo.write_text(original)
        assert "error" not in result, (result, tail(box.log))
        wait_until("a new vLLM", lambda: box.vllm_pid not in (None, pid), 120, box.proc, box.log)
        box.wait_healthy()
        if statuses:
            break
        # The whole stream ran before the watchdog's stop was seen (seen on the 2-core CI machine, not reproduced
        # alone): nothing was asked during a drain, so the scenario runs again on the restarted vLLM.
    text, finish, chunks = result["out"]
    assert finish == "length" and chunks >= 900, (finish, chunks)  # every token, not a cut stream
    assert 503 in statuses and set(statuses) <= {200, 503}, (attempt, statuses)
    log = box.log.read_text()
    assert f"stopping vLLM (pid {pid})" in log and "did not finish" not in log, tail(box.log)
    assert "liveness failed" not in log and box.proc.poll() is None, tail(box.log)  # a drain is not a death


def test_a_stop_during_a_stream_lets_it_finish(box):
    """supervisord's stop (what `docker compose stop` does): vLLM drains for the preset's --shutdown-timeout."""
    ctl = [required("supervisorctl", tool("supervisorctl")), "-s", f"unix://{box.run_dir}/supervisor.sock"]
    box.wait_healthy()  # a restart by an earlier test may still be under way
    t, result = long_stream(box.base)
    pid = box.vllm_pid
    stop_issued = time.monotonic()
    stop = subprocess.run([*ctl, "stop", "vllm"], capture_output=True, text=True, timeout=180)
    t.join(180)
    assert "error" not in result, (result, tail(box.log))
    text, finish, chunks = result["out"]
    assert finish == "length" and chunks >= 900, (finish, chunks)  # every token, not an aborted stream
    drained = result["last_chunk"] - stop_issued
    print(f"stop during a stream: tokens kept coming for {drained:.1f}s after the stop")
    assert drained > 0  # the stream was still running when the stop came
    assert stop.returncode == 0 and "vllm: stopped" in stop.stdout, stop.stdout + stop.stderr
    wait_until("vLLM gone", lambda: not Path(f"/proc/{pid}").exists() or box.vllm_pid != pid, 30)
    log = box.log.read_text()
    assert "stopped: vllm (exit status 0)" in log or "stopped: vllm (terminated by SIGTERM)" in log, tail(box.log)
    # the container stays: the liveness monitor did not count the drain's 503s as a dead engine
    assert "liveness failed" not in log and box.proc.poll() is None, tail(box.log)

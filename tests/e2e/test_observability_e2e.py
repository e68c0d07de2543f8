"""Observability end to end with the real parts: the demo pack served by vLLM's CPU build with the plugin, the EXL3
exporter (`vllm-exl3 metrics`), the node exporter and Prometheus (Debian's binaries), all on loopback. Prometheus
runs the project's own scrape config (targets pointed at this test's ports, 1 s intervals) and rule files; the
test sends a few requests, then asks Prometheus's HTTP API what it saw."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import yaml

from support.appliance import ROOT, kill_group, required, tool, wait_until
from support.servers import cpu_env, free_port, vllm_server
from vllm_exl3 import demo

pytestmark = pytest.mark.e2e

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
HINT = "`apt-get install prometheus prometheus-node-exporter` (Debian), or put the binaries on PATH"
PSI = Path("/proc/pressure/memory").exists()  # node exporter's pressure metrics exist only with PSI
RULES_TIMEOUT_S = 90
SCRAPE_S = 1  # scrape and rule evaluation interval of the test's Prometheus
SPECULATIVE_GROUP = "vllm-exl3-speculative"  # recording rules with data only where speculative decoding is on


def _dashboards():
    spec = importlib.util.spec_from_file_location("dashboards", ROOT / "tools" / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        kill_group(proc.pid, 15)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def _prometheus_config(ports: dict[str, int], directory: Path) -> Path:
    """deploy/prometheus/prometheus.yml with this test's ports and 1 s intervals; the rule files as they are."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert {job["job_name"] for job in config["scrape_configs"]} == set(ports)
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [f"127.0.0.1:{ports[job['job_name']]}"]
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _state_files(state: Path) -> None:
    """The memory watchdog's and the heartbeat's files, in their documented shape (base/state.py)."""
    now = time.time()
    (state / "memory-watchdog.json").write_text(json.dumps({
        "time": now, "mem_available_bytes": 60e9, "mem_total_bytes": 128e9, "swap_used_bytes": 0,
        "psi_some_avg10": 0.0, "psi_full_avg10": 0.0, "state": "ok", "soft_floor_bytes": 8e9,
        "hard_floor_bytes": 4e9, "soft_events_total": 0, "hard_stops_total": 0}))
    (state / "peer.json").write_text(json.dumps({"time": now, "role": "single", "peer": "none", "alive": True,
                                                 "last_seen": now}))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = required("prometheus", tool("prometheus"), HINT)
    node_exporter = required("prometheus-node-exporter",
                             tool("prometheus-node-exporter") or tool("node_exporter"), HINT)
    work = tmp_path_factory.mktemp("observability")
    state = work / "state"
    state.mkdir()
    _state_files(state)
    env = cpu_env(VLLM_EXL3_STATE_DIR=str(state))
    with ExitStack() as stack, vllm_server(demo.PACK, work, "--load-format", "exl3_parallel", "--enforce-eager",
                                           env=env) as server:
        ports = {"vllm": int(server.base_url.rsplit(":", 1)[1]), "vllm-exl3": free_port(), "node": free_port()}
        procs = [
            _start([sys.executable, "-m", "vllm_exl3.cli", "metrics", "--host", "127.0.0.1", "--port",
                    str(ports["vllm-exl3"]), "--state-dir", str(state), "--model", str(demo.PACK), "--role",
                    "single"], work / "exporter.log"),
            _start([node_exporter, f"--web.listen-address=127.0.0.1:{ports['node']}", "--collector.pressure"],
                   work / "node-exporter.log"),
        ]
        prom_port = free_port()
        procs.append(_start([prometheus, f"--config.file={_prometheus_config(ports, work)}",
                             f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                             "--log.level=warn"], work / "prometheus.log"))
        for p in procs:
            stack.callback(_stop, p)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        obs = SimpleNamespace(server=server, api=api, work=work, ports=ports)
        wait_until("Prometheus", lambda: _answers(f"http://127.0.0.1:{prom_port}/-/ready"), 60, procs[-1],
                   work / "prometheus.log")
        wait_until("every target up", lambda: len(query(obs, "up == 1")) == len(ports), 60, procs[-1],
                   work / "prometheus.log")
        for prompt in ("Hello", "The capital of", "def f(x):", "Once upon"):  # bounded: 4 short requests
            server.post("/v1/completions", prompt=prompt, max_tokens=12, temperature=0)
        bad = requests.post(f"{server.base_url}/v1/completions", timeout=60,
                            json={"model": "no-such-model", "prompt": "x", "max_tokens": 1})
        assert bad.status_code == 404  # an error for the error panels
        time.sleep(3 * SCRAPE_S)  # rate() needs two samples of the series these requests created (HTTP status)
        groups = yaml.safe_load((PROMETHEUS_DIR / "rules" / "recording.yml").read_text())["groups"]
        # This server runs without --speculative-config: vLLM exports no spec-decode counters, so that group's
        # rules have nothing to record (test_speculative_e2e.py checks the counters they read).
        obs.recorded = [r["record"] for g in groups if g["name"] != SPECULATIVE_GROUP for r in g["rules"]]
        obs.speculative = [r["record"] for g in groups if g["name"] == SPECULATIVE_GROUP for r in g["rules"]]
        obs.rules_ready_s = wait_until("every recording rule's value",
                                       lambda: all(query(obs, r) for r in obs.recorded), RULES_TIMEOUT_S,
                                       procs[-1], work / "prometheus.log")
        yield obs


def query(obs, expr: str) -> list[dict]:
    r = requests.get(f"{obs.api}/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def one(obs, expr: str) -> float:
    result = query(obs, expr)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def test_every_target_is_up_with_role_and_rank(stack):
    for job in stack.ports:
        assert one(stack, f'up{{job="{job}", role="single", rank="0"}}') == 1


def test_backend_decisions_are_the_ones_the_server_logged(stack):
    log = stack.server.log.read_text(errors="replace")
    decided = re.findall(r"EXL3 ((linear|linear_group|moe):(\S+):(\w+)) -> (\w+) backend", log)
    assert {d[1] for d in decided} == {"linear", "linear_group", "moe"}, decided  # q/k/v grouped
    for _, kind, variant, device, backend in decided:
        ids = f'rank="0", role="single", layer_type="{kind}"'
        assert one(stack, f'vllm_exl3_backend_info{{{ids}, backend="{backend}"}}') == 1
        assert one(stack, f'vllm_exl3_backend_layers{{{ids}, variant="{variant}", device="{device}", '
                          f'backend="{backend}"}}') >= 1
        # the backends passed over (the GPU ones, on a CPU machine), each with the reason the log gives
        for skipped in query(stack, f'vllm_exl3_backend_skipped_info{{{ids}, variant="{variant}"}}'):
            assert f"{skipped['metric']['backend']}: {skipped['metric']['reason']}" in log
    assert one(stack, 'vllm_exl3_worker_up{rank="0"}') == 1


def test_load_receipt_is_the_one_the_server_logged(stack):
    log = stack.server.log.read_text(errors="replace")
    m = re.search(r"loaded \S+ \S+ \((\d+) tensors, (\d+) files\) in ([\d.]+) s: ([\d.]+) GB/s with (\d+) workers",
                  log)
    assert m, "no load receipt in the server's log"
    tensors, files, seconds, gbps, workers = int(m[1]), int(m[2]), float(m[3]), float(m[4]), int(m[5])
    assert one(stack, "vllm_exl3_weight_load_tensors") == tensors
    assert one(stack, "vllm_exl3_weight_load_files") == files
    assert one(stack, "vllm_exl3_weight_load_workers") == workers
    assert round(one(stack, "vllm_exl3_weight_load_seconds"), 2) == pytest.approx(seconds, abs=0.006)
    assert round(one(stack, "vllm_exl3_weight_load_bytes_per_second") / 1e9, 2) == pytest.approx(gbps, abs=0.006)


def test_pack_and_health_files_are_exported(stack):
    assert one(stack, f'vllm_exl3_pack_info{{pack="{demo.PACK.name}", codebooks="mul1"}}') == 1
    assert one(stack, 'vllm_exl3_memory_watchdog_state{state="ok"}') == 1
    assert one(stack, 'vllm_exl3_peer_alive{peer="none"}') == 1


def test_every_dashboard_query_returns_data(stack):
    """Each panel's query parses and has data here, unless the generator declares it needs a GPU, speculative
    decoding (or PSI on a kernel without it)."""
    boards = _dashboards()
    empty, checked = [], 0
    for board in boards.DASHBOARDS:
        for panel in board.panels:
            if panel.needs in ("gpu", "spec") or (panel.needs == "psi" and not PSI):
                continue
            for q in panel.queries:
                checked += 1
                if not query(stack, q.expr):
                    empty.append(f"{board.uid} / {panel.title}: {q.expr}")
    assert checked >= 40 and not empty, empty


def test_gpu_panels_are_empty_here_because_there_is_no_gpu(stack):
    """The declaration is honest: on this CPU machine the GPU-only queries parse and have no data."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    for board in _dashboards().DASHBOARDS:
        for panel in board.panels:
            if panel.needs == "gpu":
                for q in panel.queries:
                    assert query(stack, q.expr) == [], (panel.title, q.expr)


def test_speculative_panels_and_rules_are_empty_without_a_method(stack):
    """Without --speculative-config vLLM exports no spec-decode counter, so the speculative rules and panels parse
    and stay empty here: the `needs="spec"` declaration and the rule group's comment are honest."""
    assert query(stack, '{__name__=~"vllm:spec_decode_.*"}') == []
    assert len(stack.speculative) == 3
    for record in stack.speculative:
        assert query(stack, record) == [], record
    panels = [p for board in _dashboards().DASHBOARDS for p in board.panels if p.needs == "spec"]
    assert len(panels) == 3
    for panel in panels:
        for q in panel.queries:
            assert query(stack, q.expr) == [], (panel.title, q.expr)


def test_recording_rules_produce_values(stack):
    tok_s = one(stack, "sum(vllm_exl3:generation_tokens_per_second:rate1m)")
    step = one(stack, "max(vllm_exl3:decode_step_seconds:mean1m)")
    ttft = one(stack, "max(vllm_exl3:time_to_first_token_seconds:p99_5m)")
    assert tok_s > 0 and 0 < step < 10 and 0 < ttft < 60, (tok_s, step, ttft)
    assert stack.rules_ready_s < RULES_TIMEOUT_S


def test_every_rule_is_loaded_and_evaluates_without_error(stack):
    groups = requests.get(f"{stack.api}/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    alerts = {r["alert"] for g in yaml.safe_load((PROMETHEUS_DIR / "rules" / "alerts.yml").read_text())["groups"]
              for r in g["rules"]}
    assert {r["name"] for r in rules if r["type"] == "alerting"} == alerts
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
    firing = {r["name"] for r in rules if r["type"] == "alerting" and r["state"] != "inactive"}
    # a healthy CPU demo: no rank down, no GPU layer on torch, no parity failure, no stall, no target down
    assert not firing & {"Exl3RankDown", "Exl3GpuLayerOnTorchBackend", "Exl3ParityGateFailed", "VllmDecodeStalled",
                         "TargetDown", "Exl3PeerLost", "SparkMemoryWatchdogTripped"}, firing


def test_the_serving_bench_reports_the_backends_the_exporter_exports(stack):
    """`vllm-exl3 bench` names each side's kernel backends from that node's exporter (vLLM's own /metrics has none)."""
    import asyncio

    import aiohttp

    from vllm_exl3.servebench import runner

    exporter = f"http://127.0.0.1:{stack.ports['vllm-exl3']}"
    log = stack.server.log.read_text(errors="replace")
    logged = {kind: backend for kind, backend in re.findall(r"EXL3 (linear|linear_group|moe):\S+ -> (\w+) backend", log)}

    async def probe(exporter_url):
        side = runner.Side("A", stack.server.base_url, "A", exporter=exporter_url)
        async with aiohttp.ClientSession() as session:
            await runner.probe(session, side, runner.Options())
        return side

    found = asyncio.run(probe(exporter))
    assert found.backends == {kind: [backend] for kind, backend in logged.items()}
    assert found.gpu == runner.UNKNOWN  # no GPU here: the exporter names none
    absent = asyncio.run(probe(f"http://127.0.0.1:{free_port()}"))  # no exporter there: not an error
    assert absent.backends == {} and absent.reached

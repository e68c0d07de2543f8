"""The EXL3 metrics exporter (appliance/metrics/): state files in, Prometheus text out.

The worker file is written by the real publisher (integration/telemetry.py) after a real backend decision; the
memory watchdog's and heartbeat's files are written here in their documented shape. The server end to end (a
running vLLM, a real Prometheus) is tests/e2e/test_observability_e2e.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from support.appliance import ROOT
from support.servers import free_port
from vllm_exl3 import demo
from vllm_exl3.appliance.metrics import collector, gpu
from vllm_exl3.appliance.metrics.exporter import registry
from vllm_exl3.base.state import StateError, read_peer, read_watchdog, read_worker

WATCHDOG = {"time": 1.7e9, "mem_available_bytes": 52e9, "mem_total_bytes": 128e9, "swap_used_bytes": 1e6,
            "psi_some_avg10": 1.5, "psi_full_avg10": 0.25, "state": "soft", "soft_floor_bytes": 8e9,
            "hard_floor_bytes": 4e9, "soft_events_total": 3, "hard_stops_total": 1}
PEER = {"time": 1.7e9, "role": "head", "peer": "192.168.100.11", "alive": False, "last_seen": 1.6e9}


def scrape(state: Path, pack: str = "", role: str = "single") -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, through prometheus_client's own text parser."""
    text = generate_latest(registry(state, pack, role)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name: str, **labels) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


@pytest.fixture
def published(tmp_path, monkeypatch) -> Path:
    """A worker file from the real publisher, after a real backend decision (torch serves CPU layers)."""
    from vllm_exl3.integration import telemetry
    from vllm_exl3.kernels.selection import choose_linear_backend
    from vllm_exl3.kernels.specs import LinearSpec

    monkeypatch.setenv("VLLM_EXL3_STATE_DIR", str(tmp_path))
    choose_linear_backend(LinearSpec("mul1", 4, 256, 256, torch.float16, "cpu"))
    path = telemetry.publish()
    assert path == tmp_path / "exl3-rank0.json"
    return tmp_path


def test_worker_state_round_trip(published):
    s = scrape(published, role="head")
    ids = {"rank": "0", "role": "head"}
    assert value(s, "vllm_exl3_worker_up", **ids) == 1
    assert value(s, "vllm_exl3_backend_info", layer_type="linear", backend="torch", **ids) == 1
    assert value(s, "vllm_exl3_backend_layers", layer_type="linear", variant="mul1:4b", device="cpu",
                 backend="torch", **ids) >= 1
    assert value(s, "vllm_exl3_backend_available", backend="torch", reason="", **ids) == 1
    assert value(s, "vllm_exl3_parity_failed_checks", **ids) == 0
    assert value(s, "vllm_exl3_state_file_valid", file="exl3-rank0.json") == 1
    data = json.loads((published / "exl3-rank0.json").read_text())
    for b in data["backends"]:  # a CPU machine: the GPU backends are unavailable, each with its reason
        assert value(s, "vllm_exl3_backend_available", backend=b["name"], reason=b["reason"], **ids) == b["available"]


def test_a_finished_worker_is_down_and_exports_nothing_else(published):
    path = published / "exl3-rank0.json"
    data = json.loads(path.read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    data["pid"] = dead.pid  # a process that has exited
    path.write_text(json.dumps(data))
    s = scrape(published, role="head")
    assert value(s, "vllm_exl3_worker_up", rank="0", role="head") == 0
    assert not [k for k in s if k[0] == "vllm_exl3_backend_info"]


def test_watchdog_and_peer_files(tmp_path):
    (tmp_path / "memory-watchdog.json").write_text(json.dumps(WATCHDOG))
    (tmp_path / "peer.json").write_text(json.dumps(PEER))
    s = scrape(tmp_path)
    assert value(s, "vllm_exl3_memory_watchdog_state", state="soft") == 1
    assert value(s, "vllm_exl3_memory_watchdog_state", state="ok") == 0
    assert value(s, "vllm_exl3_memory_watchdog_soft_events_total") == 3
    assert value(s, "vllm_exl3_memory_watchdog_hard_stops_total") == 1
    assert value(s, "vllm_exl3_memory_watchdog_soft_floor_bytes") == 8e9
    assert value(s, "vllm_exl3_memory_watchdog_psi_full_avg10_percent") == 0.25
    assert value(s, "vllm_exl3_peer_alive", peer="192.168.100.11") == 0
    assert value(s, "vllm_exl3_peer_last_seen_timestamp_seconds", peer="192.168.100.11") == 1.6e9
    assert value(s, "vllm_exl3_state_file_updated_timestamp_seconds", file="peer.json") == 1.7e9


@pytest.mark.parametrize("name, body, field, expected", [
    ("memory-watchdog.json", {**WATCHDOG, "state": "panic"}, "state", "one of ok, soft, hard"),
    ("memory-watchdog.json", {k: v for k, v in WATCHDOG.items() if k != "hard_floor_bytes"}, "hard_floor_bytes",
     "a number"),
    ("memory-watchdog.json", {**WATCHDOG, "soft_events_total": "3"}, "soft_events_total", "a number"),
    ("peer.json", {**PEER, "alive": "yes"}, "alive", "true or false"),
    ("peer.json", [PEER], None, "a JSON object"),
    ("peer.json", "{not json", None, "JSON"),
])
def test_a_bad_state_file_is_named_once_and_exported_invalid(tmp_path, caplog, name, body, field, expected):
    (tmp_path / name).write_text(body if isinstance(body, str) else json.dumps(body))
    reader = read_watchdog if name == "memory-watchdog.json" else read_peer
    with pytest.raises(StateError) as e:
        reader(tmp_path)
    assert e.value.field == field and f"expected {expected}" in str(e.value) and name in str(e.value)
    reg_samples = scrape(tmp_path)
    assert value(reg_samples, "vllm_exl3_state_file_valid", file=name) == 0
    # the collector logs each distinct problem once, however often it is scraped
    col = collector.Exl3Collector(tmp_path, "", "single")
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm_exl3.appliance.metrics"):
        for _ in range(3):
            list(col.collect())
    assert len([r for r in caplog.records if name in r.getMessage()]) == 1


def test_a_bad_worker_file_names_the_field(published):
    path = published / "exl3-rank0.json"
    data = json.loads(path.read_text())
    data["decisions"][0]["layers"] = "many"
    path.write_text(json.dumps(data))
    with pytest.raises(StateError, match=r"exl3-rank0.json: decisions\[0\].layers: expected an integer, found 'many'"):
        read_worker(path)
    data["decisions"][0]["layers"] = 1
    data["decisions"][0]["skipped"] = [{"backend": "native"}]
    path.write_text(json.dumps(data))
    with pytest.raises(StateError, match=r"decisions\[0\].skipped\[0\].reason: expected a string, found nothing"):
        read_worker(path)
    data["decisions"][0]["skipped"] = []
    data["rank"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(StateError, match=r"rank: expected 0 \(as the file name says\), found 3"):
        read_worker(path)


def test_pack_metrics_of_the_demo_pack(tmp_path):
    s = scrape(tmp_path, str(demo.PACK))
    assert value(s, "vllm_exl3_pack_info", pack=demo.PACK.name, architecture="Qwen3MoeForCausalLM",
                 codebooks="mul1", bits="4,6") == 1
    assert value(s, "vllm_exl3_pack_tensors", bits="4", codebook="mul1") == 56
    assert value(s, "vllm_exl3_pack_tensors", bits="6", codebook="mul1") == 1
    assert {dict(k[1])["group"] for k in s if k[0] == "vllm_exl3_pack_bytes"} == {"experts", "dense", "head"}


def test_nvidia_smi_output_is_parsed_and_not_supported_fields_are_left_out():
    out = "0, NVIDIA GB10, 2418, [N/A], 47, 31.52\n1, NVIDIA H200, 1980, 3201, 38, [Not Supported]\n"
    a, b = gpu.parse(out)
    assert (a.index, a.name, a.sm_clock_hertz, a.memory_clock_hertz, a.temperature_celsius, a.power_watts) == \
        ("0", "NVIDIA GB10", 2418e6, None, 47.0, 31.52)
    assert b.memory_clock_hertz == 3201e6 and b.power_watts is None


def test_every_metric_the_dashboards_and_rules_use_is_exported():
    """Every vllm_exl3_* name in a dashboard or a rule is in the exporter's catalogue (counters by their
    `_total` name), and every vllm_exl3:* name is a recording rule."""
    texts = [p.read_text() for p in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")]
    texts += [p.read_text() for p in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")]
    used = {m for t in texts for m in re.findall(r"\bvllm_exl3_[a-z0-9_]+", t)}
    assert used and used <= set(collector.METRICS), used - set(collector.METRICS)
    recorded = {r["record"] for g in yaml.safe_load((ROOT / "deploy/prometheus/rules/recording.yml").read_text())
                ["groups"] for r in g["rules"]}
    assert {m for t in texts for m in re.findall(r"\bvllm_exl3:[a-z0-9_:]+", t)} <= recorded


def test_exporter_serves_http_and_refuses_a_taken_port(published):
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_exl3.cli", "metrics", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(published), "--model", str(demo.PACK), "--role", "head"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                break
            except requests.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "the exporter did not come up"
                time.sleep(0.3)
        assert 'vllm_exl3_backend_info{backend="torch",layer_type="linear",rank="0",role="head"} 1.0' in text
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out  # SIGTERM is a clean stop (supervisord's stopsignal)


def test_docs_list_every_metric_and_alert():
    doc = (ROOT / "docs" / "observability.md").read_text()
    assert collector.markdown_table() in doc, "paste vllm_exl3.appliance.metrics.collector.markdown_table() there"
    alerts = [r["alert"] for g in yaml.safe_load((ROOT / "deploy/prometheus/rules/alerts.yml").read_text())["groups"]
              for r in g["rules"]]
    assert [a for a in alerts if f"`{a}`" not in doc] == []


def test_memory_plan_written_by_the_launcher_is_exported(tmp_path):
    """The launcher's real plan for the demo pack on a 128 GiB machine, through the writer it uses."""
    from vllm_exl3.appliance import preflight
    from vllm_exl3.appliance.memory_plan import MemoryFigures, PlanSettings, Request
    from vllm_exl3.appliance.launch import publish_plan
    from vllm_exl3.format.pack import Pack

    gib = 1024 ** 3
    plan = preflight.memory_plan(Pack.open(demo.PACK), Request(), PlanSettings(),
                                 MemoryFigures(128 * gib, 120 * gib, 120 * gib))
    assert plan.fits and plan.weights_bytes > 0 and plan.kv_cache_memory_bytes > 0
    assert publish_plan(plan, {"VLLM_EXL3_STATE_DIR": str(tmp_path)}) == tmp_path / "memory-plan.json"
    s = scrape(tmp_path)
    assert value(s, "vllm_exl3_memory_plan_weights_bytes") == plan.weights_bytes
    assert value(s, "vllm_exl3_memory_plan_kv_tokens") == plan.kv_tokens
    assert value(s, "vllm_exl3_memory_plan_max_model_len_tokens") == plan.max_model_len
    assert value(s, "vllm_exl3_memory_plan_gpu_memory_utilization_ratio") == plan.gpu_memory_utilization

"""Static checks of the appliance's files with the real tools: hadolint (Dockerfile), shellcheck (every shell
script in the repository), promtool (Prometheus config), plus consistency between the files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import yaml

from support.appliance import ROOT, required, tool

DOCKERFILE = ROOT / "Dockerfile"
METRICS_DOCKERFILE = ROOT / "deploy" / "metrics" / "Dockerfile"  # Prometheus + node exporter from Debian's packages
PROMTOOL_HINT = "no PyPI package carries it: `apt-get install prometheus`, or put promtool from a Prometheus release on PATH"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_hadolint_finds_nothing():
    hadolint = required("hadolint", tool("hadolint"))
    r = run(hadolint, "--no-color", str(DOCKERFILE), str(METRICS_DOCKERFILE))
    assert r.returncode == 0, r.stdout + r.stderr
    # the tool really lints: a classic mistake is reported
    probe = subprocess.run([hadolint, "--no-color", "-"], input="FROM ubuntu:latest\nRUN cd /tmp\n",
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "DL3007" in probe.stdout


def shell_scripts() -> list[str]:
    files = run("git", "ls-files").stdout.split()
    scripts = []
    for name in files:
        path = ROOT / name
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                first = f.readline()
            if re.match(rb"#!\s*/(usr/)?bin/(env )?(ba|da)?sh\b", first) or name.endswith(".sh"):
                scripts.append(name)
    return scripts


def test_shellcheck_is_clean():
    shellcheck = required("shellcheck", tool("shellcheck"))
    scripts = shell_scripts()
    assert {"scripts/bootstrap", "scripts/test", ".ci/run"} <= set(scripts)
    r = run(shellcheck, "--severity=style", *scripts)
    assert r.returncode == 0, r.stdout + r.stderr


PROMETHEUS = ROOT / "deploy" / "prometheus"


def test_prometheus_configs_are_valid(tmp_path):
    """Both scrape configs and every rule file, as promtool reads them (the two-Spark one with its example
    worker targets in place, in a copy)."""
    promtool = required("promtool", tool("promtool"), PROMTOOL_HINT)
    r = run(promtool, "check", "config", "deploy/prometheus/prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    copy = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, copy)
    shutil.copy(copy / "targets" / "worker.yml.example", copy / "targets" / "worker.yml")
    r = run(promtool, "check", "config", str(copy / "prometheus-2x.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rule files found" in r.stdout + r.stderr


def test_prometheus_rule_unit_tests_pass():
    """`promtool test rules`: every alert fires on its case and stays quiet below its threshold and before its
    `for`; the recording rules' arithmetic."""
    promtool = required("promtool", tool("promtool"), PROMTOOL_HINT)
    tests = sorted(str(p.relative_to(ROOT)) for p in (PROMETHEUS / "tests").glob("*_test.yml"))
    r = run(promtool, "test", "rules", *tests)
    assert r.returncode == 0, r.stdout + r.stderr
    alerts = {rule["alert"] for g in yaml.safe_load((PROMETHEUS / "rules" / "alerts.yml").read_text())["groups"]
              for rule in g["rules"]}
    text = (PROMETHEUS / "tests" / "alerts_test.yml").read_text()
    cases = yaml.safe_load(text)["tests"]
    tested = [t["alertname"] for case in cases for t in case.get("alert_rule_test", [])]
    for alert in alerts:
        assert any(t == alert for t in tested), f"{alert} has no promtool test"
    fired = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == alerts, alerts - fired  # every alert is seen firing
    # ... and seen quiet: each test case has a series below the threshold, so a fired list of one proves it
    for case in cases:
        for t in case["alert_rule_test"]:
            assert len(t["exp_alerts"]) <= 1, t


def test_scrape_targets_match_the_default_ports():
    """prometheus.yml names ports (Prometheus does not expand variables): they are compose's defaults."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {"vllm": ["localhost:8000"], "vllm-exl3": ["localhost:9469"], "node": ["localhost:9100"]}
    compose = (ROOT / "docker-compose.yml").read_text()
    for default in ("${API_PORT:-8000}", "${METRICS_PORT:-9469}", "${NODE_EXPORTER_PORT:-9100}"):
        assert default in compose


def test_dashboards_are_generated_and_current():
    r = run(sys.executable, "tools/dashboards.py", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    for path in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and board["uid"] == path.stem
        for panel in board["panels"]:
            assert panel["type"] == "row" or (panel["targets"] and all(t["expr"] for t in panel["targets"]))


def test_grafana_provisioning():
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://localhost:${PROMETHEUS_PORT}"
    boards = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/vllm-exl3.yml").read_text())
    assert boards["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_image_and_compose_agree():
    """The image's HEALTHCHECK and compose's run the same command; the image's entrypoint and paths are the ones
    supervisord.conf and compose refer to."""
    text = DOCKERFILE.read_text()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    hc = compose["x-appliance"]["healthcheck"]["test"]
    assert f"CMD {json.dumps(hc[1:])}" in text
    # supervisord under the init that gives the container its exit code (appliance/container_init.py)
    assert ('ENTRYPOINT ["python3", "-m", "vllm_exl3.appliance.container_init", "-c", '
            '"/etc/vllm-exl3/supervisord.conf"]') in text
    for path in ("VLLM_EXL3_RUN_DIR=/run/vllm-exl3", "VLLM_EXL3_SUPERVISOR_D=/etc/vllm-exl3/supervisor.d",
                 "VLLM_EXL3_PRESET_DIR=/etc/vllm-exl3/presets", "VLLM_EXL3_MODEL=/model"):
        assert path in text
    assert re.search(r"^USER 2000$", text, flags=re.M)
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/vllm:26\.10-py3$", text, flags=re.M)
    assert re.search(r"^ARG TORCH_CUDA_ARCH_LIST=12\.1a$", text, flags=re.M)
    assert text.count("tools/check-cubins") == 1 and "exllamav3_ext*.so" in text and "_C*.so" in text
    assert "tools/check-exllamav3-ext /tmp/so/exllamav3/exllamav3_ext*.so" in text

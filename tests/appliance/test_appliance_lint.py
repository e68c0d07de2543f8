"""Static checks of the appliance's files with the real tools: hadolint (Dockerfile), shellcheck (every shell
script in the repository), promtool (Prometheus config), plus consistency between the files."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from support.appliance import ROOT, required, tool

DOCKERFILE = ROOT / "Dockerfile"
PROMTOOL_HINT = "no PyPI package carries it: `apt-get install prometheus`, or put promtool from a Prometheus release on PATH"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_hadolint_finds_nothing():
    hadolint = required("hadolint", tool("hadolint"))
    r = run(hadolint, "--no-color", str(DOCKERFILE))
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


def test_prometheus_config_is_valid():
    promtool = required("promtool", tool("promtool"), PROMTOOL_HINT)
    r = run(promtool, "check", "config", "deploy/prometheus/prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


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
    assert 'ENTRYPOINT ["supervisord", "-c", "/etc/vllm-exl3/supervisord.conf"]' in text
    for path in ("VLLM_EXL3_RUN_DIR=/run/vllm-exl3", "VLLM_EXL3_SUPERVISOR_D=/etc/vllm-exl3/supervisor.d",
                 "VLLM_EXL3_PRESET_DIR=/etc/vllm-exl3/presets", "VLLM_EXL3_MODEL=/model"):
        assert path in text
    assert re.search(r"^USER 2000$", text, flags=re.M)
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/vllm:26\.10-py3$", text, flags=re.M)
    assert re.search(r"^ARG TORCH_CUDA_ARCH_LIST=12\.1a$", text, flags=re.M)
    assert text.count("tools/check-cubins") == 1 and "exllamav3_ext*.so" in text and "_C*.so" in text
    assert "tools/check-exllamav3-ext /tmp/so/exllamav3/exllamav3_ext*.so" in text

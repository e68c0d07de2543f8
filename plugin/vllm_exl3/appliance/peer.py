"""The two-node pair's heartbeat (a supervisord program, standard library only): the head's readiness sees its worker.

A headless TP worker that dies leaves the head's API answering /health and /v1/models: vLLM notices the lost rank
only when the next request's collective fails or hangs. So the worker's container sends the head a UDP datagram
every VLLM_EXL3_HEARTBEAT_INTERVAL seconds (2) on the fabric link, to HEAD_ADDR:VLLM_EXL3_HEARTBEAT_PORT, saying
whether its vLLM holds its connection to the head's rendezvous (the worker's own readiness, health.py). The head
counts its worker alive while such a datagram saying "ready" came within VLLM_EXL3_PEER_TIMEOUT seconds (15);
its readiness is red otherwise, so a dead worker (process, container or box) turns the head red within
VLLM_EXL3_PEER_TIMEOUT + one check interval.

Once the worker had been alive, a head that has been without it for VLLM_EXL3_RENDEZVOUS_GRACE seconds stops its
own vLLM (its engine still waits for a rank that is gone): the exit-on-fatal listener restarts it, and the worker,
restarted by its own rendezvous watchdog, joins the new engine.

Both sides rewrite $VLLM_EXL3_STATE_DIR/peer.json every second (atomically): {"time": float, "role": "head" |
"worker", "peer": "<addr>", "alive": bool, "last_seen": float | null}. On the worker, `alive` is its own
rendezvous connection and `last_seen` the last time it held it.

Anyone who reaches the head's UDP port could otherwise fake a live worker or flood "not ready" until the head
stops its own vLLM. So each datagram is signed with VLLM_EXL3_PEER_SECRET (PEER_SECRET in the .env both boxes
share): `<HMAC-SHA256 hex> <JSON>`, the MAC over a version tag and the JSON. The head ignores a datagram that does
not verify, one whose `time` is not newer than the last it accepted (a replay), and one more than
VLLM_EXL3_PEER_TIMEOUT seconds away from its own clock (a replay after the head restarted; the boxes' clocks
must agree that closely, as NTP keeps them). It logs what it ignored, at most once a minute.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..base import settings
from ..base.state import PEER_FILE, state_file
from ..format.jsonfile import write_json
from .health import HEALTHY, check, stderr_log, stop_vllm, vllm_pid

MAX_DATAGRAM = 1024
SIGNATURE_TAG = b"vllm-exl3 heartbeat 1\n"  # what the MAC covers besides the JSON: this format and its version
MIN_SECRET_CHARS = 16
REJECT_LOG_EVERY_S = 60.0


class PeerSecretError(ValueError):
    """VLLM_EXL3_PEER_SECRET is missing or too short; the message says what to set."""


def peer_secret(env: Mapping[str, str]) -> bytes:
    value = settings.get("VLLM_EXL3_PEER_SECRET", env).strip()
    if len(value) < MIN_SECRET_CHARS:
        raise PeerSecretError(
            ("VLLM_EXL3_PEER_SECRET is not set" if not value else
             f"VLLM_EXL3_PEER_SECRET has {len(value)} characters, fewer than {MIN_SECRET_CHARS}")
            + ": the two boxes sign their heartbeats with it. Put the same PEER_SECRET in the .env of both boxes "
              "(e.g. the output of `openssl rand -hex 32`)")
    return value.encode()


def seal(secret: bytes, message: dict) -> bytes:
    body = json.dumps(message, sort_keys=True).encode()
    return hmac.new(secret, SIGNATURE_TAG + body, hashlib.sha256).hexdigest().encode() + b" " + body


def unseal(secret: bytes, datagram: bytes) -> dict | None:
    """The message of a datagram signed with `secret`, or None (unsigned, forged, damaged, not a JSON object)."""
    mac, _, body = datagram.partition(b" ")
    expected = hmac.new(secret, SIGNATURE_TAG + body, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, expected):
        return None
    try:
        message = json.loads(body)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


@dataclass
class HeadView:
    """What the head knows of its worker (pure: times are arguments)."""

    timeout: float
    peer: str = ""
    last_seen: float | None = None  # the last heartbeat that said "ready"
    ready: bool = False  # what the latest heartbeat said
    detail: str = ""
    sent: float | None = None  # the sender's time of the latest heartbeat accepted

    def heard(self, sender: str, message: dict, now: float) -> str | None:
        """Take a verified heartbeat; or say why not (a replay, or a time too far from ours)."""
        sent = message.get("time")
        if not isinstance(sent, (int, float)) or isinstance(sent, bool):
            return "no time"
        if abs(now - sent) > self.timeout:
            return f"sent {sent - now:+.0f}s from this clock"
        if self.sent is not None and sent <= self.sent:
            return "not newer than the last one (a replay)"
        self.sent = sent
        self.peer, self.ready, self.detail = sender, message.get("ready") is True, str(message.get("detail", ""))
        if self.ready:
            self.last_seen = now
        return None

    def alive(self, now: float) -> bool:
        return self.ready and self.last_seen is not None and now - self.last_seen <= self.timeout

    def document(self, now: float) -> dict:
        return {"time": now, "role": "head", "peer": self.peer, "alive": self.alive(now), "last_seen": self.last_seen}


def heartbeat_port(env: Mapping[str, str]) -> int:
    return settings.get_int("VLLM_EXL3_HEARTBEAT_PORT", env)


class Rejections:
    """Datagrams the head ignored, logged at most once every REJECT_LOG_EVERY_S seconds (a flood stays one line)."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.count, self.reasons, self.logged = log, 0, {}, None

    def add(self, sender: str, reason: str, now: float) -> None:
        self.count += 1
        self.reasons[f"{sender}: {reason}"] = self.reasons.get(f"{sender}: {reason}", 0) + 1
        if self.logged is None or now - self.logged >= REJECT_LOG_EVERY_S:
            shown = "; ".join(f"{k} (x{v})" for k, v in list(self.reasons.items())[:5])
            self.log(f"peer-heartbeat: ignored {self.count} datagram(s) since the last report: {shown}. A worker "
                     "whose heartbeats do not verify has another PEER_SECRET, or its clock is off")
            self.count, self.reasons, self.logged = 0, {}, now


def run_head(env: Mapping[str, str], log: Callable[[str], None], rounds: int | None = None,
             stop: Callable[[int], None] | None = None) -> int:
    secret = peer_secret(env)
    bind = settings.get("VLLM_EXL3_HEAD_ADDR", env) or "0.0.0.0"
    timeout = settings.get_float("VLLM_EXL3_PEER_TIMEOUT", env)
    grace = settings.get_float("VLLM_EXL3_RENDEZVOUS_GRACE", env)
    stop = stop or (lambda pid: stop_vllm(pid, log))
    view = HeadView(timeout)
    rejected = Rejections(log)
    lost_since: float | None = None
    paired: int | None = None  # the head's vLLM pid while its worker was alive
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.bind((bind, heartbeat_port(env)))
        sock.settimeout(1.0)
        log(f"peer-heartbeat: head listening on {bind}:{heartbeat_port(env)}/udp; the worker counts as alive for "
            f"{timeout:g}s after a ready heartbeat")
        was_alive = False
        while rounds is None or rounds > 0:
            rounds = None if rounds is None else rounds - 1
            deadline = time.monotonic() + 1.0
            while (left := deadline - time.monotonic()) > 0:  # drain what came in this second
                sock.settimeout(left)
                try:
                    data, (sender, *_) = sock.recvfrom(MAX_DATAGRAM)
                except (socket.timeout, OSError):
                    continue
                message = unseal(secret, data)
                if message is None or message.get("role") != "worker":
                    rejected.add(sender, "not signed with this PEER_SECRET" if message is None else "not a worker's",
                                 time.time())
                elif (why := view.heard(sender, message, time.time())) is not None:
                    rejected.add(sender, why, time.time())
            now = time.time()
            alive = view.alive(now)
            if alive != was_alive:
                log(f"peer-heartbeat: worker {view.peer or '?'} is " + ("alive" if alive else "not alive ("
                    + (f"it reports: {view.detail}" if not view.ready and view.detail else
                       f"no ready heartbeat for {timeout:g}s") + ")"))
                was_alive = alive
            if alive:
                # The engine the worker joined: fixed when it joins, not followed (a head vLLM restarted while the
                # last heartbeat is still fresh is a new engine the worker is not part of).
                paired, lost_since = paired or vllm_pid(env), None
            elif paired is not None:
                lost_since = lost_since or now
            # Only the engine that had the worker: a new one (restarted) is still waiting for it to join.
            if lost_since is not None and now - lost_since >= grace:
                if vllm_pid(env) == paired:
                    log(f"peer-heartbeat: worker lost {grace:.0f}s ago; stopping the head's vLLM (pid {paired}) so "
                        "it restarts and the worker can join a new engine")
                    stop(paired)
                paired, lost_since = None, None
            try:
                write_json(state_file(PEER_FILE, env), view.document(now), make_parent=True)
            except OSError as e:
                log(f"peer-heartbeat: cannot write {state_file(PEER_FILE, env)}: {e}")
    return 0


def run_worker(env: Mapping[str, str], log: Callable[[str], None], rounds: int | None = None,
               sleep: Callable[[float], None] = time.sleep) -> int:
    secret = peer_secret(env)
    head = settings.get("VLLM_EXL3_HEAD_ADDR", env)
    interval = settings.get_float("VLLM_EXL3_HEARTBEAT_INTERVAL", env)
    target = (head, heartbeat_port(env))
    family = socket.AF_INET6 if ":" in head else socket.AF_INET
    last_seen: float | None = None
    log(f"peer-heartbeat: worker reporting to {head}:{heartbeat_port(env)}/udp every {interval:g}s")
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        while rounds is None or rounds > 0:
            rounds = None if rounds is None else rounds - 1
            code, detail = check("readiness", env)
            now = time.time()
            ready = code == HEALTHY
            last_seen = now if ready else last_seen
            try:
                sock.sendto(seal(secret, {"role": "worker", "ready": ready, "detail": detail, "time": now}), target)
            except OSError as e:  # no route yet: the head's box may be down; keep trying
                detail = f"{detail}; heartbeat not sent: {e}"
            try:
                write_json(state_file(PEER_FILE, env), {"time": now, "role": "worker", "peer": head, "alive": ready,
                                             "last_seen": last_seen}, make_parent=True)
            except OSError as e:
                log(f"peer-heartbeat: cannot write {state_file(PEER_FILE, env)}: {e}")
            sleep(interval)
    return 0


def main(env: Mapping[str, str] = os.environ) -> int:
    role = settings.get("VLLM_EXL3_ROLE", env)
    try:
        if role == "head":
            return run_head(env, stderr_log)
        if role == "worker":
            return run_worker(env, stderr_log)
    except (PeerSecretError, settings.SettingError) as e:
        stderr_log(f"peer-heartbeat: cannot start: {e}")
        return 2
    stderr_log(f"peer-heartbeat: role {role}: no peer")
    return 0


if __name__ == "__main__":
    sys.exit(main())

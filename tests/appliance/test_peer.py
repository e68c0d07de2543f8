"""The pair's heartbeat on real UDP sockets on loopback: the worker reports its readiness, the head publishes its
view in peer.json and its readiness follows it; a head that lost its worker stops the engine the worker was in."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

from support.servers import free_port
from support.health import MODELS, http_server, run_check
from vllm_exl3.appliance.health import peer_verdict
from vllm_exl3.appliance.peer import HeadView, main, run_head, run_worker, seal, unseal

PEER_CONTRACT = {"time": float, "role": str, "peer": str, "alive": bool, "last_seen": (float, type(None))}
SECRET = "a-secret-both-boxes-share"


def heartbeat(ready: bool = True, secret: str = SECRET, **extra) -> bytes:
    return seal(secret.encode(), {"role": "worker", "ready": ready, "time": time.time()} | extra)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_head_view():
    v = HeadView(timeout=15)
    assert not v.alive(100)
    assert v.heard("10.0.0.2", {"ready": True, "time": 99.5}, 100) is None
    assert v.alive(100) and v.alive(115) and not v.alive(116)  # silence past the timeout
    assert v.heard("10.0.0.2", {"ready": False, "detail": "no connection", "time": 116.5}, 117) is None
    assert not v.alive(117) and v.last_seen == 100  # the worker says its vLLM lost the head: not alive at once
    assert v.document(117) == {"time": 117, "role": "head", "peer": "10.0.0.2", "alive": False, "last_seen": 100}
    # replays and datagrams from another time are not heard
    assert "replay" in v.heard("10.0.0.2", {"ready": True, "time": 110}, 118)
    assert "replay" in v.heard("10.0.0.2", {"ready": True, "time": 116.5}, 118)
    assert "+20s" in v.heard("10.0.0.2", {"ready": True, "time": 138}, 118)
    assert "-16s" in v.heard("10.0.0.2", {"ready": True, "time": 102}, 118)
    assert v.heard("10.0.0.2", {"ready": True}, 118) == "no time" and not v.alive(118)


def test_seal_fuzz_only_the_shared_secret_verifies():
    """Seeded fuzz: every change to a sealed datagram (a flipped byte, a cut, another secret, no signature) is
    rejected; the untouched datagram verifies."""
    rng = random.Random(21)
    secret = SECRET.encode()
    for _ in range(300):
        message = {"role": "worker", "ready": rng.random() < 0.5, "time": rng.uniform(0, 2e9),
                   "detail": "x" * rng.randrange(40)}
        sealed = seal(secret, message)
        assert unseal(secret, sealed) == message
        i = rng.randrange(len(sealed))
        flipped = sealed[:i] + bytes([sealed[i] ^ (1 << rng.randrange(8))]) + sealed[i + 1:]
        for bad in (flipped, sealed[:rng.randrange(len(sealed))], seal(b"another-secret-entirely", message),
                    json.dumps(message).encode(), b"", b" " + sealed):
            assert unseal(secret, bad) is None, bad


def test_verdict_from_the_state_file(tmp_path):
    env = {"VLLM_EXL3_STATE_DIR": str(tmp_path), "VLLM_EXL3_PEER_TIMEOUT": "15"}
    assert "no heartbeat state" in peer_verdict(env)
    doc = {"time": 1000.0, "role": "head", "peer": "10.0.0.2", "alive": True, "last_seen": 999.0}
    (tmp_path / "peer.json").write_text(json.dumps(doc))
    assert peer_verdict(env, now=1001) is None
    assert "stale" in peer_verdict(env, now=1020)
    (tmp_path / "peer.json").write_text(json.dumps(doc | {"alive": False}))
    assert peer_verdict(env, now=1011) == "worker not alive: last ready heartbeat 12s ago from 10.0.0.2"


def test_worker_heartbeats_reach_the_head_and_its_readiness_follows(tmp_path):
    port = free_udp_port()
    head_dir, worker_dir = tmp_path / "head", tmp_path / "worker"
    with socket.socket() as rendezvous:  # the head's rendezvous port; this process plays the worker's vLLM
        rendezvous.bind(("127.0.0.1", 0))
        rendezvous.listen()
        base = {"VLLM_EXL3_HEAD_ADDR": "127.0.0.1", "VLLM_EXL3_HEARTBEAT_PORT": str(port),
                "VLLM_EXL3_MASTER_PORT": str(rendezvous.getsockname()[1]), "VLLM_EXL3_PEER_TIMEOUT": "3",
                "VLLM_EXL3_RENDEZVOUS_GRACE": "1000", "VLLM_EXL3_PEER_SECRET": SECRET}
        worker_dir.mkdir()
        (worker_dir / "vllm.pid").write_text(f"{os.getpid()}\n")
        worker_env = base | {"VLLM_EXL3_ROLE": "worker", "VLLM_EXL3_RUN_DIR": str(worker_dir),
                             "VLLM_EXL3_STATE_DIR": str(worker_dir / "state"), "VLLM_EXL3_HEARTBEAT_INTERVAL": "0.2"}
        head_env = base | {"VLLM_EXL3_ROLE": "head", "VLLM_EXL3_RUN_DIR": str(head_dir),
                           "VLLM_EXL3_STATE_DIR": str(head_dir / "state")}
        head_log: list[str] = []
        head = threading.Thread(target=run_head, args=(head_env, head_log.append, 8))
        head.start()
        time.sleep(0.3)
        connection = socket.create_connection(rendezvous.getsockname())  # the worker's vLLM joined
        run_worker(worker_env, lambda m: None, rounds=8, sleep=time.sleep)
        doc = json.loads((head_dir / "state" / "peer.json").read_text())
        assert doc["alive"] is True and doc["peer"] == "127.0.0.1" and doc["role"] == "head"
        assert all(isinstance(doc[k], t) for k, t in PEER_CONTRACT.items()) and set(doc) == set(PEER_CONTRACT)
        wdoc = json.loads((worker_dir / "state" / "peer.json").read_text())
        assert wdoc["role"] == "worker" and wdoc["alive"] is True and wdoc["peer"] == "127.0.0.1"

        # The head's readiness: its API serves, and its worker is alive.
        pid_env = {"VLLM_EXL3_RUN_DIR": str(tmp_path)}
        (tmp_path / "vllm.pid").write_text(f"{os.getpid()}\n")
        with http_server({"/health": (200, b""), "/v1/models": (200, MODELS)}) as api:
            env = head_env | pid_env | {"VLLM_EXL3_PORT": str(api), "VLLM_EXL3_SERVED_NAME": "demo"}
            assert run_check("readiness", env).returncode == 0

            connection.close()  # the worker's vLLM lost the head (or died): its heartbeats say so
            run_worker(worker_env, lambda m: None, rounds=5, sleep=time.sleep)
            head.join(30)
            r = run_check("readiness", env)
            assert r.returncode == 1 and "worker not alive" in r.stdout, r.stdout
        assert json.loads((worker_dir / "state" / "peer.json").read_text())["alive"] is False
    assert any("is alive" in ln for ln in head_log) and any("not alive (it reports: worker:" in ln for ln in head_log)


def test_head_stops_the_engine_its_worker_left_and_only_that_one(tmp_path):
    port = free_udp_port()
    vllm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    (tmp_path / "vllm.pid").write_text(f"{vllm.pid}\n")
    env = {"VLLM_EXL3_ROLE": "head", "VLLM_EXL3_HEAD_ADDR": "127.0.0.1", "VLLM_EXL3_HEARTBEAT_PORT": str(port),
           "VLLM_EXL3_RUN_DIR": str(tmp_path), "VLLM_EXL3_STATE_DIR": str(tmp_path / "state"),
           "VLLM_EXL3_PEER_TIMEOUT": "1", "VLLM_EXL3_RENDEZVOUS_GRACE": "2", "VLLM_EXL3_PEER_SECRET": SECRET}
    stopped, log = [], []
    head = threading.Thread(target=run_head, args=(env, log.append, 7), kwargs={"stop": stopped.append})
    head.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(3):  # the worker is alive for a moment, then silent (its box went away)
                s.sendto(heartbeat(), ("127.0.0.1", port))
                time.sleep(0.3)
        head.join(30)
    finally:
        vllm.kill()
        vllm.wait()
    assert stopped == [vllm.pid], log  # once, after the grace
    assert any("worker lost 2s ago; stopping the head's vLLM" in ln for ln in log)

    # The head's vLLM was restarted meanwhile (a new engine, still waiting for its worker): left alone.
    stopped.clear()
    newer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    (tmp_path / "vllm.pid").write_text(f"{os.getpid()}\n")  # the engine the worker is in: this process
    head = threading.Thread(target=run_head, args=(env, log.append, 7), kwargs={"stop": stopped.append})
    head.start()
    try:
        state = tmp_path / "state" / "peer.json"
        state.unlink()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(25):  # until the head saw it (a few seconds at most)
                if state.exists() and json.loads(state.read_text())["alive"]:
                    break
                s.sendto(heartbeat(), ("127.0.0.1", port))
                time.sleep(0.2)
            else:
                raise AssertionError(f"the head never saw the worker alive: {log}")
        (tmp_path / "vllm.pid").write_text(f"{newer.pid}\n")  # restarted before the grace ran out
        head.join(30)
    finally:
        newer.kill()
        newer.wait()
    assert not stopped, log


def head_env(tmp_path, port: int, **extra: str) -> dict[str, str]:
    return {"VLLM_EXL3_ROLE": "head", "VLLM_EXL3_HEAD_ADDR": "127.0.0.1", "VLLM_EXL3_HEARTBEAT_PORT": str(port),
            "VLLM_EXL3_RUN_DIR": str(tmp_path), "VLLM_EXL3_STATE_DIR": str(tmp_path / "state"),
            "VLLM_EXL3_PEER_SECRET": SECRET} | extra


def test_forged_heartbeats_neither_fake_a_worker_nor_stop_the_head(tmp_path):
    """What anyone on the fabric could send: unsigned "ready" datagrams (a fake live worker), a flood of "not
    ready" ones signed with a guessed secret (which used to turn the head red and then stop its vLLM), replays of
    a real heartbeat. None of it is heard: the worker is alive exactly as long as its one real heartbeat says."""
    port = free_udp_port()
    env = head_env(tmp_path, port, VLLM_EXL3_PEER_TIMEOUT="3", VLLM_EXL3_RENDEZVOUS_GRACE="1000")
    state, log = tmp_path / "state" / "peer.json", []
    head = threading.Thread(target=run_head, args=(env, log.append, 9))
    head.start()
    wait_for(state.exists, 10)
    alive_seen = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        real = heartbeat()  # the worker's, captured by the attacker
        s.sendto(real, ("127.0.0.1", port))
        heard_at = time.monotonic()
        wait_for(lambda: json.loads(state.read_text())["alive"], 5)
        i = 0
        while time.monotonic() - heard_at < 6:
            forged = [json.dumps({"role": "worker", "ready": True, "time": time.time()}).encode(),
                      heartbeat(ready=False, secret="guessed-secret-0000", detail="flood"), real,
                      seal(SECRET.encode(), {"role": "worker", "ready": True})]  # signed, no time: not a heartbeat
            s.sendto(forged[i % len(forged)], ("127.0.0.1", port))
            i += 1
            if i % 20 == 0:
                alive_seen.append((time.monotonic() - heard_at, json.loads(state.read_text())["alive"]))
            time.sleep(0.01)
    head.join(30)
    # alive while the real heartbeat is fresh (no forged "not ready" heard), then not (no forged "ready" heard)
    assert all(alive for t, alive in alive_seen if t < 2.5), alive_seen
    assert not any(alive for t, alive in alive_seen if t > 4.5), alive_seen
    assert not any("it reports: flood" in ln for ln in log), log
    assert any("not signed with this PEER_SECRET" in ln for ln in log), log
    assert sum("ignored" in ln for ln in log) == 1  # one report a minute, not a line per datagram


def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_no_secret_no_heartbeat(tmp_path, capsys):
    env = head_env(tmp_path, free_udp_port(), VLLM_EXL3_PEER_SECRET="")
    assert main(env) == 2
    err = capsys.readouterr().err
    assert "VLLM_EXL3_PEER_SECRET is not set" in err and "PEER_SECRET in the .env of both boxes" in err
    assert main(env | {"VLLM_EXL3_ROLE": "worker", "VLLM_EXL3_PEER_SECRET": "short"}) == 2
    assert "5 characters, fewer than 16" in capsys.readouterr().err

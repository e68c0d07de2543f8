"""The pair's heartbeat on real UDP sockets on loopback: the worker reports its readiness, the head publishes its
view in peer.json and its readiness follows it; a head that lost its worker stops the engine the worker was in."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from support.servers import free_port
from test_health import MODELS, http_server, run_check
from vllm_exl3.appliance.peer import HeadView, peer_verdict, run_head, run_worker

PEER_CONTRACT = {"time": float, "role": str, "peer": str, "alive": bool, "last_seen": (float, type(None))}


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_head_view():
    v = HeadView(timeout=15)
    assert not v.alive(100)
    v.heard("10.0.0.2", {"ready": True}, 100)
    assert v.alive(100) and v.alive(115) and not v.alive(116)  # silence past the timeout
    v.heard("10.0.0.2", {"ready": False, "detail": "no connection"}, 117)
    assert not v.alive(117) and v.last_seen == 100  # the worker says its vLLM lost the head: not alive at once
    assert v.document(117) == {"time": 117, "role": "head", "peer": "10.0.0.2", "alive": False, "last_seen": 100}


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
                "VLLM_EXL3_RENDEZVOUS_GRACE": "1000"}
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
           "VLLM_EXL3_PEER_TIMEOUT": "1", "VLLM_EXL3_RENDEZVOUS_GRACE": "2"}
    stopped, log = [], []
    head = threading.Thread(target=run_head, args=(env, log.append, 7), kwargs={"stop": stopped.append})
    head.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(3):  # the worker is alive for a moment, then silent (its box went away)
                s.sendto(json.dumps({"role": "worker", "ready": True}).encode(), ("127.0.0.1", port))
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
                s.sendto(json.dumps({"role": "worker", "ready": True}).encode(), ("127.0.0.1", port))
                time.sleep(0.2)
            else:
                raise AssertionError(f"the head never saw the worker alive: {log}")
        (tmp_path / "vllm.pid").write_text(f"{newer.pid}\n")  # restarted before the grace ran out
        head.join(30)
    finally:
        newer.kill()
        newer.wait()
    assert not stopped, log

"""The health checks and the worker's rendezvous watchdog, on real processes and sockets.

The states a real vLLM passes through are covered end to end in test_appliance_e2e.py; here a small stdlib HTTP
server stands in only for answers vLLM gives rarely (503 from a dead engine, a model list without our name).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from support.health import DRAINING, MODELS, http_server, pid_file, run_check
from vllm_exl3.appliance.health import (decode_address, group_members, process_state, stop_leftovers, stop_vllm,
                                        worker_connected)


def test_proc_net_addresses():
    assert decode_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert decode_address("0000000000000000FFFF00000100007F:7539") == ("127.0.0.1", 30009)  # IPv4-mapped
    assert decode_address("00000000000000000000000001000000:0050") == ("::1", 80)


def test_connection_of_a_process_tree_to_the_head():
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        assert not worker_connected(os.getpid(), "127.0.0.1", port)
        client = socket.create_connection(("127.0.0.1", port))
        peer, _ = head.accept()
        assert worker_connected(os.getpid(), "localhost", port)  # names resolve
        assert not worker_connected(os.getpid(), "127.0.0.1", port + 1 if port < 65535 else port - 1)
        peer.close()  # the head goes away: our side is no longer ESTABLISHED
        time.sleep(0.2)
        assert not worker_connected(os.getpid(), "127.0.0.1", port)
        client.close()


def test_no_process_is_unhealthy_in_both_modes(tmp_path):
    for mode in ("liveness", "readiness"):
        r = run_check(mode, {"VLLM_EXL3_RUN_DIR": str(tmp_path), "VLLM_EXL3_ROLE": "head"})
        assert r.returncode == 1 and "no running vLLM process" in r.stdout
    r = run_check("sometimes", {})
    assert r.returncode == 1 and "usage" in r.stderr


@pytest.mark.parametrize("routes,live,ready,says", [
    ({"/health": (200, b""), "/v1/models": (200, MODELS)}, 0, 0, "serving 'demo'"),
    ({"/health": (503, b""), "/v1/models": (200, MODELS)}, 1, 1, "503"),
    ({"/health": (503, DRAINING), "/v1/models": (200, MODELS)}, 0, 1, "draining"),  # an orderly stop: alive
    ({"/health": (200, b""), "/v1/models": (200, b'{"data": [{"id": "other"}]}')}, 0, 1, "['other'], not 'demo'"),
    (None, 0, 1, "booting"),  # nothing listens yet
])
def test_api_roles(tmp_path, routes, live, ready, says):
    env = pid_file(tmp_path, os.getpid()) | {"VLLM_EXL3_ROLE": "single", "VLLM_EXL3_SERVED_NAME": "demo"}
    if routes is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["VLLM_EXL3_PORT"] = str(s.getsockname()[1])
        results = run_check("liveness", env), run_check("readiness", env)
    else:
        with http_server(routes) as port:
            env["VLLM_EXL3_PORT"] = str(port)
            results = run_check("liveness", env), run_check("readiness", env)
    assert [r.returncode for r in results] == [live, ready], [r.stdout for r in results]
    assert any(says in r.stdout for r in results)


def test_an_api_that_accepts_but_never_answers_fails_liveness(tmp_path):
    env = pid_file(tmp_path, os.getpid()) | {"VLLM_EXL3_ROLE": "single", "VLLM_EXL3_HEALTH_TIMEOUT": "1"}
    with socket.socket() as hung:  # the kernel completes the handshake; nothing ever reads or answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        env["VLLM_EXL3_PORT"] = str(hung.getsockname()[1])
        r = run_check("liveness", env)
    assert r.returncode == 1 and "gave no answer within 1s (hung)" in r.stdout, r.stdout


def test_api_key_is_sent_to_v1(tmp_path):
    env = pid_file(tmp_path, os.getpid()) | {"VLLM_EXL3_ROLE": "single", "VLLM_EXL3_SERVED_NAME": "demo"}
    with http_server({"/health": (200, b""), "/v1/models": (200, MODELS)}, key="s3cret") as port:
        env["VLLM_EXL3_PORT"] = str(port)
        without = run_check("readiness", env | {"VLLM_API_KEY": ""})
        assert without.returncode == 1 and "not 'demo'" in without.stdout
        assert run_check("readiness", env | {"VLLM_API_KEY": "s3cret"}).returncode == 0
        assert run_check("readiness", env | {"VLLM_API_KEY": "s3cret", "VLLM_EXL3_HOST": "127.0.0.1"}).returncode == 0


@contextmanager
def fake_worker(port: int):
    """A process (its own group, like a supervisord program) that connects to the head and stays."""
    code = ("import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
            "print('joined', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "joined"
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()


def test_worker_readiness_and_watchdog(tmp_path):
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        with fake_worker(port) as worker:
            peer, _ = head.accept()
            env = pid_file(tmp_path, worker.pid) | {"VLLM_EXL3_ROLE": "worker", "VLLM_EXL3_HEAD_ADDR": "127.0.0.1",
                                                    "VLLM_EXL3_MASTER_PORT": str(port),
                                                    "VLLM_EXL3_RENDEZVOUS_GRACE": "1"}
            assert run_check("readiness", env).returncode == 0
            watchdog = subprocess.Popen([sys.executable, "-m", "vllm_exl3.appliance.health", "watch"], env={**os.environ, **env},
                                        stderr=subprocess.PIPE, text=True)
            try:
                time.sleep(1.5)
                assert worker.poll() is None  # connected: left alone
                peer.close()  # the head dies
                worker.wait(15)  # the watchdog stopped the worker's process group
                r = run_check("readiness", env)
                assert r.returncode == 1 and "no running vLLM process" in r.stdout
            finally:
                watchdog.kill()
                log = watchdog.communicate()[1]
            assert f"vLLM pid {worker.pid} joined" in log and f"vLLM pid {worker.pid} lost the head" in log
            assert run_check("liveness", env).returncode == 1


def test_watchdog_idles_on_other_roles():
    r = subprocess.run([sys.executable, "-m", "vllm_exl3.appliance.health", "watch"], capture_output=True, text=True,
                       env={**os.environ, "VLLM_EXL3_ROLE": "head"}, timeout=30)
    assert r.returncode == 0 and "no rendezvous to watch" in r.stderr


# --- stopping vLLM: its process tree as vLLM has it (an API server leading its group, an engine child) --------
# The leader drains on SIGTERM (keeps serving DRAIN_S seconds, then stops its engine and exits), as vLLM's API
# server does with --shutdown-timeout; the engine has no handler of its own, as SIGTERM to the group kills it.
TREE = r"""
import os, signal, subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
def drain(*_):
    if sys.argv[1] == "ignore":
        return
    time.sleep(float(sys.argv[1]))
    engine.terminate(); engine.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, drain)
print(engine.pid, flush=True)  # only now: a SIGTERM before the handler would kill the leader at once
time.sleep(300)
"""


@contextmanager
def vllm_like_tree(drain: str):
    leader = subprocess.Popen([sys.executable, "-c", TREE, drain], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    engine = int(leader.stdout.readline())
    try:
        yield leader, engine
    finally:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        leader.wait()


def gone(pid: int) -> bool:
    return process_state(pid) in (None, "Z", "X")


def test_stop_lets_vllm_drain_then_leaves_nothing_of_its_group():
    """SIGTERM to the main process only: the engine keeps running while the API server drains (a SIGTERM to the
    group killed it at once, cutting every stream); once the main process is done, nothing of the group is left."""
    with vllm_like_tree("1.5") as (leader, engine):
        lines = []
        stopper = threading.Thread(target=stop_vllm, args=(leader.pid, lines.append, 20))
        started = time.monotonic()
        stopper.start()
        time.sleep(0.8)
        assert not gone(engine) and leader.poll() is None  # draining: the engine still serves
        stopper.join(30)
        assert leader.wait(5) == 0 and gone(engine) and not group_members(leader.pid)
        assert 1.4 < time.monotonic() - started < 10 and not lines  # no SIGKILL was needed


def test_stop_kills_the_group_of_a_vllm_that_does_not_finish():
    with vllm_like_tree("ignore") as (leader, engine):
        lines = []
        stop_vllm(leader.pid, lines.append, timeout=1)
        leader.wait(5)
        assert leader.returncode == -signal.SIGKILL and not group_members(leader.pid)
        assert any("did not finish within 1s of SIGTERM; SIGKILL" in ln for ln in lines)


def test_leftovers_of_a_killed_api_server_are_stopped_and_nothing_else():
    """`kill -9` of vLLM's API server leaves its engine running in its group; a new vLLM must not start beside
    it. A group whose leader is alive is another program's, and is left alone."""
    with vllm_like_tree("ignore") as (leader, engine):
        lines = []
        assert stop_leftovers(leader.pid, lines.append) == 0 and not gone(engine)  # leader alive: not leftovers
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        assert not gone(engine) and group_members(leader.pid) == [engine]  # the orphaned engine
        assert stop_leftovers(leader.pid, lines.append, grace=2) == 1
        assert gone(engine) and not group_members(leader.pid)
        assert any(f"left 1 process(es) running: {engine}" in ln for ln in lines)

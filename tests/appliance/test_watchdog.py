"""The memory watchdog against fake meminfo and PSI files (paths are settings), with a real process group in
vLLM's place: readings, states, the state file's exact contract, readiness, and the stop below the hard floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support.appliance import HEALTHCHECK
from vllm_exl3.appliance.watchdog import GIB, Sample, Watchdog, read_meminfo, read_psi, run

CONTRACT = {"time": float, "mem_available_bytes": int, "mem_total_bytes": int, "swap_used_bytes": int,
            "psi_some_avg10": (float, type(None)), "psi_full_avg10": (float, type(None)), "state": str,
            "soft_floor_bytes": int, "hard_floor_bytes": int, "soft_events_total": int, "hard_stops_total": int}
PSI = "some avg10={some} avg60=0.50 avg300=0.10 total=123456\nfull avg10={full} avg60=0.20 avg300=0.05 total=6543\n"


def meminfo(available_gib: float, swap_used_kb: int = 0) -> str:
    return (f"MemTotal:       125000000 kB\nMemFree:          1000000 kB\n"
            f"MemAvailable:   {int(available_gib * GIB / 1024)} kB\nSwapTotal:        8000000 kB\n"
            f"SwapFree:         {8000000 - swap_used_kb} kB\n")


def test_readings(tmp_path):
    m, p = tmp_path / "meminfo", tmp_path / "psi"
    m.write_text(meminfo(10, swap_used_kb=2048))
    assert read_meminfo(m) == (125000000 * 1024, int(10 * GIB / 1024) * 1024, 2048 * 1024)
    p.write_text(PSI.format(some="3.25", full="1.50"))
    assert read_psi(p) == (3.25, 1.5)
    assert read_psi(tmp_path / "none") == (None, None)  # a kernel without PSI
    m.write_text("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match="no MemAvailable line"):
        read_meminfo(m)


def test_states_and_counters():
    stops, lines = [], []
    pids = iter([101, 101, 101, 202])
    dog = Watchdog(4 * GIB, 2 * GIB, 10.0, stops.append, lambda: next(pids), lines.append)

    def tick(avail_gib, full=0.0):
        return dog.tick(Sample(0.0, int(avail_gib * GIB), 100 * GIB, 0, 0.0, full))

    assert [tick(8), tick(3.9), tick(3), tick(8)] == ["ok", "soft", "soft", "ok"]
    assert dog.soft_events_total == 1 and not stops  # one episode, logged once
    assert tick(8, full=12.5) == "soft" and dog.soft_events_total == 2  # pressure alone
    assert [tick(1.9), tick(1.5), tick(1.0)] == ["hard", "hard", "hard"]
    assert stops == [101] and dog.hard_stops_total == 1  # once per vLLM process, not once per second
    assert tick(1.0) == "hard" and stops == [101, 202]  # a new vLLM that starts while memory is short
    assert any("stopping vLLM (pid 101)" in ln for ln in lines)
    with pytest.raises(ValueError, match="HARD_FLOOR_GIB below"):
        Watchdog(1, 2, 10.0, stops.append, lambda: None, lines.append)


def test_run_writes_the_state_contract_and_stops_vllm_below_the_hard_floor(tmp_path):
    m, p, state_dir, run_dir = tmp_path / "meminfo", tmp_path / "psi", tmp_path / "state", tmp_path / "run"
    run_dir.mkdir()
    vllm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    (run_dir / "vllm.pid").write_text(f"{vllm.pid}\n")
    env = {"VLLM_EXL3_MEMINFO": str(m), "VLLM_EXL3_PSI": str(p), "VLLM_EXL3_STATE_DIR": str(state_dir),
           "VLLM_EXL3_RUN_DIR": str(run_dir), "VLLM_EXL3_MEM_SOFT_FLOOR_GIB": "4", "VLLM_EXL3_MEM_HARD_FLOOR_GIB": "2",
           "VLLM_EXL3_MEM_STOP_GRACE": "5", "VLLM_EXL3_ROLE": "worker"}
    readings = [(3, "0.00"), (1, "25.00"), (1, "30.00")]  # after an ok reading: soft, hard, hard
    m.write_text(meminfo(8))
    p.write_text(PSI.format(some="1.00", full="0.00"))
    docs, lines = [], []

    def after_tick(_interval):  # the watchdog's sleep: record what it published, then change the readings
        docs.append(json.loads((state_dir / "memory-watchdog.json").read_text()))
        if readings:
            avail, full = readings.pop(0)
            m.write_text(meminfo(avail))
            p.write_text(PSI.format(some="1.00", full=full))

    try:
        assert run(env, lines.append, rounds=4, sleep=after_tick) == 0
        vllm.wait(15)  # stopped by its process group's SIGTERM
    finally:
        if vllm.poll() is None:
            vllm.kill()
            vllm.wait()
    assert [d["state"] for d in docs] == ["ok", "soft", "hard", "hard"]
    for d in docs:
        assert set(d) == set(CONTRACT) and all(isinstance(d[k], t) for k, t in CONTRACT.items()), d
    last = docs[-1]
    assert last["soft_events_total"] == 1 and last["hard_stops_total"] == 1 and last["psi_full_avg10"] == 30.0
    assert last["soft_floor_bytes"] == 4 * GIB and last["hard_floor_bytes"] == 2 * GIB
    assert abs(last["time"] - time.time()) < 30 and last["mem_total_bytes"] == 125000000 * 1024
    assert not [f for f in os.listdir(state_dir) if f != "memory-watchdog.json"]  # no temporary files left
    assert any(f"stopping vLLM (pid {vllm.pid})" in ln for ln in lines)


def readiness(env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), "readiness"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=30)


def test_readiness_is_red_while_memory_is_short(tmp_path):
    """A worker (its readiness needs no HTTP server) connected to nothing would be red anyway; so this uses a
    worker whose rendezvous check passes: this test process holding a connection to a listening socket."""
    import socket

    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        with socket.create_connection(head.getsockname()):
            (tmp_path / "vllm.pid").write_text(f"{os.getpid()}\n")
            env = {"VLLM_EXL3_RUN_DIR": str(tmp_path), "VLLM_EXL3_ROLE": "worker", "VLLM_EXL3_HEAD_ADDR": "127.0.0.1",
                   "VLLM_EXL3_MASTER_PORT": str(head.getsockname()[1]), "VLLM_EXL3_STATE_DIR": str(tmp_path / "s")}
            assert readiness(env).returncode == 0  # no state file: no verdict
            (tmp_path / "s").mkdir()
            doc = {"time": time.time(), "state": "soft", "mem_available_bytes": 3 * GIB, "soft_floor_bytes": 4 * GIB,
                   "psi_full_avg10": 0.0}
            (tmp_path / "s" / "memory-watchdog.json").write_text(json.dumps(doc))
            r = readiness(env)
            assert r.returncode == 1 and "memory soft: MemAvailable 3.00 GiB, soft floor 4.00 GiB" in r.stdout
            (tmp_path / "s" / "memory-watchdog.json").write_text(json.dumps(doc | {"time": time.time() - 60}))
            assert readiness(env).returncode == 0  # a stale file: the watchdog is not running, no verdict
            (tmp_path / "s" / "memory-watchdog.json").write_text(json.dumps(doc | {"state": "ok"}))
            assert readiness(env).returncode == 0

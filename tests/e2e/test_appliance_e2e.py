"""The appliance for real, without Docker: supervisord with deploy/supervisord.conf runs the launcher, which runs
vLLM's CPU build on the bundled EXL3 demo pack; the health checks judge it; crashes are recovered.

Two "Sparks" on loopback: two supervisord trees (head, worker) started by the same config, vLLM's multi-node
engine with `--nnodes 2` over gloo/TCP (TP 2, one rank per "node", each bound to its own core).
"""

from __future__ import annotations

import os
import re
import signal

import pytest
import requests

from support.appliance import alive, appliance_env, completion, health, kill_group, required, supervised, tail, tool, wait_until
from support.servers import free_port
from vllm_exl3.appliance.health import group_members

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def supervisord():
    return required("supervisord (PyPI supervisor)", tool("supervisord"))


def test_supervised_single_serves_recovers_from_a_crash(tmp_path, request):
    port, key = free_port(), "appliance-test-key"
    env = appliance_env("single", tmp_path / "run", VLLM_EXL3_PORT=str(port), VLLM_API_KEY=key)
    with supervised(env, tmp_path / "supervisord.log") as box:
        assert not box.healthy()  # nothing answers before vLLM is up
        box.wait_healthy()  # with the key: vLLM guards /v1/models with it
        with pytest.raises(requests.HTTPError, match="401"):
            completion(port)
        text = completion(port, api_key=key)["choices"][0]["text"]
        assert text
        assert exported_backends(env) == {(kind, "torch", "0", "single") for kind in ("linear", "linear_group", "moe")}
        first = box.vllm_pid
        assert health(env, "liveness").returncode == 0

        engine = sorted(p for p in group_members(first) if p != first)
        assert engine  # vLLM's engine core runs in the API server's process group
        request.addfinalizer(lambda: kill_group(first))  # should the test fail, leave no orphaned engine behind
        os.kill(first, signal.SIGKILL)  # the API server alone dies (kill -9, the OOM killer): its engine is orphaned
        wait_until("vLLM down", lambda: not alive(first), 30)
        assert not box.healthy()
        wait_until("a new vLLM", lambda: box.vllm_pid not in (None, first), 60, box.proc, box.log)
        # The new vLLM started only once the old group was gone: nothing of it runs beside the new one.
        assert not group_members(first), group_members(first)
        box.wait_healthy()
        assert completion(port, api_key=key)["choices"][0]["text"] == text  # same pack, greedy: same tokens
        log = box.log.read_text()
        assert "exited: vllm (terminated by SIGKILL" in log and log.count("spawned: 'vllm'") == 2
        assert f"the previous vLLM (process group {first}) left" in log, tail(box.log)
        # reaped before the new launch's preflight, whose memory plan would have counted the orphan's memory
        assert log.index(f"the previous vLLM (process group {first}) left") < log.rindex("preflight: ok   pack"), \
            tail(box.log)
        assert log.count("--load-format exl3_parallel") == 2 and "with 8 workers" in log  # the preset's loader


BACKEND_INFO = re.compile(
    r'^vllm_exl3_backend_info\{backend="(\w+)",layer_type="(\w+)",rank="(\d+)",role="(\w+)"\} 1\.0$', re.M)


def exported_backends(env: dict[str, str]) -> set[tuple[str, str, str, str]]:
    """(layer_type, backend, rank, role) of vllm_exl3_backend_info from the box's metrics exporter
    (deploy/supervisor.d/metrics-exporter.conf)."""
    text = requests.get(f"http://127.0.0.1:{env['VLLM_EXL3_METRICS_PORT']}/metrics", timeout=10).text
    return {(layer_type, backend, rank, role) for backend, layer_type, rank, role in BACKEND_INFO.findall(text)}


def two_node_env(role: str, tmp_path, master_port: int, api_port: int) -> dict[str, str]:
    return appliance_env(
        role, tmp_path / role,
        VLLM_EXL3_HEAD_ADDR="127.0.0.1", VLLM_EXL3_MASTER_PORT=str(master_port), VLLM_EXL3_PORT=str(api_port),
        VLLM_HOST_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo", VLLM_EXL3_HEAD_WAIT="240",
        VLLM_EXL3_RENDEZVOUS_GRACE="5", VLLM_EXL3_PEER_SECRET="two-node-test-secret-0123",
        # one core per "node": both nodes' rank 0 would otherwise bind the same core
        VLLM_CPU_OMP_THREADS_BIND="0" if role == "head" else "1")


def test_two_nodes_tp2_serve_and_rejoin_after_head_crash(tmp_path):
    master, api = free_port(), free_port()
    head_env = two_node_env("head", tmp_path, master, api)
    worker_env = two_node_env("worker", tmp_path, master, api)
    with supervised(head_env, tmp_path / "head.log") as head, \
            supervised(worker_env, tmp_path / "worker.log") as worker:
        head.wait_healthy()
        worker.wait_healthy(30)
        reply = completion(api)
        assert reply["usage"]["completion_tokens"] == 8
        assert "-tp2-" in reply["system_fingerprint"]  # vLLM's own record that this engine runs TP 2
        wlog = worker.log.read_text()
        assert "--nnodes 2 --node-rank 1 --headless" in wlog and "head rendezvous: 127.0.0.1" in wlog
        assert "--nnodes 2 --node-rank 0" in head.log.read_text()
        # each "Spark" exports its own rank through its own exporter, the headless worker included
        assert {b[2:] for b in exported_backends(head_env)} == {("0", "head")}
        assert {b[2:] for b in exported_backends(worker_env)} == {("1", "worker")}

        head_vllm, worker_vllm = head.vllm_pid, worker.vllm_pid
        kill_group(head_vllm, signal.SIGKILL)  # the head box's vLLM dies
        # The worker notices the lost rendezvous, the watchdog restarts it, and it waits for the new head.
        wait_until("the worker's vLLM restarted", lambda: worker.vllm_pid not in (None, worker_vllm), 120,
                   worker.proc, worker.log)
        head.wait_healthy()
        worker.wait_healthy(60)
        assert completion(api)["choices"][0]["text"] == reply["choices"][0]["text"]
        assert f"vLLM pid {worker_vllm} lost the head" in worker.log.read_text(), tail(worker.log)

        # The worker dies: the head's readiness turns red within 30 s (the worker's heartbeat says so), the head
        # stops the engine that lost its rank, and the pair re-forms on its own.
        head_vllm, worker_vllm = head.vllm_pid, worker.vllm_pid
        kill_group(worker_vllm, signal.SIGKILL)
        red_after = wait_until("the head's readiness to turn red", lambda: not head.healthy(), 30, head.proc, head.log)
        print(f"head red {red_after:.0f}s after its worker died")
        wait_until("the head's vLLM restarted", lambda: head.vllm_pid not in (None, head_vllm), 120, head.proc,
                   head.log)
        head.wait_healthy()
        worker.wait_healthy(120)
        assert completion(api)["choices"][0]["text"] == reply["choices"][0]["text"]
        assert f"stopping the head's vLLM (pid {head_vllm})" in head.log.read_text(), tail(head.log)

"""The appliance for real, without Docker: supervisord with deploy/supervisord.conf runs the launcher, which runs
vLLM's CPU build on the bundled EXL3 demo pack; the health checks judge it; crashes are recovered. (One box's
crash and restart are tested in a real container: tests/appliance/test_container_single.py.)

Two "Sparks" on loopback: two supervisord trees (head, worker) started by the same config, vLLM's multi-node
engine with `--nnodes 2` over gloo/TCP (TP 2, one rank per "node", each bound to its own core).
"""

from __future__ import annotations

import re
import signal

import pytest
import requests

from support.appliance import appliance_env, completion, kill_group, required, supervised, tail, tool, wait_until
from support.servers import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def supervisord():
    return required("supervisord (PyPI supervisor)", tool("supervisord"))


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

        # The worker's death (the head turns red, stops its engine, and the pair re-forms) is checked in the real
        # engine: tests/appliance/test_container_pair.py.

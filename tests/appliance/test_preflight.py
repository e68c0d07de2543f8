"""Preflight checks for real: fixture packs (intact and damaged), this machine's loopback interface and routes,
fake sysfs trees for NICs and RDMA devices this machine does not have, and real sockets for the head."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import pytest

from vllm_exl3 import demo
from vllm_exl3.appliance.preflight import (check_head_is_local, check_head_reachable, check_kernel, check_network, check_pack,
                                 gpu_present, interface_addresses, nccl_interfaces, route_source, wait_for_port)

NOT_OURS = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never assigned to a real machine; no packet is sent to it


def test_intact_pack_passes():
    check, pack = check_pack(demo.PACK)
    assert check.ok and pack is not None
    assert "Qwen3MoeForCausalLM, 57 EXL3 linears, 1 file(s)" in check.detail


def test_truncated_pack_fails_naming_the_file(tmp_path):
    pack = shutil.copytree(demo.PACK, tmp_path / "pack")
    data = (pack / "model.safetensors").read_bytes()
    (pack / "model.safetensors").write_bytes(data[: len(data) // 2])  # an interrupted download
    check, loaded = check_pack(pack)
    assert not check.ok and loaded is None
    assert "model.safetensors" in check.detail and "truncated" in check.detail
    assert f"vllm-exl3 verify {pack}" in check.detail


def test_not_an_exl3_pack_fails(tmp_path):
    pack = shutil.copytree(demo.PACK, tmp_path / "pack")
    config = json.loads((pack / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (pack / "config.json").write_text(json.dumps(config))
    check, _ = check_pack(pack)
    assert not check.ok and "quant_method 'exl3'" in check.detail


def fake_sys(tmp_path, nets=(), hcas=()):
    for name in nets:
        (tmp_path / "sys/class/net" / name).mkdir(parents=True)
    for name in hcas:
        (tmp_path / "sys/class/infiniband" / name).mkdir(parents=True)
    return tmp_path


def test_spark_nics_present(tmp_path):
    root = fake_sys(tmp_path, ["lo", "enp1s0f1np1", "enP2p1s0f1np1", "wlP9s9"], ["rocep1s0f1", "roceP2p1s0f1"])
    env = {"NCCL_SOCKET_IFNAME": "enp1s0f1np1", "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
           "NCCL_IB_HCA": "rocep1s0f1,roceP2p1s0f1"}
    checks = check_network(env, root)
    assert [c.name for c in checks] == ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"]
    assert all(c.ok for c in checks), checks


def test_missing_nics_fail_and_list_what_exists(tmp_path):
    root = fake_sys(tmp_path, ["lo", "enP7s7"], ["rocep1s0f1"])
    env = {"NCCL_SOCKET_IFNAME": "enp1s0f1np1", "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
           "NCCL_IB_HCA": "=rocep1s0f1:1,roceP2p1s0f1:1"}
    nccl, gloo, ib = check_network(env, root)
    assert not nccl.ok and "no interface enp1s0f1np1 (have: enP7s7, lo)" in nccl.detail
    assert not gloo.ok and "enp1s0f1np1" in gloo.detail
    assert not ib.ok and "no RDMA device roceP2p1s0f1" in ib.detail and "rocep1s0f1" in ib.detail


def test_no_rdma_devices_in_the_container(tmp_path):
    (ib,) = check_network({"NCCL_IB_HCA": "rocep1s0f1"}, fake_sys(tmp_path, ["lo"]))
    assert not ib.ok and "/dev/infiniband" in ib.detail


def test_nccl_interface_syntax():
    have = ["eth0", "eth1", "enp1s0f1np1", "lo"]
    assert nccl_interfaces("eth", have) == (["eth0", "eth1"], [])  # a prefix, as NCCL reads it
    assert nccl_interfaces("=eth", have) == ([], ["eth"])  # exact
    assert nccl_interfaces("=eth1,enp1s0f1np1", have) == (["eth1", "enp1s0f1np1"], [])
    assert nccl_interfaces("^eth,lo", have) == (["enp1s0f1np1"], [])  # exclusion


def test_host_ip_on_the_real_loopback():
    ok = check_network({"VLLM_HOST_IP": "127.0.0.1", "NCCL_SOCKET_IFNAME": "lo"})  # this machine's own /sys
    assert [c.ok for c in ok] == [True, True] and "127.0.0.1 on lo" in ok[1].detail
    (bad,) = check_network({"VLLM_HOST_IP": NOT_OURS})
    assert not bad.ok and "not an address of this machine" in bad.detail


def test_host_ip_on_another_interface_than_nccls(tmp_path):
    root = fake_sys(tmp_path, ["enp1s0f1np1", "enP7s7"])
    addresses = {"enp1s0f1np1": {"192.168.100.10"}, "enP7s7": {"10.0.0.5"}}.copy
    nccl, host = check_network({"VLLM_HOST_IP": "10.0.0.5", "NCCL_SOCKET_IFNAME": "enp1s0f1np1"}, root, addresses)
    assert nccl.ok and not host.ok
    assert "10.0.0.5 is on enP7s7, not on the NCCL interface enp1s0f1np1" in host.detail


def test_head_address_must_be_local_on_the_head():
    assert check_head_is_local("127.0.0.1").ok
    assert not check_head_is_local(NOT_OURS).ok


def listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_head_reachable_through_the_right_source_address():
    with listener() as head:
        port = head.getsockname()[1]
        route, rendezvous = check_head_reachable("127.0.0.1", port, "127.0.0.1", wait_s=0)
        assert route.ok and "via 127.0.0.1" in route.detail
        assert rendezvous.ok


def test_head_route_from_the_wrong_address_is_refused():
    other = next((a for name, addrs in interface_addresses().items() if name != "lo" for a in addrs
                  if "." in a and not a.startswith("127.")), None)
    if other is None:
        pytest.skip("this machine has no IPv4 address besides loopback")
    (route,) = check_head_reachable("127.0.0.1", 1, other, wait_s=0)
    assert not route.ok and f"not from VLLM_HOST_IP {other}" in route.detail
    assert route_source("127.0.0.1", 1) == "127.0.0.1"


def test_head_not_answering_is_refused_after_the_wait():
    with listener() as s:
        port = s.getsockname()[1]  # a port that was just free: nothing listens once closed
    start = time.monotonic()
    route, rendezvous = check_head_reachable("127.0.0.1", port, None, wait_s=3)
    assert route.ok and not rendezvous.ok
    assert time.monotonic() - start >= 3 and "start the head first" in rendezvous.detail


def test_waits_for_a_head_that_comes_up_late():
    with listener() as s:
        port = s.getsockname()[1]
    late = socket.socket()

    def come_up():
        time.sleep(2.5)
        late.bind(("127.0.0.1", port))
        late.listen()

    t = threading.Thread(target=come_up)
    t.start()
    try:
        waited = wait_for_port("127.0.0.1", port, 30, log=lambda _: None)
    finally:
        t.join()
        late.close()
    assert waited is not None and 2 <= waited < 10


def test_gpu_detection(tmp_path):
    assert not gpu_present(tmp_path)
    (tmp_path / "proc/driver/nvidia/gpus/0000:01:00.0").mkdir(parents=True)
    assert gpu_present(tmp_path)


def test_kernel_backend_named_must_be_usable_here():
    assert check_kernel({}) is None and check_kernel({"VLLM_EXL3_KERNEL": "auto"}) is None
    assert check_kernel({"VLLM_EXL3_KERNEL": "torch"}).ok
    native = check_kernel({"VLLM_EXL3_KERNEL": "native"})  # this machine: no CUDA build, no GPU
    assert not native.ok and native.detail.startswith("native: ")
    bad = check_kernel({"VLLM_EXL3_KERNEL": "triton"})
    assert not bad.ok and "expected one of" in bad.detail

"""The NGC (Spark) image and the `single` profile for real, with testcontainers: build the image (which proves
its sm_121a cubins at build time), bring `single` up on the bundled EXL3 demo pack, wait for Docker's own health
status, then ask for a completion.

Runs on a DGX Spark only, asked for by name (VLLM_EXL3_SPARK=1): it needs nvcr.io, BuildKit and
NVIDIA's GPU runtime. CI runs the CPU image instead (test_container_*.py). Building compiles the kernels: expect
tens of minutes.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import requests

from support.appliance import ROOT, SERVED_NAME
from support.servers import free_port
from vllm_exl3 import demo

IMAGE = "vllm-exl3:test"


pytestmark = [pytest.mark.spark, pytest.mark.skipif(
    os.environ.get("VLLM_EXL3_SPARK") != "1",
    reason="the NGC image builds and runs on a DGX Spark only (nvcr.io, NVIDIA's GPU runtime): set VLLM_EXL3_SPARK=1 "
           "there; CI runs the CPU image (test_container_*.py)")]


@pytest.mark.timeout(7200)
def test_image_builds_and_single_serves_the_demo_pack(tmp_path):
    from testcontainers.compose import DockerCompose

    port = free_port()
    env_file = tmp_path / ".env"
    env_file.write_text(f"MODEL_DIR={demo.PACK}\nSERVED_MODEL_NAME={SERVED_NAME}\nAPI_PORT={port}\nIMAGE={IMAGE}\n"
                        "PRESET=low-latency\n")
    compose = DockerCompose(context=str(ROOT), compose_file_name="docker-compose.yml", profiles=["single"],
                            env_file=str(env_file), build=True, wait=True)  # --wait: until Docker says healthy
    with compose:
        reply = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                              json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 8}).json()
        assert reply["usage"]["completion_tokens"] == 8
        container = compose.get_container("single").ID
        health = subprocess.run(["docker", "inspect", "--format", "{{.State.Health.Status}}", container],
                                capture_output=True, text=True, check=True).stdout.strip()
        assert health == "healthy"
        user = subprocess.run(["docker", "exec", container, "id", "-u"], capture_output=True, text=True,
                              check=True).stdout.strip()
        assert user == "2000"
        probe = subprocess.run(["docker", "exec", container, "python3", "-c",
                                "import importlib.util as u; print(u.find_spec('exllamav3_ext').origin)"],
                               capture_output=True, text=True, check=True).stdout
        assert probe.strip().endswith(".so")  # ExLlamaV3's extension is prebuilt: no JIT at start

"""CI without a GPU: the kernels' torch-facing C++ (csrc/*.cpp that include torch) compiles against the headers of the
newest torch the supported vLLM versions pin (vLLM 0.33: torch 2.14, which refuses anything older than C++20), with
the flags setup.py builds the extension with, through tools/build-kernels --check-only.

The headers are fetched by `scripts/bootstrap --test` into <venv>/build-check (torch's, and the cuBLAS/cuSPARSE/
cuSOLVER ones torch's CUDA headers include). Skips without them or without g++, unless VLLM_EXL3_REQUIRE_TOOLS=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HEADERS = Path(sys.prefix) / "build-check"


def _headers() -> tuple[Path, Path]:
    torch_dir, cuda_dev = HEADERS / "torch", HEADERS / "nvidia" / "cu13"
    missing = [str(p) for p in (torch_dir / "include", cuda_dev / "include") if not p.is_dir()]
    if missing or not shutil.which("g++"):
        why = f"missing {', '.join(missing)} (scripts/bootstrap --test fetches them)" if missing else "no g++"
        if os.environ.get("VLLM_EXL3_REQUIRE_TOOLS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return torch_dir, cuda_dev


def test_torch_facing_sources_compile_against_the_newest_pinned_torch(tmp_path):
    torch_dir, cuda_dev = _headers()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build-kernels"), "--torch", str(torch_dir),
                        "--cuda-dev", str(cuda_dev), "--check-only", "--jobs", "2", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]
    assert "bindings.cpp" in r.stdout and "moe_bindings.cpp" in r.stdout


def test_the_check_has_teeth_cxx17_is_refused(tmp_path):
    """What the check guards against: the same file with -std=c++17 stops at torch's own #error."""
    torch_dir, cuda_dev = _headers()
    cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-I{ROOT / 'csrc'}", f"-I{torch_dir / 'include'}",
           f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{cuda_dev / 'include'}",
           "-I/usr/local/cuda/include", f"-I{__import__('sysconfig').get_paths()['include']}",
           str(ROOT / "csrc" / "moe_bindings.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "C++20" in r.stderr, r.stderr[-3000:]

"""The Python copies of the MoE op's limits agree with csrc (read from the source: no build, no GPU): the local
expert limit the native backend checks (kernels/backends/native_moe.py) and the per-step token count the memory
plan sizes the workspace with (appliance/memory_plan.py)."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_exl3.appliance.memory_plan import MOE_CHUNK_TOKENS
from vllm_exl3.kernels.backends.native_moe import MAX_LOCAL_EXPERTS

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def cpp_constant(file: str, name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", (CSRC / file).read_text())
    assert m, f"{name} not found in csrc/{file}"
    return int(m.group(1))


def test_python_limits_match_csrc():
    assert MAX_LOCAL_EXPERTS == cpp_constant("moe.h", "kMoeMaxExperts")
    assert MOE_CHUNK_TOKENS == cpp_constant("moe_bindings.cpp", "kMoeChunkTokens")

"""The C++ path enum (csrc/planner.h `enum Path`), the grouped kernel's shard limit and small_linear's row limit
agree with their Python mirrors (kernels/backends/native.py NativePath, MAX_GROUP_SHARDS, SMALL_LINEAR_MAX_ROWS)
name for name and value for value. Reads the C++ source only: no build, no GPU."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_exl3.kernels.backends.native import NativePath

PLANNER_H = Path(__file__).resolve().parents[2] / "csrc" / "planner.h"


def cpp_paths() -> dict[str, int]:
    body = re.search(r"enum Path : int64_t \{(.*?)\};", PLANNER_H.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    out = {}
    for name, value in re.findall(r"\bk(\w+)\s*=\s*(\d+)", body):
        out[re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()] = int(value)  # kSkinnySplit -> SKINNY_SPLIT
    return out


def test_python_path_enum_matches_cpp():
    cpp = cpp_paths()
    assert len(cpp) >= 8
    assert {p.name: p.value for p in NativePath} == cpp


def test_row_and_shard_limits_match_cpp():
    from vllm_exl3.kernels.backends.native import MAX_GROUP_SHARDS, SMALL_LINEAR_MAX_ROWS

    header = (PLANNER_H.parent / "exl3_kernels.h").read_text()
    assert int(re.search(r"constexpr int kMaxGroupShards = (\d+);", header).group(1)) == MAX_GROUP_SHARDS
    assert int(re.search(r"constexpr int kSmallLinearMaxRows = (\d+);", header).group(1)) == SMALL_LINEAR_MAX_ROWS

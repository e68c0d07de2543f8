"""bench/two_gpu.py's checks on the CPU: two processes (gloo) split the fixture packs' first-block layers by the
plugin's TP rule (dense columns and rows, routed experts by intermediate range, inside a 128-block too) and by
experts (expert_map with -1), run the torch backend, reduce, and match the unsplit layer. The same script runs the
native kernels on two GPUs with NCCL, CUDA graphs and all_reduce timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_match_one(tmp_path):
    out = tmp_path / "two.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "two_gpu.py"), "--device", "cpu", "--backend", "torch",
                        "--port", str(free_port()), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    splits = {c["split"] for c in result["checks"]}
    assert splits == {"columns", "rows", "tp-intermediate", "expert-parallel"}
    assert result["failed"] == 0 and len(result["checks"]) >= 40
    assert all(c["rel_err"] <= result["bound"] for c in result["checks"])
    inside = {c["split"] for c in result["checks"] if c["split"] != "expert-parallel" and c["ranges"][0][1] % 128}
    assert inside == {"columns", "rows", "tp-intermediate"}, "a kind of split inside a 128-block went unchecked"

"""bench/op_boundary.py runs against this tree (the bound API) and appends its row to the result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_measures_this_tree_and_appends_a_row(tmp_path):
    out = tmp_path / "boundary.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugin")}
    for label in ("a", "b"):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "op_boundary.py"), label, "--out", str(out)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["tree"] for r in rows] == ["a", "b"] and all(r["api"] == "bound" for r in rows)
    assert all(0 < r["moe_us"] < 10_000 and 0 < r["linear_us"] < 10_000 for r in rows)

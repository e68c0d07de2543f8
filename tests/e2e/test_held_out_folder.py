"""VLLM_EXL3_HELD_OUT_PACKS (tests/e2e/test_families_e2e.py): a folder named by mistake — missing, or holding no
pack with goldens — stops the run with that folder named, instead of checking nothing and passing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parent / "test_families_e2e.py"


@pytest.mark.parametrize("make", ["missing", "empty", "no goldens"])
def test_a_held_out_folder_without_packs_fails_the_run(tmp_path, make):
    folder = tmp_path / "packs"
    if make != "missing":
        folder.mkdir()
    if make == "no goldens":
        (folder / "some-pack").mkdir()
        (folder / "some-pack" / "config.json").write_text("{}")
    env = {**os.environ, "VLLM_EXL3_HELD_OUT_PACKS": str(folder)}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(MODULE)],
                       capture_output=True, text=True, env=env, cwd=MODULE.parents[2], timeout=120)
    assert r.returncode != 0, r.stdout[-2000:]
    assert f"VLLM_EXL3_HELD_OUT_PACKS={folder}: no pack folder with golden/logits.safetensors" in r.stdout, \
        r.stdout[-2000:]

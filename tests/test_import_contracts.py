"""The package's layering holds: import-linter's contracts in pyproject.toml (layers with `base` at the bottom, the
layers inside kernels/ (no import cycle between the backend table and the backend modules), only
`integration` imports vLLM, `base` is standard library only, `appliance` and the header-only `format` modules stay
free of torch), and at run time base, the appliance, the header-only format modules and the CLI's entry import
without loading torch or vLLM (Docker's HEALTHCHECK must work when they cannot; `vllm-exl3 --help` stays fast)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE = ["vllm_exl3.base." + m for m in ("settings", "state", "http", "version")] + \
    ["vllm_exl3.appliance." + m for m in ("health", "launch", "memory_plan", "preflight", "supervisor_listener",
                                          "watchdog", "peer")] + \
    ["vllm_exl3.format." + m for m in ("constants", "errors", "headers", "records", "pack", "index", "contract",
                                        "geometry", "units", "summary")] + \
    ["vllm_exl3.kernels." + m for m in ("requested", "errors", "backends.native_moe_limits")] + \
    ["vllm_exl3.servebench." + m for m in ("workload", "client", "server_metrics", "stats", "runner", "report",
                                           "plots")] + ["vllm_exl3.cli.bench", "vllm_exl3.cli.main"]


def test_import_linter_contracts_hold():
    pytest.importorskip("importlinter")
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                        "sys.exit(lint_imports(config_filename='pyproject.toml'))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch_or_vllm(module):
    code = (f"import sys, {module}\n"
            "loaded = sorted(m for m in ('torch', 'vllm') if m in sys.modules)\n"
            "assert not loaded, loaded")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugin"), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-2000:]

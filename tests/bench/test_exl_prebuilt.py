"""bench/gpu/exl_prebuilt.py: ExLlamaV3's extension exported by one GPU run, staged, and installed on the next
machine only when it was built for the same torch and ExLlamaV3 (else the run builds it again)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("exl_prebuilt", ROOT / "bench" / "gpu" / "exl_prebuilt.py")
exl_prebuilt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(exl_prebuilt)

VERSIONS = {"torch": "2.14.0", "exllamav3": "1.6.5", "archs": "9.0"}


@pytest.fixture
def library(tmp_path):
    """A real ELF extension module of this Python (the stand-in for the JIT-built one), several parts long."""
    src = Path(sysconfig.get_paths()["platstdlib"]) / "lib-dynload"
    candidates = sorted(src.glob("_*.so"), key=lambda p: -p.stat().st_size) if src.is_dir() else []
    if not candidates:
        candidates = [Path(sys.executable).resolve()]
    lib = tmp_path / "build" / "exllamav3_ext.so"
    lib.parent.mkdir()
    shutil.copyfile(candidates[0], lib)
    return lib


def test_an_exported_build_installs_byte_for_byte_on_the_next_machine(tmp_path, library, monkeypatch):
    monkeypatch.setattr(exl_prebuilt, "PART_BYTES", 512)  # several parts, as a large build makes
    out = tmp_path / "out"
    files = exl_prebuilt.export(library, out, VERSIONS)
    manifest = json.loads((out / exl_prebuilt.MANIFEST).read_text())
    parts = sorted(out.glob("exllamav3_ext.so.xz.part*"))
    assert manifest["parts"] == len(parts) >= 2 and set(files) == {*parts, out / exl_prebuilt.MANIFEST}
    assert all(p.stat().st_size <= 512 for p in parts)
    assert {k: manifest[k] for k in VERSIONS} == VERSIONS
    dest = tmp_path / "prebuilt"
    assert exl_prebuilt.install(out, dest, VERSIONS) == "installed"
    installed = (dest / "exllamav3_ext.so").read_bytes()
    assert installed[:4] == b"\x7fELF" and len(installed) == manifest["so_bytes"]
    assert installed == exl_prebuilt._stripped(library)
    assert exl_prebuilt.install(out, dest, VERSIONS) == "already installed"


def test_a_build_for_another_torch_or_a_missing_part_is_refused_and_nothing_is_installed(tmp_path, library,
                                                                                        monkeypatch):
    monkeypatch.setattr(exl_prebuilt, "PART_BYTES", 512)
    out = tmp_path / "out"
    exl_prebuilt.export(library, out, VERSIONS)
    dest = tmp_path / "prebuilt"
    why = exl_prebuilt.install(out, dest, {**VERSIONS, "torch": "2.15.0"})
    assert why.startswith("refused") and "torch 2.14.0 (here 2.15.0)" in why
    sorted(out.glob("exllamav3_ext.so.xz.part*"))[-1].unlink()
    assert "parts staged" in exl_prebuilt.install(out, dest, VERSIONS)
    assert not (dest / "exllamav3_ext.so").exists()
    assert exl_prebuilt.install(tmp_path / "nothing", dest, VERSIONS) == "none staged"


def test_a_build_too_large_to_return_is_not_exported(tmp_path, library, monkeypatch):
    monkeypatch.setattr(exl_prebuilt, "MAX_XZ_BYTES", 100)
    with pytest.raises(ValueError, match="over the .* a call can return"):
        exl_prebuilt.export(library, tmp_path / "out", VERSIONS)
    assert not (tmp_path / "out").exists()

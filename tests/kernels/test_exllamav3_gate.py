"""The exllamav3 backend's version gate and layer checks, on the CPU: an installed exllamav3 of another version, or
one without the routed-expert entry points this backend calls, is refused with the version and what was expected;
layers its expert kernels cannot serve are declined with the reason (no ExLlamaV3 needed for any of this)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from vllm_exl3.kernels.backends import exllamav3 as exl_backend
from vllm_exl3.kernels.backends import exllamav3_moe
from vllm_exl3.kernels.interface import MoECall
from vllm_exl3.kernels.specs import MoESpec


def fake_exllamav3(root, version: str, entry_points=(), kwargs=("config", "key"), init: str = "") -> None:
    """A stand-in `exllamav3` package on sys.path: its version, some extension entry points, a BlockSparseMLP with
    the given constructor parameters."""
    pkg = root / "exllamav3"
    (pkg / "modules").mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "version.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "ext.py").write_text("import types\nexllamav3_ext = types.SimpleNamespace(**{n: object() for n in "
                                f"{list(entry_points)!r}}})\n")
    (pkg / "modules" / "__init__.py").write_text("")
    params = ", ".join(f"{k}=None" for k in kwargs)
    (pkg / "modules" / "block_sparse_mlp.py").write_text(textwrap.dedent(f"""\
        MAX_BSZN = 8
        class BlockSparseMLP:
            def __init__(self, {params}):
                pass
            def load_local(self):
                pass
            def forward(self, x, params):
                pass
        """))


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Install a fake exllamav3 for one test; the backend's cached answers are cleared before and after."""
    def install(*args, **kw):
        fake_exllamav3(tmp_path, *args, **kw)
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [m for m in sys.modules if m == "exllamav3" or m.startswith("exllamav3.")]:
            monkeypatch.delitem(sys.modules, name)
        clear()

    def clear():
        for cached in (exl_backend._import_error, exl_backend.installed_version, exl_backend.load_package,
                       exllamav3_moe.api_reason):
            cached.cache_clear()

    yield install
    for name in [m for m in sys.modules if m == "exllamav3" or m.startswith("exllamav3.")]:
        del sys.modules[name]
    clear()


def test_another_minor_version_is_refused_by_name(installed):
    installed("1.4.2")
    assert exl_backend._import_error() == "exllamav3 1.4.2 not supported (need 1.6.x)"


def test_missing_moe_entry_points_are_named(installed):
    installed("1.6.9", entry_points=("BC_LinearEXL3", "exl3_moe"))
    reason = exllamav3_moe.api_reason()
    assert reason.startswith("exllamav3 1.6.9 does not provide what its routed-expert path needs here")
    for name in ("exllamav3_ext.BC_BlockSparseMLP", "exllamav3_ext.exl3_moe_gather", "BlockSparseMLP(gates=...)",
                 "BlockSparseMLP(routing_first=...)"):
        assert name in reason
    assert "exllamav3_ext.exl3_moe," not in reason + ","
    assert "1.6.x's BlockSparseMLP" in reason


def test_complete_api_is_accepted(installed):
    installed("1.6.5", entry_points=exllamav3_moe.EXT_ENTRY_POINTS,
              kwargs=("config", "key") + exllamav3_moe.MODULE_KWARGS)
    assert exllamav3_moe.api_reason() is None


def spec(codebooks=("mcg",) * 6, bits=(4.0,) * 6, activation="silu", device="cuda", dtype=torch.float16):
    return MoESpec(codebooks, bits, 256, 384, 2, activation, dtype, device)


@pytest.mark.parametrize("kw,expected", [
    ({"activation": "gelu"}, "its gelu is the tanh form"),
    ({"codebooks": ("mcg",) * 3 + ("mul1",) * 3}, "codebooks ['mcg', 'mul1'] in one layer"),
    ({"bits": (4.0, 4.0, 3.0, 4.0, 2.0, 3.0)}, "up projections of 2 bit widths [2.0, 4.0]"),
    ({"device": "cpu"}, "needs a CUDA device"),
    ({"dtype": torch.float32}, "activations must be fp16 or bf16"),
])
def test_layers_its_kernels_cannot_serve_are_declined(kw, expected):
    assert expected in exl_backend.ExLlamaV3Backend().moe_unsupported_reason(spec(**kw))


def test_servable_layers_pass_the_layer_checks():
    assert exllamav3_moe.unsupported_reason(spec(bits=(4.0, 4.0, 3.0) * 2, activation="gelu_tanh")) is None


def test_binding_needs_top_k():
    with pytest.raises(ValueError, match="needs the layer's top-k"):
        exl_backend.ExLlamaV3Backend().bind_moe(object(), MoECall("silu"))


def test_the_image_checks_the_prebuilt_extension_for_these_entry_points(tmp_path):
    """tools/check-exllamav3-ext (run by the Dockerfile's builder on the prebuilt exllamav3_ext) reads the names from
    exllamav3_moe.EXT_ENTRY_POINTS and finds them as pybind11 keeps them: NUL-terminated strings in the library."""
    import subprocess
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "check-exllamav3-ext"
    whole = tmp_path / "whole.so"
    whole.write_bytes(b"\x7fELF..." + b"".join(n.encode() + b"\0" for n in exllamav3_moe.EXT_ENTRY_POINTS))
    r = subprocess.run([sys.executable, str(tool), str(whole)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lacking = tmp_path / "lacking.so"
    lacking.write_bytes(b"\x7fELF...exl3_moe_gather\0BC_LinearEXL3\0")
    r = subprocess.run([sys.executable, str(tool), str(lacking)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "lacks BC_BlockSparseMLP, exl3_moe, exl3_moe_max_concurrency" in r.stderr


def test_asking_whether_it_is_there_does_not_import_it(installed, tmp_path, caplog):
    """`import exllamav3` compiles ExLlamaV3's extension unless a prebuilt one is importable (minutes: every boot of
    the native profile stalled in it on a machine with ExLlamaV3 installed from PyPI). Availability, the build id
    in the compile-cache key and the metrics read its files instead; only binding a layer imports it, saying so."""
    marker = tmp_path / "imported"
    installed("1.6.5", init=f"open({str(marker)!r}, 'w').close()\n")
    backend = exl_backend.ExLlamaV3Backend()
    assert exl_backend._import_error() is None
    assert backend.build_id() == "exllamav3 1.6.5 (JIT extension)"
    backend.unavailable_reason()
    assert not marker.exists() and "exllamav3" not in sys.modules
    with caplog.at_level("WARNING"):
        exl_backend.load_package()
    assert marker.exists() and "not prebuilt" in caplog.text

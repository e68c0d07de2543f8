"""The settings table (base/settings.py) lists every VLLM_EXL3_* variable the repository uses, docs/settings.md
is generated from it, and the defaults written elsewhere (README's loader table, ReaderOptions) agree with it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_exl3.base import settings

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bVLLM_EXL3_[A-Z0-9_]*[A-Z0-9]\b")
SOURCES = ["plugin/**/*.py", "csrc/*", "deploy/**/*", "healthchecks/*", "docker-compose.yml", "Dockerfile", "setup.py",
           "README.md", "docs/*.md", "bench/*.py", "bench/*.sh"]


def test_settings_md_is_generated_from_the_table():
    assert (ROOT / "docs" / "settings.md").read_text() == settings.document(), \
        "run: python -m vllm_exl3.base.settings > docs/settings.md"


def test_every_variable_in_the_repository_is_in_the_table():
    known = set(settings.BY_NAME) | set(settings.NOT_VARIABLES)
    missing = {}
    for pattern in SOURCES:
        for path in ROOT.glob(pattern):
            if path.is_file():
                for name in set(NAME.findall(path.read_text(errors="replace"))) - known:
                    missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"add these to base/settings.py: {missing}"


def test_loader_table_and_reader_defaults_agree():
    """docs/performance.md's loader table (the `--model-loader-extra-config` keys) against the settings table."""
    rows = re.findall(r"^\| `(\w+)` \| `(VLLM_EXL3_\w+)` \| ([^|]+) \|", (ROOT / "docs" / "performance.md").read_text(), re.M)
    assert rows
    for _key, name, value in rows:
        assert value.strip() == settings.default(name), name
    from vllm_exl3.format.units import MIB
    from vllm_exl3.loader.options import ReaderOptions

    o = ReaderOptions()
    assert (o.workers, o.chunk_bytes // MIB, o.ring_bytes // MIB) == tuple(
        int(settings.default(f"VLLM_EXL3_LOAD_{k}")) for k in ("WORKERS", "CHUNK_MIB", "RING_MIB"))
    assert (str(o.direct_io).lower(), str(o.drop_page_cache).lower()) == (
        settings.default("VLLM_EXL3_LOAD_DIRECT_IO"), settings.default("VLLM_EXL3_LOAD_DROP_PAGE_CACHE"))


def test_readers_name_the_variable_whose_value_does_not_parse():
    env = {"VLLM_EXL3_PORT": "80a", "VLLM_EXL3_LOAD_DIRECT_IO": "maybe", "VLLM_EXL3_HEAD_WAIT": "soon"}
    for read, name, expected in ((settings.get_int, "VLLM_EXL3_PORT", "an integer"),
                                 (settings.get_bool, "VLLM_EXL3_LOAD_DIRECT_IO", "a boolean"),
                                 (settings.get_float, "VLLM_EXL3_HEAD_WAIT", "a number")):
        with pytest.raises(settings.SettingError, match=rf"^{name}='{env[name]}': expected {expected}"):
            read(name, env)
    assert settings.get_int("VLLM_EXL3_PORT", {"VLLM_EXL3_PORT": ""}) == 8000  # empty = unset: the default
    assert settings.get("VLLM_EXL3_OPEN_PATHS", {"VLLM_EXL3_OPEN_PATHS": ""}, keep_empty=True) == ""
    assert settings.lookup("VLLM_EXL3_RUN_DIR", {}) is None and settings.get("VLLM_EXL3_RUN_DIR", {}) == "/run/vllm-exl3"
    with pytest.raises(KeyError):
        settings.get("VLLM_EXL3_NOT_A_SETTING", {})


def _program(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("args,variable,value,code", [
    (["healthchecks/healthcheck.py", "liveness"], "VLLM_EXL3_PORT", "80a", 1),
    (["-m", "vllm_exl3.appliance.watchdog"], "VLLM_EXL3_WATCHDOG_INTERVAL", "1s", 2),
    (["-m", "vllm_exl3.appliance.peer"], "VLLM_EXL3_HEARTBEAT_PORT", "udp", 2),
    (["-m", "vllm_exl3.cli", "launch", "--role", "single", "--dry-run", "--no-preflight"], "VLLM_EXL3_HEAD_WAIT",
     "15m", 2),
])
def test_a_bad_value_is_one_line_naming_the_variable(tmp_path, args, variable, value, code):
    """The appliance's programs read their variables through base/settings.py: a value that does not parse stops
    them with one line that names it (before: a ValueError traceback, or for VLLM_EXL3_HEAD_WAIT every
    `vllm-exl3` command crashing while building its parser)."""
    (tmp_path / "vllm.pid").write_text(f"{os.getpid()}\n")  # a running "vLLM", so the health check reads on
    env = {"VLLM_EXL3_RUN_DIR": str(tmp_path), "VLLM_EXL3_STATE_DIR": str(tmp_path / "state"),
           "VLLM_EXL3_ROLE": "head", "VLLM_EXL3_PEER_SECRET": "s" * 32, "VLLM_EXL3_HEAD_ADDR": "127.0.0.1",
           variable: value}
    if "launch" in args:
        env["VLLM_EXL3_ROLE"] = "single"
    r = _program(args, env)
    out = r.stdout + r.stderr
    assert r.returncode == code and "Traceback" not in out, out
    assert f"{variable}='{value}'" in out, out
    assert _program(["-m", "vllm_exl3.cli", "--version"], {variable: value}).returncode == 0

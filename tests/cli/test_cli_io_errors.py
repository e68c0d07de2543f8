"""Fail closed, round 2: the CLI's own writes where the system refuses them, for real (tests/support/fs_faults.py):
a folder the user may not write (EACCES), a read-only filesystem (EROFS), a disk that fills up at a seeded random
point of the write (ENOSPC), a file-size limit hit at a seeded random size (EFBIG), and a standard output that
cannot be written.

Every write a subcommand makes to a path the user gave (dequant -o, pack index, pack config --write, pack
overlay -o) must end in ONE paragraph that names that path, the system's reason and what to do, exit 1, never
"internal error" or a traceback, and lose nothing: every file that was there is unchanged (a file already at
dequant's -o included) and nothing half-written is left behind.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.fixtures import pack_dir
from support import fs_faults

SEED = 23
VARIANTS = 2  # seeded failure points per (command, seeded fault)
SOURCE = pack_dir("qwen3moe-a-exl3-mcg-b3")
PACK_FILES = ("config.json", "quantization_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "generation_config.json")
CONSOLE = str(Path(sys.executable).parent / "vllm-exl3")
PRECIOUS = b"a file the user already had at the output path\n"


def copy_pack(dst: Path) -> Path:
    """The fixture pack without its golden data; its config without `bits`, so `pack config` has a change to
    write; no index, so `pack index` has one to write."""
    dst.mkdir(parents=True)
    for name in PACK_FILES:
        shutil.copy(SOURCE / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]["bits"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@dataclass(frozen=True)
class Write:
    """A subcommand's write into `folder` ("out": a new folder beside the pack; "pack": the pack itself)."""
    name: str
    folder: str

    def argv(self, root: Path) -> tuple[list[str], str]:
        """The command line, and the path the error must name, for a layout `root`/{pack, out}."""
        pack, out = root / "pack", root / "out"
        if self.name == "dequant":
            return ["dequant", str(pack), "-o", str(out / "w.safetensors")], str(out / "w.safetensors")
        if self.name == "overlay":
            return ["pack", "overlay", str(pack), str(pack), "-o", str(out / "new")], str(out / "new")
        if self.name == "index":
            return ["pack", "index", str(pack)], str(pack)
        return ["pack", "config", str(pack), "--write"], str(pack)


WRITES = [Write("dequant", "out"), Write("overlay", "out"), Write("index", "pack"), Write("config", "pack")]


def layout(root: Path) -> Path:
    copy_pack(root / "pack")
    (root / "out").mkdir()
    (root / "out" / "w.safetensors").write_bytes(PRECIOUS)  # dequant must not lose it
    return root


@dataclass
class Written:
    pages: int  # bytes of the files it wrote, in whole tmpfs pages (hard links take none)
    smallest: int  # the smallest file it wrote, the largest
    largest: int

    def bound(self, write: Write, total: bool) -> int:
        """Below this, a seeded failure point is sure to be hit. `pack config --write` replaces config.json,
        then the sidecar quantization_config.json, each atomically: it must fail before the first is replaced,
        or the pack is left with the two disagreeing (format/packtools.py write_config)."""
        return self.smallest if write.name == "config" else self.pages if total else self.largest


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Written]:
    """Per write, measured by running it where nothing refuses it."""
    sizes = {}
    for w in WRITES:
        root = layout(tmp_path_factory.mktemp(w.name))
        before = fs_faults.snapshot(root)
        argv, _ = w.argv(root)
        r = subprocess.run([CONSOLE, *argv], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        changed = [root / p for p, h in fs_faults.snapshot(root).items() if before.get(p) != h and h != "dir"]
        files = [p.stat().st_size for p in changed if p.stat().st_nlink == 1]
        assert files, w
        sizes[w.name] = Written(sum(-(-n // fs_faults.PAGE) * fs_faults.PAGE for n in files), min(files), max(files))
    return sizes


def assert_refused(rc: int, err: str, path: str, reason: str, what: str) -> None:
    assert rc == 1, f"{what}: exit {rc}: {err}"
    assert "Traceback" not in err and "internal error" not in err, f"{what}: {err}"
    assert "\n\n" not in err.strip() and err.startswith("error: cannot write"), f"{what}: not one paragraph: {err}"
    assert path in err and reason in err, f"{what}: the message does not name {path} and {reason!r}: {err}"


# -- a folder the user may not write ----------------------------------------------------------------------------
@pytest.mark.parametrize("write", WRITES, ids=[w.name for w in WRITES])
def test_a_folder_without_write_permission(tmp_path, write):
    if fs_faults.unprivileged_problem():
        pytest.skip(fs_faults.unprivileged_problem())
    root = layout(tmp_path)
    folder = root / write.folder
    before = fs_faults.snapshot(root)
    folder.chmod(0o555)
    try:
        argv, path = write.argv(root)
        r = subprocess.run(fs_faults.unprivileged([CONSOLE, *argv]), capture_output=True, text=True, timeout=300)
    finally:
        folder.chmod(0o755)
    assert_refused(r.returncode, r.stderr, path, "Permission denied", write.name)
    assert "check the permissions" in r.stderr
    assert fs_faults.snapshot(root) == before


# -- a read-only filesystem, a disk that fills up ---------------------------------------------------------------
def tmpfs_run(tmp_path: Path, write: Write, size: int, free: int | None, readonly: bool) -> tuple[fs_faults.Run, str]:
    problem = fs_faults.namespaces_problem()
    if problem:
        pytest.skip(problem)
    disk = tmp_path / "disk"
    argv, path = write.argv(disk)
    staging = layout(tmp_path / "staging")
    return fs_faults.on_tmpfs([CONSOLE, *argv], disk, {"pack": staging / "pack", "out": staging / "out"},
                              size=size, free=free, readonly=readonly), path


@pytest.mark.parametrize("write", WRITES, ids=[w.name for w in WRITES])
def test_a_read_only_filesystem(tmp_path, write):
    run, path = tmpfs_run(tmp_path, write, 16 << 20, None, readonly=True)
    assert_refused(run.returncode, run.stderr, path, "Read-only file system", write.name)
    assert "read-only filesystem" in run.stderr
    assert run.after == run.before


CASES = [(w, v) for w in WRITES for v in range(VARIANTS)]


@pytest.mark.parametrize("write,variant", CASES, ids=[f"{w.name}-{v}" for w, v in CASES])
def test_a_disk_that_fills_up_during_the_write(tmp_path, written, write, variant):
    bound = written[write.name].bound(write, total=True)
    free = random.Random(f"{SEED}-enospc-{write.name}-{variant}").randrange(0, max(1, bound - 2 * fs_faults.PAGE))
    run, path = tmpfs_run(tmp_path, write, 32 << 20, free, readonly=False)
    assert_refused(run.returncode, run.stderr, path, "No space left on device", f"{write.name} free={free}")
    assert "the disk is full" in run.stderr
    assert run.after == run.before, f"free={free}: {set(run.after.items()) ^ set(run.before.items())}"


@pytest.mark.parametrize("write,variant", CASES, ids=[f"{w.name}-{v}" for w, v in CASES])
def test_a_file_size_limit_hit_during_the_write(tmp_path, written, write, variant):
    limit = random.Random(f"{SEED}-efbig-{write.name}-{variant}").randrange(1, written[write.name].bound(write, False))
    root = layout(tmp_path)
    before = fs_faults.snapshot(root)
    argv, path = write.argv(root)
    r = subprocess.run([CONSOLE, *argv], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert_refused(r.returncode, r.stderr, path, "File too large", f"{write.name} limit={limit}")
    assert "ulimit -f" in r.stderr
    assert fs_faults.snapshot(root) == before


# -- the standard output ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["inspect", "--json"], ["inspect"], ["verify"], ["pack", "index", "--check"]],
                         ids=["inspect-json", "inspect", "verify", "index-check"])
def test_a_standard_output_that_cannot_be_written(argv):
    with open("/dev/full", "w") as full:
        r = subprocess.run([CONSOLE, *argv, str(SOURCE)], stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=300)
    assert_refused(r.returncode, r.stderr, "the standard output", "No space left on device", " ".join(argv))


# -- main()'s rule, wherever else such an error surfaces --------------------------------------------------------
def test_an_unwrapped_write_is_reported_by_the_same_rule(tmp_path):
    """`launch` writes its pid file into VLLM_EXL3_RUN_DIR before it starts vLLM; the system names the file, and
    main() reports it as the user's environment, not as a bug."""
    if fs_faults.unprivileged_problem():
        pytest.skip(fs_faults.unprivileged_problem())
    from vllm_exl3 import demo

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o555)
    r = subprocess.run(fs_faults.unprivileged([CONSOLE, "launch", str(demo.PACK), "--role", "single"]),
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_EXL3_RUN_DIR": str(run_dir)})
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"error: {run_dir / 'vllm.pid'}: Permission denied; check the permissions of the file and its " \
                   "folder, or choose another path", r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr

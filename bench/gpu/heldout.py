"""Held-out packs made on the GPU machine by ExLlamaV3's own converter (tools/exl3-packs), for run.py's `heldout` and
`families` steps and for the CPU check here (docs/packs.md "Checking a pack against ExLlamaV3").

The tool was written for a machine's own torch with its own ExLlamaV3 install (tools/exl3-packs/run.sh, a 6-9 min JIT
build first). Here it runs on the staged torch and ExLlamaV3 with the extension run.py installs from the carried
build, so it must not start before that extension is in place: an import of ExLlamaV3 without it begins the JIT
build and waits on it (bench/notes/serving-run-18.md "What did not run").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugin"))

from vllm_exl3.format.families.glm4_moe_lite import mla_kernels_take  # noqa: E402

TOOL = ROOT / "tools" / "exl3-packs"
PART_BYTES = 15 * 1024 * 1024  # under the device tool's 16 MiB per returned file
MAX_PARTS = 3                  # beside results.tgz, within its 8 files and 64 MiB a call


def staged_site() -> Path:
    """The folder holding the staged ExLlamaV3 package, found without importing it (its import loads the
    extension); the tool reads ExLlamaV3's calibration texts from EXL/site."""
    spec = importlib.util.find_spec("exllamav3")
    if spec is None or spec.origin is None:
        raise RuntimeError("exllamav3 is not importable here (the staged environment: bench/gpu/device.sh env)")
    return Path(spec.origin).parent.parent


def make(entries: list[dict], root: Path, env: dict, seconds: float, log) -> dict:
    """families.py make for each [[heldout.make]] entry ({variants, families}) under root (the tool's EXL folder),
    within `seconds` in all: the tool's status per pack ("ok", "done", "FAIL ..."), or the entry's timeout."""
    root.mkdir(parents=True, exist_ok=True)
    site = root / "site"
    if not site.exists():
        site.symlink_to(staged_site())
    deadline = time.monotonic() + seconds
    status: dict = {}
    for entry in entries:
        fams = ",".join(entry["families"])
        left = deadline - time.monotonic()
        if left < 30:
            status[fams] = "not started: no time left"
            continue
        run_env = {**env, "EXL": str(root), "OUT": str(root / "out"), "VARIANTS": entry["variants"]}
        t = time.monotonic()
        try:
            with open(root / "make.log", "a") as out:
                subprocess.run([sys.executable, str(TOOL / "families.py"), "make", fams], env=run_env, cwd=ROOT,
                               stdout=out, stderr=subprocess.STDOUT, timeout=left)
        except subprocess.TimeoutExpired:
            status[fams] = f"timed out after {left:.0f} s"
        log(f"heldout: {fams} ({entry['variants']}) in {time.monotonic() - t:.0f} s")
        for f in (root / "out").glob("status-*.json"):
            status.update(json.loads(f.read_text()))
    return status


def packs(root: Path) -> list[Path]:
    """Every pack the tool finished under root (its goldens written), geometry a before b."""
    return sorted(p for p in (root / "work" / "arch").glob("*/*") if (p / "golden" / "logits.safetensors").is_file())


def export(made: list[Path], out: Path, first: tuple[str, ...] = ()) -> tuple[list[Path], list[str]]:
    """The packs as gzip archives of at most PART_BYTES in out (their reconstructed-weight goldens left out: only
    the logits and linears are compared), MAX_PARTS at most; packs whose name starts with one of `first` go first.
    Returns the archives and the names of the packs that did not fit."""
    out.mkdir(parents=True, exist_ok=True)
    order = sorted(made, key=lambda p: (not p.name.startswith(first) if first else False, p.name))
    parts: list[Path] = []
    left_out: list[str] = []
    current: tarfile.TarFile | None = None
    for pack in order:
        size = sum(f.stat().st_size for f in pack.rglob("*") if f.is_file() and not f.name.startswith("recon_"))
        if size > PART_BYTES:
            left_out.append(pack.name)
            continue
        if current is None or parts[-1].stat().st_size + size > PART_BYTES:
            if current is not None:
                current.close()
            if len(parts) == MAX_PARTS:
                left_out.append(pack.name)
                current = None
                continue
            parts.append(out / f"heldout-{len(parts)}.tar.gz")
            current = tarfile.open(parts[-1], "w:gz")
        current.add(pack, arcname=pack.name, filter=lambda ti: None if Path(ti.name).name.startswith("recon_") else ti)
        current.fileobj.flush()
    if current is not None:
        current.close()
    return parts, left_out


def setting(per_pack: dict, pack: Path) -> dict:
    """A held-out pack's server settings: [families.per-pack] under its own name, else under its architecture (the
    oracle packs' entries: the delta net's prefill backend, gpt-oss's bf16); vLLM's per-head attention for an MLA
    latent vLLM's MLA kernels do not take."""
    config = json.loads((pack / "config.json").read_text())
    chosen = dict(per_pack.get(pack.name) or per_pack.get(config["architectures"][0]) or {})
    if not mla_kernels_take(config):
        chosen["env"] = {**chosen.get("env", {}), "VLLM_MLA_DISABLE": "1"}
    return chosen


if __name__ == "__main__":  # the archives back into a folder here: python3 bench/gpu/heldout.py FILES... DEST
    *archives, dest = sys.argv[1:]
    os.makedirs(dest, exist_ok=True)
    for a in archives:
        with tarfile.open(a) as t:
            t.extractall(dest, filter="data")
    print("\n".join(sorted(os.listdir(dest))))

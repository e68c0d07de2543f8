"""ExLlamaV3's extension, built once on a GPU machine, carried to later machines from the same working tree.

ExLlamaV3 compiles its extension when it is first imported (529-679 s on the H200 machine's 16 cores beside the
harness's other work, bench/notes/serving-run-05.md "Fifth run"), and every lent machine starts bare, so each session
paid that again before any row that needs ExLlamaV3 could run. Now:

1. the run that built it exports the library, xz-compressed, in parts the device tool returns (at most 16 MiB a
   file), with a manifest naming the torch and ExLlamaV3 it was built against and the archive's SHA-256;
2. `bench/gpu/vgpu exl DIR` turns those files into a folder that one staging call carries (`device.sh stage`
   keeps them in /tmp/vgpu/exl);
3. on that machine run.py installs the library where ExLlamaV3's own import looks first (a precompiled
   `exllamav3_ext` on the Python path), only if the staged torch and ExLlamaV3 are the versions it was built for.

The parts live in `.vgpu/exl`, which git ignores (they are tens of MB, and every device call carries the tree): a
fresh clone has none and pays the build once.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import subprocess
import tempfile
from pathlib import Path

NAME = "exllamav3_ext"
PART_BYTES = 15 * 1024 * 1024  # under the device tool's 16 MiB per returned file
# What one call can return beside results.tgz (64 MiB in all) and one staging call carry beside the light tree.
MAX_XZ_BYTES = 48 * 1024 * 1024
MANIFEST = f"{NAME}.json"


def _parts(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{NAME}.so.xz.part*"))


def _compress(data: bytes) -> bytes:
    # xz on every core when the machine has it (seconds for ~100 MB); Python's lzma (one core) otherwise.
    if shutil.which("xz"):
        r = subprocess.run(["xz", "-T0", "-6", "-c"], input=data, capture_output=True, check=True)
        return r.stdout
    return lzma.compress(data, preset=6)


def _stripped(library: Path) -> bytes:
    # Its symbol tables and line info are a large part of the file, and nothing loads them: they need not travel.
    if not shutil.which("strip"):
        return library.read_bytes()
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / library.name
        shutil.copyfile(library, copy)
        r = subprocess.run(["strip", "--strip-unneeded", str(copy)], capture_output=True)
        return copy.read_bytes() if r.returncode == 0 else library.read_bytes()


def export(library: Path, out: Path, versions: dict[str, str]) -> list[Path]:
    """The JIT-built `library`, compressed into out/exllamav3_ext.so.xz.partNN and its manifest; the files written
    (none when the archive would be too large to return and carry: ValueError says so)."""
    data = _stripped(library)
    packed = _compress(data)
    if len(packed) > MAX_XZ_BYTES:
        raise ValueError(f"{library.name} is {len(packed) / 2**20:.1f} MiB compressed, over the "
                         f"{MAX_XZ_BYTES / 2**20:.0f} MiB a call can return and a staging call carry")
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(0, len(packed), PART_BYTES):
        part = out / f"{NAME}.so.xz.part{i // PART_BYTES:02d}"
        part.write_bytes(packed[i:i + PART_BYTES])
        files.append(part)
    manifest = {**versions, "parts": len(files), "xz_bytes": len(packed), "so_bytes": len(data),
                "sha256": hashlib.sha256(packed).hexdigest()}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return files + [out / MANIFEST]


def install(staged: Path, dest: Path, versions: dict[str, str]) -> str:
    """Unpack the staged parts into dest/exllamav3_ext.so when they were built for `versions`. Returns what
    happened: 'installed', 'already installed', 'none staged', or why it was refused (the build then runs)."""
    library = dest / f"{NAME}.so"
    if library.exists():
        return "already installed"
    if not (staged / MANIFEST).exists():
        return "none staged"
    manifest = json.loads((staged / MANIFEST).read_text())
    differ = {k: (manifest.get(k), v) for k, v in versions.items() if manifest.get(k) != v}
    if differ:
        return "refused: built for other versions " + ", ".join(f"{k} {a} (here {b})" for k, (a, b) in differ.items())
    parts = _parts(staged)
    packed = b"".join(p.read_bytes() for p in parts)
    if len(parts) != manifest["parts"] or hashlib.sha256(packed).hexdigest() != manifest["sha256"]:
        return f"refused: {len(parts)} of {manifest['parts']} parts staged, or their bytes differ from the manifest"
    dest.mkdir(parents=True, exist_ok=True)
    tmp = library.with_suffix(".tmp")
    tmp.write_bytes(lzma.decompress(packed))
    tmp.replace(library)
    return "installed"

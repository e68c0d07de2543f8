"""Run a command where the filesystem refuses it for real, not through a mock:

- `on_tmpfs`: a tmpfs mounted in a private user and mount namespace (`unshare -rm`: no root needed where the
  kernel allows unprivileged user namespaces), seeded with copies of some files, then left with exactly `free`
  bytes (ENOSPC once a write needs more) or remounted read-only (EROFS). The tmpfs vanishes with the namespace,
  so this module runs inside it too (`python fs_faults.py SPEC`): it mounts, copies, fills, takes a snapshot,
  runs the command, takes another and prints the result as JSON.
- `unprivileged`: the command without the capability to write where the permissions say no (EACCES): as is for
  an ordinary user; as root, in a user namespace with no mapped ids (`unshare -U`), where root's files are
  still its own but root's capabilities are gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    before: dict[str, str]  # relative path -> sha256, under the tmpfs
    after: dict[str, str]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (hidden ones and folders' contents included) by relative path -> sha256."""
    return {str(p.relative_to(root)) + ("/" if p.is_dir() else ""):
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def namespaces_problem() -> str | None:
    """Why on_tmpfs cannot run here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux)"
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True,
                       text=True, timeout=30)
    return None if r.returncode == 0 else f"unprivileged user and mount namespaces unavailable: {r.stderr.strip()}"


def unprivileged(argv: list[str]) -> list[str]:
    return ["unshare", "-U", *argv] if os.geteuid() == 0 else argv


def unprivileged_problem() -> str | None:
    if os.geteuid() != 0:
        return None
    if shutil.which("unshare") is None:
        return "running as root without unshare: permissions cannot refuse a write"
    r = subprocess.run(["unshare", "-U", "true"], capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"running as root and unshare -U fails: {r.stderr.strip()}"


def on_tmpfs(argv: list[str], mount: Path, copies: dict[str, Path], size: int, free: int | None = None,
             readonly: bool = False, env: dict[str, str] | None = None, timeout: float = 300) -> Run:
    """Run argv with a fresh tmpfs of `size` bytes at `mount` holding `copies` (name in the tmpfs -> source file
    or folder), then `free` bytes left (None: all the rest) or mounted read-only."""
    mount.mkdir(parents=True, exist_ok=True)
    spec = {"argv": argv, "mount": str(mount), "copies": {k: str(v) for k, v in copies.items()}, "size": size,
            "free": free, "readonly": readonly}
    r = subprocess.run(["unshare", "-rm", sys.executable, __file__, json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"fs_faults setup failed ({r.returncode}): {r.stderr}")
    return Run(**json.loads(r.stdout))


def _inside(spec: dict) -> None:
    mount = Path(spec["mount"])
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size']}", "tmpfs", str(mount)], check=True)
    for name, src in spec["copies"].items():
        (shutil.copytree if Path(src).is_dir() else shutil.copy)(src, mount / name)
    if spec["free"] is not None:
        st = os.statvfs(mount)
        fill = st.f_bavail * st.f_frsize - spec["free"]
        if fill < 0:
            raise SystemExit(f"the tmpfs has {st.f_bavail * st.f_frsize} bytes free, less than {spec['free']}")
        with open(mount / ".fill", "wb") as f:
            f.write(b"\0" * (fill // PAGE * PAGE))
    if spec["readonly"]:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    before = snapshot(mount)
    r = subprocess.run(spec["argv"], capture_output=True, text=True, timeout=240)
    print(json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "before": before,
                      "after": snapshot(mount)}))


if __name__ == "__main__":
    _inside(json.loads(sys.argv[1]))

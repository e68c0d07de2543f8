"""The user's own files and folders: what the operating system can refuse about them, said as one `UsageError` that
names the path and what to do, and the ways commands write them (atomically, or into a new folder that is removed
again when the command fails)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .common import UsageError


def output_file(path: str) -> str:
    """An output file path whose folder exists (checked before any work is done)."""
    parent = Path(path).expanduser().resolve().parent
    if Path(path).is_dir():
        raise UsageError(f"-o {path} is a directory; give a file name, e.g. {Path(path) / 'weights.safetensors'}")
    if not parent.is_dir():
        raise UsageError(f"-o {path}: the folder {parent} does not exist; create it first (mkdir -p {parent})")
    return path


# What the operating system can refuse about a user's file or folder, and what the user can do about it: the
# user's environment, never a bug of ours, wherever in a command it surfaces (main() reports these as one line).
PATH_ADVICE = {  # about the path the error names (the same errors without a path are about something else)
    errno.EACCES: "check the permissions of the file and its folder, or choose another path",
    errno.EPERM: "check the permissions of the file and its folder, or choose another path",
    errno.EROFS: "it is on a read-only filesystem: choose a path on a writable one",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "the path runs in a loop of symbolic links",
}
DISK_ADVICE = {  # about a disk, even where the system names no path (a write to an open file)
    errno.ENOSPC: "the disk is full: free space, or choose a path on another disk",
    errno.EDQUOT: "the disk quota is used up: free space, or choose a path on another disk",
    errno.EFBIG: "the file would exceed the filesystem's or the shell's file-size limit (ulimit -f)",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg)",
}
OS_ADVICE = {**PATH_ADVICE, **DISK_ADVICE}


def _path_name(path) -> str:
    return os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)


def environment_error(e: OSError) -> bool:
    """Whether an OSError is the user's environment (a file or disk refused), not a bug of ours."""
    return e.errno in DISK_ADVICE or (e.errno in PATH_ADVICE and e.filename is not None)


def os_error(e: OSError, path: str | os.PathLike | None = None, action: str | None = None) -> UsageError:
    """An OSError about a user's file as one paragraph: what could not be done to which path, the system's
    reason, and what to do (OS_ADVICE). `path`, `action`: the user's own path and what the command was doing
    with it, where known (else the path the system names)."""
    target = path if path is not None else e.filename
    what = None if target is None else f"cannot {action} {_path_name(target)}" if action else _path_name(target)
    advice = OS_ADVICE.get(e.errno)
    return UsageError((f"{what}: " if what else "") + f"{e.strerror or e}" + (f"; {advice}" if advice else ""))


@contextmanager
def user_path(path: str | os.PathLike, action: str, own: Path | None = None) -> Iterator[None]:
    """OSErrors raised inside, while `action` (e.g. "write -o") is done to the user's `path`, become one
    UsageError naming it. `own`: the folder all the files written inside live in; an error that names a file
    outside it (a pack file being read) is left to main()'s rule, which names that file."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        if own is not None and isinstance(e.filename, (str, bytes, os.PathLike)) and \
                not Path(os.fsdecode(e.filename)).resolve().is_relative_to(own.resolve()):
            raise
        raise os_error(e, path, action) from e


@contextmanager
def written_atomically(path: str, flag: str) -> Iterator[Path]:
    """A temporary path for the command to write `path` to: in a folder of its own made beside `path` at once
    (so a folder the user cannot write is refused before any work), moved onto `path` when the body succeeds (no
    reader sees half a file; a file already at `path` survives a failed run); the temporary folder, with
    anything half-written in it, is removed either way."""
    target = Path(path).expanduser()
    with user_path(path, f"write {flag}"):
        folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        with user_path(path, f"write {flag}", own=folder):
            yield folder / target.name
            os.replace(folder / target.name, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def new_output_folder(path: str, flag: str) -> Iterator[None]:
    """OSErrors while a command fills the new or empty folder `path` become one UsageError naming it; when the
    command fails, what it put there is removed (the folder too, if the command made it). A folder that was
    not new or empty is never touched (the command refuses it)."""
    out = Path(path).expanduser()
    existed = out.exists()
    fresh = not existed or (out.is_dir() and not any(out.iterdir()))
    try:
        with user_path(path, f"write {flag}"):
            yield
    except BaseException:
        if fresh and out.is_dir():
            for child in out.iterdir() if existed else [out]:
                try:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                except OSError:
                    pass  # the error that stopped the command is the one to report
        raise

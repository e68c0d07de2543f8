"""The files a load reads: opened once and shared by every worker (positional reads need no per-thread position),
with O_DIRECT where the filesystem allows it and the page cache where it refuses (at open or at the first read),
checked unchanged against the header's identity; `PackReadError` names the file, the offset and the tensor of a
read that failed."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

from ..format.errors import Exl3FormatError
from ..format.headers import FileIdentity

logger = logging.getLogger(__name__)


class PackReadError(Exl3FormatError):
    """Reading tensor bytes failed (short read, I/O error). Names the file, the absolute offset and the tensor."""

    def __init__(self, file: str | os.PathLike, offset: int, tensor: str | None, expected: str, found: str):
        self.offset = offset
        super().__init__(file, tensor, f"{expected} at offset {offset}", found)


class OpenFile:
    """One file shared by all workers (pread needs no per-thread position). Falls back from O_DIRECT once."""

    def __init__(self, path: Path, direct_io: bool, identity: FileIdentity | None = None):
        self.path = path
        self.identity = identity
        self.lock = threading.Lock()
        # (descriptor, opened with O_DIRECT), replaced as one value: a worker reads both at once (`handle`)
        self._handle = self._open(direct_io)
        # descriptors given up by the fallback, closed with the file: a worker may have taken one just before
        # the fallback and read from it after; closed under it, that read fails (EBADF) or, once another open
        # reuses the number, reads another file's bytes
        self._retired: list[int] = []

    @property
    def handle(self) -> tuple[int, bool]:
        """(descriptor, whether it reads with O_DIRECT): the pair a read uses, consistent with each other."""
        return self._handle

    @property
    def fd(self) -> int:
        return self._handle[0]

    @property
    def direct(self) -> bool:
        return self._handle[1]

    def _open(self, direct_io: bool) -> tuple[int, bool]:
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                return os.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_NONBLOCK), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise PackReadError(self.path, 0, None, "a file that opens for reading",
                                        f"{type(e).__name__}: {e}")
                logger.info("%s: O_DIRECT refused by the filesystem, reading through the page cache", self.path)
        return self._open_buffered(), False

    def check_unchanged(self, when: str) -> None:
        """The file is still the one whose header was read (same inode, size and mtime), both open and by path:
        a file rewritten in place or replaced during a load would mix old and new bytes."""
        if self.identity is None:
            return
        try:
            now = {FileIdentity.of(os.fstat(self.fd)), FileIdentity.of(os.stat(self.path))}
        except OSError as e:
            now = {f"{type(e).__name__}: {e}"}
        if now != {self.identity}:
            found = ", ".join(str(n) for n in now if n != self.identity)
            raise PackReadError(self.path, 0, None, f"the file as its header was read ({self.identity}) {when}",
                                f"{found}: the file was rewritten or replaced during the load; load again")

    def _open_buffered(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise PackReadError(self.path, 0, None, "a file that opens for reading", f"{type(e).__name__}: {e}")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger kernel read-ahead between our chunks
        return fd

    def fall_back_to_buffered(self, failed_fd: int) -> None:
        """Some filesystems accept O_DIRECT at open and refuse it at read time (EINVAL). The refused descriptor
        stays open until `close` (see `_retired`); a worker still holding it gets EINVAL again and comes here."""
        with self.lock:
            if self._handle == (failed_fd, True):
                logger.info("%s: O_DIRECT read refused, reading through the page cache", self.path)
                self._handle = (self._open_buffered(), False)
                self._retired.append(failed_fd)

    def close(self) -> None:
        for fd in (self.fd, *self._retired):
            os.close(fd)
        self._retired.clear()

"""Dirlock: one process per queue directory, by an exclusive ``flock`` on a lock file in it.

Two processes appending to one spool (a restarted unit while the old one still exits, two
containers on one volume) would interleave their records. The lock is taken before anything in
the directory is read and held until released or the process ends, however it ends: the kernel
drops a ``flock`` with the last descriptor, so a ``kill -9`` never leaves a stale lock behind.
The holder writes its pid into the file, so that the one refused can name it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from hfsampler.errors import QueueDirLockedError

LOCK_NAME = ".lock"


class DirLock:
    """An exclusive lock on a directory, held from ``acquire`` to ``release``."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path) -> DirLock:
        """Lock ``directory`` (made if missing); ``QueueDirLockedError`` if another holds it."""
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise QueueDirLockedError(str(directory), holder) from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):  # a full disk: the lock holds, the pid goes unsaid
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(directory, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None

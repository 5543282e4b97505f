"""Bounded sample rings in shared memory: one writer (the sampler process), readers that copy out.

One ring holds one sampling group. Each row is one tick: the host time of the read, the tick's
lateness, and per GPU and field the value (NaN when no distinct sample) and the driver timestamp.
The ring never grows: when a reader falls behind, the writer overwrites the oldest rows and the
reader counts what it lost. The writer publishes a row by bumping ``write_seq`` after the row is
complete; a reader re-checks ``write_seq`` after copying and discards rows that may have been
overwritten meanwhile (a seqlock without the lock).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import numpy.typing as npt

_HEADER_SLOTS = 8
_SEQ, _CAPACITY, _GPUS, _FIELDS = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class RingRows:
    """Rows copied out of a ring, oldest first."""

    time_ns: npt.NDArray[np.int64]  # [n] host wall-clock time of each tick's read
    lateness_ns: npt.NDArray[np.int64]  # [n]
    values: npt.NDArray[np.float64]  # [n, gpu, field], NaN where no distinct sample
    driver_ts_us: npt.NDArray[np.int64]  # [n, gpu, field]

    def __len__(self) -> int:
        return len(self.time_ns)

    def select(self, mask: npt.NDArray[np.bool_] | slice) -> RingRows:
        return RingRows(
            self.time_ns[mask], self.lateness_ns[mask], self.values[mask], self.driver_ts_us[mask]
        )

    @staticmethod
    def concat(parts: list[RingRows]) -> RingRows:
        return RingRows(
            np.concatenate([p.time_ns for p in parts]),
            np.concatenate([p.lateness_ns for p in parts]),
            np.concatenate([p.values for p in parts]),
            np.concatenate([p.driver_ts_us for p in parts]),
        )

    @staticmethod
    def empty(gpus: int, fields: int) -> RingRows:
        return RingRows(
            np.empty(0, np.int64),
            np.empty(0, np.int64),
            np.empty((0, gpus, fields)),
            np.empty((0, gpus, fields), np.int64),
        )


_SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"(?P<prefix>[a-z]+)_(?P<pid>\d+)_[0-9a-f]+\Z")


def _block_name(prefix: str) -> str:
    """``prefix_<creator pid>_<random>``: the pid lets a later run find blocks whose owner died."""
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(6)}"


def sweep_orphans(prefix: str = "hfs") -> list[str]:
    """Unlink blocks whose creating process is gone; returns their names.

    The owner frees its blocks on every exit it gets to run code on, and Python's resource
    tracker covers a SIGKILL of the owner alone; a SIGKILL of the whole process group (the
    tracker included) would leave them in /dev/shm for good, so each new sampler sweeps.
    """
    if not _SHM_DIR.is_dir():
        return []
    removed = []
    for entry in _SHM_DIR.iterdir():
        m = _NAME_RE.match(entry.name)
        if m is None or m["prefix"] != prefix or _alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without registering: the creator owns the block, an attacher must never unlink it."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=False, track=False)
    # Before 3.13 attaching registers the block with the resource tracker, which would unlink it
    # when this process exits and warn about a "leak"; skip that registration.
    original = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name, create=False)
    finally:
        resource_tracker.register = original


def _nbytes(capacity: int, gpus: int, fields: int) -> int:
    return 8 * (_HEADER_SLOTS + 2 * capacity + 2 * capacity * gpus * fields)


class Ring:
    """A fixed-size ring of ticks in one shared-memory block."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self._owner = owner
        buf = shm.buf
        header: npt.NDArray[np.int64] = np.ndarray((_HEADER_SLOTS,), np.int64, buf, 0)
        self.capacity = int(header[_CAPACITY])
        self.gpus = int(header[_GPUS])
        self.fields = int(header[_FIELDS])
        c, cells = self.capacity, self.gpus * self.fields
        off = 8 * _HEADER_SLOTS
        self._header = header
        self._time: npt.NDArray[np.int64] = np.ndarray((c,), np.int64, buf, off)
        off += 8 * c
        self._late: npt.NDArray[np.int64] = np.ndarray((c,), np.int64, buf, off)
        off += 8 * c
        shape = (c, self.gpus, self.fields)
        self._values: npt.NDArray[np.float64] = np.ndarray(shape, np.float64, buf, off)
        off += 8 * c * cells
        self._driver: npt.NDArray[np.int64] = np.ndarray(shape, np.int64, buf, off)

    @classmethod
    def create(cls, capacity: int, gpus: int, fields: int, prefix: str = "hfs") -> Ring:
        if capacity < 2 or gpus < 1 or fields < 1:
            raise ValueError("a ring needs capacity >= 2, at least one GPU and one field")
        name = _block_name(prefix)
        shm = shared_memory.SharedMemory(name, create=True, size=_nbytes(capacity, gpus, fields))
        header: npt.NDArray[np.int64] = np.ndarray((_HEADER_SLOTS,), np.int64, shm.buf, 0)
        header[:] = 0
        header[_CAPACITY], header[_GPUS], header[_FIELDS] = capacity, gpus, fields
        del header  # no view may outlive close()
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> Ring:
        return cls(_attach_untracked(name), owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def nbytes(self) -> int:
        return self._shm.size

    @property
    def write_seq(self) -> int:
        """How many rows have ever been written."""
        return int(self._header[_SEQ])

    # -- writer ----------------------------------------------------------------------------------

    def slot(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """The next row's value and driver-timestamp arrays, for the source to fill in place."""
        i = int(self._header[_SEQ]) % self.capacity
        return self._values[i], self._driver[i]

    def commit(self, time_ns: int, lateness_ns: int) -> None:
        """Publish the row filled through ``slot()``."""
        seq = int(self._header[_SEQ])
        i = seq % self.capacity
        self._time[i] = time_ns
        self._late[i] = lateness_ns
        self._header[_SEQ] = seq + 1

    # -- reader ----------------------------------------------------------------------------------

    def read_since(self, seq: int) -> tuple[int, RingRows, int]:
        """Rows written after ``seq``: (new seq, rows, rows lost to overwriting)."""
        head = self.write_seq
        start = max(seq, head - self.capacity)
        lost = start - seq
        rows = self._copy(start, head)
        # rows the writer may have overwritten while we copied are dropped and counted as lost
        after = self.write_seq
        safe_start = after - self.capacity + 1
        if safe_start > start:
            drop = min(safe_start - start, head - start)
            rows = rows.select(slice(drop, None))
            lost += drop
        return head, rows, lost

    def _copy(self, start: int, stop: int) -> RingRows:
        if stop <= start:
            return RingRows.empty(self.gpus, self.fields)
        idx = np.arange(start, stop) % self.capacity
        return RingRows(self._time[idx], self._late[idx], self._values[idx], self._driver[idx])

    def close(self) -> None:
        """Drop this process's mapping; the owner also frees the block."""
        for attr in ("_header", "_time", "_late", "_values", "_driver"):
            with contextlib.suppress(AttributeError):
                delattr(self, attr)
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


class SharedInts:
    """A small int64 array in shared memory: the sampler's counters and flags for the parent."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self._owner = owner
        self.array: npt.NDArray[np.int64] = np.ndarray((shm.size // 8,), np.int64, shm.buf, 0)

    @classmethod
    def create(cls, size: int, prefix: str = "hfs") -> SharedInts:
        name = _block_name(prefix)
        shm = shared_memory.SharedMemory(name, create=True, size=8 * size)
        made = cls(shm, owner=True)
        made.array[:] = 0
        return made

    @classmethod
    def attach(cls, name: str) -> SharedInts:
        return cls(_attach_untracked(name), owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.array
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()

"""Bounded sample rings in shared memory: one writer (the sampler process), readers that copy out.

One ring holds one sampling group. Each row is one tick: the host time of the read, the tick's
lateness, and per GPU and field the value and the driver timestamp as read. A value whose driver
timestamp is the row before's is a repeat, no distinct sample: readers get NaN there. The reader
marks repeats, in one vectorised pass over the rows it copies, so that the writer's millisecond
tick does not (three small numpy operations a tick, measured as a fifth of its CPU).
The ring never grows: when a reader falls behind, the writer overwrites the oldest rows and the
reader counts what it lost. The writer publishes a row by bumping ``write_seq`` after the row is
complete; a reader re-checks ``write_seq`` after copying and discards rows that may have been
overwritten meanwhile (a seqlock without the lock).

A block is a file in the shared-memory directory (``/dev/shm``, where POSIX shared memory lives),
mapped by every process that uses it. Its pages are reserved when it is made, so a full tmpfs
refuses the block at start with ENOSPC instead of killing the sampler with SIGBUS mid-run;
``check_room`` says beforehand whether the directory can take the blocks at all.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
import numpy.typing as npt

from hfsampler.errors import ConfigError

IndexArray = npt.NDArray[np.intp]
_HEADER_SLOTS = 8
_SEQ, _CAPACITY, _GPUS, _FIELDS = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class RingRows:
    """Rows copied out of a ring, oldest first."""

    time_ns: npt.NDArray[np.int64]  # [n] host wall-clock time of each tick's read
    lateness_ns: npt.NDArray[np.int64]  # [n]
    values: npt.NDArray[np.float64]  # [n, gpu, field], NaN where no distinct sample (a repeat)
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


@dataclass(frozen=True, slots=True)
class RingCells:
    """Rows copied out of a ring, oldest first, of only some cells (GPU and field pairs), cell
    by cell: each cell's rows lie together, so that a reduction over the rows runs along
    contiguous memory (a ring's row is a few cells wide; numpy is slow across such rows)."""

    time_ns: npt.NDArray[np.int64]  # [n] host wall-clock time of each tick's read
    values: npt.NDArray[np.float64]  # [cell, n] as written (repeats kept)
    driver_ts_us: npt.NDArray[np.int64]  # [cell, n]

    def __len__(self) -> int:
        return len(self.time_ns)


SHM_DIR = Path("/dev/shm")
# For tests only: make the blocks in this directory instead (a small tmpfs, a read-only mount).
SHM_DIR_ENV = "HFSAMPLER_SHM_DIR"
_NAME_RE = re.compile(r"(?P<prefix>[a-z]+)_(?P<pid>\d+)_[0-9a-f]+\Z")
_PAGE = mmap.PAGESIZE


def shm_dir() -> Path:
    """Where the blocks are made: ``/dev/shm``, or ``$HFSAMPLER_SHM_DIR`` in tests."""
    return Path(os.environ.get(SHM_DIR_ENV) or SHM_DIR)


def block_bytes(size: int) -> int:
    """What a block of ``size`` bytes takes in the directory: whole pages."""
    return -(-size // _PAGE) * _PAGE


def check_room(nbytes: int, directory: Path | None = None) -> None:
    """Refuse, before anything is made, blocks of ``nbytes`` in all that ``directory`` cannot take.

    A ``ConfigError`` naming the directory, the bytes and the fix: a mount the operator sets up
    (a container's ``--shm-size``, the DaemonSet's ``shm`` volume) is as much a setting as a key.
    """
    d = directory if directory is not None else shm_dir()
    try:
        st = os.statvfs(d)
    except OSError as exc:
        raise ConfigError(str(d), f"cannot use it: {exc.strerror}", _MOUNT_FIX) from None
    if not d.is_dir():
        raise ConfigError(str(d), "is not a directory", _MOUNT_FIX)
    if st.f_flag & os.ST_RDONLY:
        raise ConfigError(str(d), "is mounted read-only", _MOUNT_FIX)
    if not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(str(d), "is not writable by this user", "run as a user who may write it")
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise ConfigError(
            str(d),
            f"the sample rings need {format_bytes(nbytes)} ({nbytes} bytes), "
            f"{format_bytes(free)} free",
            ROOM_FIX,
        )


_MOUNT_FIX = (
    "mount a writable tmpfs there, e.g. the DaemonSet's shm volume: an emptyDir with medium: Memory"
)
ROOM_FIX = (
    "give it more room: docker run --shm-size, the DaemonSet's shm volume sizeLimit; "
    "or shorten --window or lengthen the intervals"
)


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: 512 KiB, 64.0 MiB, 5.70 GiB."""
    if n < 1 << 20:
        return f"{n / 1024:.0f} KiB"
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


def _block_name(prefix: str) -> str:
    """``prefix_<creator pid>_<random>``: the pid lets a later run find blocks whose owner died."""
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(6)}"


def sweep_orphans(prefix: str = "hfs") -> list[str]:
    """Unlink blocks whose creating process is gone; returns their names.

    The owner frees its blocks on every exit it gets to run code on, and Python's resource
    tracker covers a SIGKILL of the owner alone; a SIGKILL of the whole process group (the
    tracker included) would leave them in /dev/shm for good, so each new sampler sweeps.
    """
    directory = shm_dir()
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
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


class _Block:
    """One named block of shared memory: a file in the shared-memory directory, mapped here.

    The same thing ``multiprocessing.shared_memory`` makes with ``shm_open``, which can only use
    ``/dev/shm``; a file of our own can live where a test puts it, and its pages can be reserved.
    """

    def __init__(self, path: Path, mapping: mmap.mmap, owner: bool) -> None:
        self.path = path
        self._mmap = mapping
        self.buf = memoryview(mapping)
        self._owner = owner
        # Python's resource tracker unlinks a block in /dev/shm whose owner was killed; it knows
        # POSIX shared-memory names, which only /dev/shm's files have.
        self._tracked = owner and path.parent == SHM_DIR
        if self._tracked:
            resource_tracker.register("/" + path.name, "shared_memory")

    @classmethod
    def create(cls, size: int, prefix: str) -> _Block:
        """A new block of ``size`` bytes, its pages reserved (OSError: ENOSPC, EROFS, EACCES)."""
        path = shm_dir() / _block_name(prefix)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # no reservation where the file system has none
            mapping = mmap.mmap(fd, size)
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        finally:
            os.close(fd)
        return cls(path, mapping, owner=True)

    @classmethod
    def attach(cls, name: str) -> _Block:
        """Map an existing block; an attacher never unlinks it (FileNotFoundError if gone)."""
        path = shm_dir() / name
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(path, mapping, owner=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def size(self) -> int:
        return len(self._mmap)

    def close(self) -> None:
        """Drop this process's mapping (no array may still view it); the owner frees the block."""
        self.buf.release()
        self._mmap.close()
        if self._owner:
            self._owner = False
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            if self._tracked:
                resource_tracker.unregister("/" + self.path.name, "shared_memory")


def _nbytes(capacity: int, gpus: int, fields: int) -> int:
    return 8 * (_HEADER_SLOTS + 2 * capacity + 2 * capacity * gpus * fields)


def ring_bytes(capacity: int, gpus: int, fields: int) -> int:
    """What a ring of this size takes in the shared-memory directory."""
    return block_bytes(_nbytes(capacity, gpus, fields))


@dataclass(slots=True)
class _Writer:
    """The writer's side of a ring, made on its first row: what each tick needs, ready."""

    seq: int  # rows written: kept here, as there is one writer
    ints: memoryview  # the header, times and latenesses as int64: a store is a plain store
    values: list[npt.NDArray[np.float64]]  # every row's arrays, made once
    driver: list[npt.NDArray[np.int64]]


class Ring:
    """A fixed-size ring of ticks in one shared-memory block."""

    def __init__(self, shm: _Block) -> None:
        self._shm = shm
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
        # the values and the driver timestamps, a row's cells flat, as one array of int64 (the
        # driver's block follows the values'): ``columns`` takes a span's cells of both with
        # one ``take``, and views the values' half as float64 again
        self._flat_both: npt.NDArray[np.int64] = np.ndarray(
            (2, c, cells), np.int64, buf, 8 * (_HEADER_SLOTS + 2 * c)
        )
        # the header and the read times as Python ints: a reader's binary search and head read
        # index this (no numpy scalar per probe)
        self._ints = buf[: 8 * (_HEADER_SLOTS + c)].cast("q")
        # and every row's values and timestamps, for ``row``
        at = 8 * (_HEADER_SLOTS + 2 * c)
        self._row_values = buf[at : at + 8 * c * cells].cast("d")
        self._row_driver = buf[at + 8 * c * cells : at + 16 * c * cells].cast("q")
        self._writer: _Writer | None = None

    @classmethod
    def create(cls, capacity: int, gpus: int, fields: int, prefix: str = "hfs") -> Ring:
        if capacity < 2 or gpus < 1 or fields < 1:
            raise ValueError("a ring needs capacity >= 2, at least one GPU and one field")
        shm = _Block.create(_nbytes(capacity, gpus, fields), prefix)
        header: npt.NDArray[np.int64] = np.ndarray((_HEADER_SLOTS,), np.int64, shm.buf, 0)
        header[:] = 0
        header[_CAPACITY], header[_GPUS], header[_FIELDS] = capacity, gpus, fields
        del header  # no view may outlive close()
        return cls(shm)

    @classmethod
    def attach(cls, name: str) -> Ring:
        return cls(_Block.attach(name))

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def nbytes(self) -> int:
        return self._shm.size

    @property
    def write_seq(self) -> int:
        """How many rows have ever been written."""
        return self._ints[_SEQ]

    # -- writer ----------------------------------------------------------------------------------
    # A millisecond tick runs with cold caches after each sleep, so the writer's path is short:
    # no numpy scalar reads or writes, and no array made per row.

    def slot(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """The next row's value and driver-timestamp arrays, for the source to fill in place.

        The first call makes every row's arrays (a few ms for thousands of rows): a writer
        calls it once before its first deadline.
        """
        w = self._writer or self._make_writer()
        i = w.seq % self.capacity
        return w.values[i], w.driver[i]

    def commit(self, time_ns: int, lateness_ns: int) -> None:
        """Publish the row filled through ``slot()``."""
        w = self._writer or self._make_writer()
        seq = w.seq
        i = seq % self.capacity
        ints = w.ints
        ints[_HEADER_SLOTS + i] = time_ns
        ints[_HEADER_SLOTS + self.capacity + i] = lateness_ns
        ints[_SEQ] = seq + 1  # the row is complete: publish it
        w.seq = seq + 1

    def _make_writer(self) -> _Writer:
        ints = self._shm.buf[: 8 * (_HEADER_SLOTS + 2 * self.capacity)].cast("q")
        self._writer = _Writer(self.write_seq, ints, list(self._values), list(self._driver))
        return self._writer

    # -- reader ----------------------------------------------------------------------------------

    def read_since(self, seq: int) -> tuple[int, RingRows, int]:
        """Rows written after ``seq``: (new seq, rows, rows lost to overwriting).

        Values that repeat the row before's driver timestamp are NaN, the first row's judged
        against the row before it while the ring still holds that one.
        """
        head = self.write_seq
        start = max(seq, head - self.capacity)
        lost = start - seq
        first = start - 1 if start > max(0, head - self.capacity) else start
        rows = self._copy(first, head)
        # rows the writer may have overwritten while we copied are dropped and counted as lost
        after = self.write_seq
        valid = max(first, after - self.capacity + 1)
        if valid > start:
            lost += min(valid, head) - start
        keep = max(start, valid)
        if keep >= head:
            return head, RingRows.empty(self.gpus, self.fields), lost
        driver = rows.driver_ts_us
        repeat = np.zeros(driver.shape, dtype=np.bool_)
        np.equal(driver[1:], driver[:-1], out=repeat[1:])
        repeat[valid - first] = False  # its predecessor was not copied, or may be torn
        np.putmask(rows.values, repeat, np.nan)
        return head, rows.select(slice(keep - first, None)), lost

    def seq_at(self, t_ns: int) -> tuple[int, int]:
        """(the first row read at or after ``t_ns``, the oldest row the ring still holds), as
        rows ever written; the first is the head when no row is that late yet.

        A binary search over the rows held (their read times only grow): a few microseconds,
        whatever the ring's size, so a reader can take any span without following the ring.
        """
        ints, capacity = self._ints, self.capacity
        head = ints[_SEQ]
        lo = oldest = max(0, head - capacity + 1)  # the row at head - capacity may be torn
        hi = head
        while lo < hi:
            mid = (lo + hi) // 2
            if ints[_HEADER_SLOTS + mid % capacity] < t_ns:
                lo = mid + 1
            else:
                hi = mid
        return lo, oldest

    def read_ns(self, seq: int) -> int:
        """When row ``seq`` (as rows ever written) was read; ask ``holds`` after."""
        return self._ints[_HEADER_SLOTS + seq % self.capacity]

    def cell_index(self, gpus: Sequence[int], fields: Sequence[int]) -> IndexArray:
        """The cells ``columns`` takes for these GPUs and fields, field by field: the first
        field's cell of each GPU in order, then the second field's, and so on."""
        return np.array([g * self.fields + f for f in fields for g in gpus], np.intp)

    def columns(self, start: int, stop: int, cells: IndexArray) -> tuple[RingCells, bool]:
        """Rows ``[start, stop)`` (as rows ever written) of only some cells, and whether all of
        them were still there after the copy (False: the writer overwrote the first ones
        meanwhile, or had before). ``cells``: ``cell_index``'s, made once by the caller.
        Repeats are kept as written: a reader that integrates over driver timestamps needs no
        NaN for them. A span in one stretch of the ring (all but one in ``capacity``) is two
        copies: its read times, and its cells of values and timestamps, cell by cell, in one
        ``take``."""
        c = self.capacity
        at, n = start % c, max(stop - start, 0)
        if at + n <= c:
            times = self._time[at : at + n].copy()
            rows = self._flat_both[:, at : at + n]
        else:  # across the ring's end: rows ever written, which ``take`` wraps into the ring
            seqs = np.arange(start, stop)
            times = self._time.take(seqs, mode="wrap")
            rows = self._flat_both.take(seqs, axis=1, mode="wrap")
        both = rows.transpose(0, 2, 1).take(cells, axis=1)  # [values | timestamps, cell, row]
        return RingCells(times, both[0].view(np.float64), both[1]), self.holds(start)

    def row(self, seq: int, cells: Sequence[int]) -> tuple[list[float], list[int]]:
        """One row's (as rows ever written) values and driver timestamps of some cells, as
        Python numbers: what a reader of two rows (a counter's ends) reads without numpy. Ask
        ``holds`` after, as ``columns`` does."""
        at = (seq % self.capacity) * self.gpus * self.fields
        values, driver = self._row_values, self._row_driver
        return [values[at + c] for c in cells], [driver[at + c] for c in cells]

    def holds(self, seq: int) -> bool:
        """Whether row ``seq`` (as rows ever written) is still whole: asked after a copy, the
        copy is of it."""
        return seq >= self._ints[_SEQ] - self.capacity + 1

    def _copy(self, start: int, stop: int) -> RingRows:
        if stop <= start:
            return RingRows.empty(self.gpus, self.fields)
        idx = np.arange(start, stop) % self.capacity
        return RingRows(self._time[idx], self._late[idx], self._values[idx], self._driver[idx])

    def close(self) -> None:
        """Drop this process's mapping; the owner also frees the block."""
        if self._writer is not None:
            self._writer.ints.release()
            self._writer = None
        for view in ("_ints", "_row_values", "_row_driver"):
            with contextlib.suppress(AttributeError):
                getattr(self, view).release()
        for attr in ("_header", "_time", "_late", "_values", "_driver", "_flat_both", "_ints",
                     "_row_values", "_row_driver"):  # fmt: skip
            with contextlib.suppress(AttributeError):
                delattr(self, attr)
        self._shm.close()


class SharedInts:
    """A small int64 array in shared memory: the sampler's counters and flags for the parent."""

    def __init__(self, shm: _Block) -> None:
        self._shm = shm
        self.array: npt.NDArray[np.int64] = np.ndarray((shm.size // 8,), np.int64, shm.buf, 0)

    @classmethod
    def create(cls, size: int, prefix: str = "hfs") -> SharedInts:
        made = cls(_Block.create(8 * size, prefix))
        made.array[:] = 0
        return made

    @classmethod
    def attach(cls, name: str) -> SharedInts:
        return cls(_Block.attach(name))

    @property
    def name(self) -> str:
        return self._shm.name

    def view(self) -> memoryview:
        """The block's bytes, for a reader that wants no numpy; release it before ``close``."""
        return self._shm.buf[:]

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.array
        self._shm.close()

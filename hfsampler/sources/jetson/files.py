"""The jetson source's files: each opened once and read with ``os.pread`` at offset 0 (sysfs and
procfs regenerate the text on each read at offset 0), parsed into one number, with its refresh
period and its latest distinct sample; and the values built from one or two of them.

A ``File`` is re-read only once its skip has passed, and a reading is a new sample when its value
changed or a whole period passed since the last; a ``Value`` is a field's number from one file or
two, scaled to the exported unit. ``jetson.JetsonSource`` decides which files and values there
are, and their periods.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("hfsampler.sources.jetson.source")

NAN = math.nan
MIN_SKIP_NS = 2_000_000  # files refreshing faster than this are read on every tick
UNKNOWN_PERIOD_NS = 1_000_000_000  # a value that never changed still counts once a second

Parse = Callable[[bytes], float]
Bounds = tuple[float, float]  # the plausible readings of a file, in its own unit
ANY: Bounds = (-math.inf, math.inf)
MILLI_C: Bounds = (-100_000, 200_000)  # a thermal zone: below -100 C is a disabled zone's sentinel
NOT_NEGATIVE: Bounds = (0, math.inf)  # a rail's voltage (mV) and current (mA)
MILLI_W: Bounds = (0, 10_000_000)  # a rail's power: over 10 kW no Jetson draws
MAX_W = 10_000.0
ONE, PRODUCT, RATIO, DIFF = 0, 1, 2, 3


def parse_int(data: bytes) -> float:
    return float(int(data))


def parse_runtime_status(data: bytes) -> float:
    """Runtime PM's state: 1 when suspended (the GPU's rail is gated), 0 when active."""
    word = data.strip()
    if word in (b"active", b"resuming"):
        return 0.0
    if word in (b"suspended", b"suspending"):
        return 1.0
    raise ValueError(f"runtime PM status {word.decode(errors='replace')!r}")


def meminfo_kib(key: str) -> Parse:
    """One /proc/meminfo line's value (kB) from the whole file's text."""
    tag = key.encode() + b":"

    def parse(data: bytes) -> float:
        at = data.find(tag)
        while at > 0 and data[at - 1] != 0x0A:  # MemFree: inside NvMapMemFree:
            at = data.find(tag, at + 1)
        if at < 0:
            raise ValueError(f"no {key} in meminfo")
        return float(int(data[at + len(tag) : data.index(b"kB", at)]))

    return parse


def open_regular(path: Path) -> int:
    """A read-only descriptor on a regular file (every sysfs attribute is one). O_NONBLOCK: a
    FIFO put in the file's place must not block the open, and is refused like a directory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    raise OSError(errno.EINVAL, "not a regular file", str(path))


class Blob:
    """One file, opened once and read once per instant however many values it holds (meminfo).

    A read that fails with an ``OSError`` (ENODEV once a driver is unbound, ESTALE) makes it
    stale, and so does its path naming another inode (replaced by a rename, a driver rebound:
    sysfs gives the new attribute a new inode, while the old descriptor reads the old one or
    fails). ``check``, called about once a second off the fast path, reopens a stale blob, and
    closes one whose path is gone; while closed, every read fails with why.
    """

    __slots__ = (
        "at_ns", "data", "fd", "ident", "lock", "path", "replaced", "size", "stale", "why"
    )  # fmt: skip

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.fd = -1
        self.ident = (0, 0)  # st_dev, st_ino of what fd reads
        self.stale = True
        self.why = (errno.EBADF, "not opened")  # what a read of the closed blob raises
        self.replaced = 0
        self.at_ns = -1
        self.data = b""
        # Its reads (File.poll) and its reopening, one at a time: the lanes may share a file
        # (meminfo, the GPU rail), and a descriptor closed under a read could be reused by the
        # next open. Per file, so a slow one (an I2C sensor) holds up only its own readers.
        self.lock = threading.Lock()

    def open(self) -> None:
        """Open, or open again; raises OSError (and stays closed, ``why`` saying why)."""
        self.close()
        try:
            fd = open_regular(self.path)
        except OSError as exc:
            self.why = (exc.errno or errno.EIO, exc.strerror or str(exc))
            raise
        st = os.fstat(fd)
        self.fd, self.ident, self.stale, self.at_ns = fd, (st.st_dev, st.st_ino), False, -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.stale = True

    def read(self) -> bytes:
        if self.fd < 0:
            raise OSError(*self.why)
        return os.pread(self.fd, self.size, 0)

    def get(self, now_ns: int) -> bytes:
        """The file at ``now_ns``, read once for all its values (under ``lock``: File.poll)."""
        if now_ns != self.at_ns:
            self.data = self.read()
            self.at_ns = now_ns
        return self.data

    def check(self) -> bool:
        """Reopen if stale or replaced, close if gone; True when it was replaced (and reopened)."""
        with self.lock:
            return self._check()

    def _check(self) -> bool:
        if not self.stale:
            try:
                st = os.stat(self.path)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                    return False  # the path cannot be looked at now; the descriptor still reads
                self.close()
                self.why = (exc.errno, f"{exc.strerror} (gone since it was opened)")
                return False
            if (st.st_dev, st.st_ino) == self.ident:
                return False
        replaced = not self.stale
        try:
            self.open()
        except OSError:
            return False
        self.replaced += replaced
        return replaced


class File:
    """One value: a blob, how to parse it, its refresh period and its latest distinct sample.

    A read that fails is NaN; the first failure of each run of failures is logged (the first
    ever as a warning), and so is the read that ends it, so a file that flaps costs lines only at
    debug level after the first time.
    """

    __slots__ = ("blob", "declared_ns", "errors", "failing", "hi", "hw_ns", "lo", "parse",
                 "period_ns", "raw", "read_ns", "runs", "sample_ns", "skip_ns", "what")  # fmt: skip

    def __init__(self, what: str, blob: Blob, parse: Parse, declared_s: float | None,
                 hw_s: float | None, bounds: Bounds = ANY) -> None:  # fmt: skip
        self.what = what
        self.blob = blob
        self.parse = parse
        self.lo, self.hi = bounds  # a reading outside is a failed read: no driver means it
        self.declared_ns = int(declared_s * 1e9) if declared_s else 0  # a driver's own period
        self.hw_ns = int(hw_s * 1e9) if hw_s else 0  # a converter's timer: nothing new sooner
        self.period_ns = UNKNOWN_PERIOD_NS
        self.skip_ns = 0
        self.read_ns = -(1 << 62)
        self.sample_ns = 0
        self.raw = NAN
        self.errors = 0  # failed reads
        self.failing = False
        self.runs = 0  # runs of failures

    def poll(self, now_ns: int) -> None:
        """Read the file unless it cannot have changed; under its blob's lock, so two lanes (or
        the energy thread) polling one file keep its sample and its blob consistent."""
        with self.blob.lock:
            self._poll(now_ns)

    def _poll(self, now_ns: int) -> None:
        # (the clock is the wall clock, which NTP may step back: a negative gap is a new read)
        if 0 <= now_ns - self.read_ns < self.skip_ns:
            return  # the hardware cannot have refreshed since the last read
        self.read_ns = now_ns
        try:
            value = self.decode(self.blob.get(now_ns))
        except OSError as exc:
            self.blob.stale = True
            self.fail(exc, "reopened once a second until it reads")
            return
        except ValueError as exc:
            self.fail(exc, "retried on every read")
            return
        if self.failing:
            self.failing = False
            say = log.info if self.runs == 1 else log.debug
            say("jetson: %s (%s) reads again", self.what, self.blob.path)
        if value != self.raw or not 0 <= now_ns - self.sample_ns < self.period_ns:
            self.raw = value
            self.sample_ns = now_ns

    def decode(self, data: bytes) -> float:
        """The file's text as a number, if it is a plausible one (ValueError otherwise)."""
        value = self.parse(data)
        if not self.lo <= value <= self.hi:
            raise ValueError(f"{value:g} is outside the plausible {self.lo:g} to {self.hi:g}")
        return value

    def fail(self, exc: Exception, then: str, say: Callable[..., None] | None = None) -> None:
        """A read that failed: NaN, and one line where a run of failures starts."""
        self.raw = NAN
        self.errors += 1
        if self.failing:
            return
        self.failing = True
        self.runs += 1
        if say is None:
            say = log.warning if self.runs == 1 else log.debug
        say("jetson: reading %s (%s) failed: %s; %s", self.what, self.blob.path, exc, then)


class Value:
    """A field's value from one file, or two (voltage x current, total - available), scaled.

    From two files it is a new sample when the result changed, or when the faster input's period
    passed since the last: a steady voltage counted once a period must not double the samples of
    the current it multiplies.
    """

    __slots__ = ("a", "b", "hi", "last", "last_ns", "op", "refused", "scale", "what")

    def __init__(self, op: int, a: File, b: File | None, scale: float, *, hi: float = math.inf,
                 what: str = "") -> None:  # fmt: skip
        self.op, self.a, self.b, self.scale = op, a, b, scale
        self.hi, self.what = hi, what  # from two files: above hi is no reading (logged once)
        self.refused = False
        self.last = NAN
        self.last_ns = 0

    @property
    def files(self) -> tuple[File, ...]:
        return (self.a,) if self.b is None else (self.a, self.b)

    def evaluate(self) -> tuple[float, int]:
        """(value, its sample time in ns; 0 when there is no value)."""
        a, b = self.a, self.b
        if b is None:
            value = a.raw * self.scale
            return value, (0 if value != value else a.sample_ns)
        if self.op == PRODUCT:
            value = a.raw * b.raw * self.scale
        elif self.op == DIFF:
            value = (a.raw - b.raw) * self.scale
        else:
            value = a.raw / b.raw * self.scale if b.raw else NAN
        if value != value:  # NaN
            return value, 0
        if value > self.hi:
            if not self.refused:
                self.refused = True
                log.warning("jetson: %s %g is outside the plausible 0 to %g; read as none",
                            self.what, value, self.hi)  # fmt: skip
            return NAN, 0
        seen = max(a.sample_ns, b.sample_ns)
        if value != self.last or not 0 <= seen - self.last_ns < min(a.period_ns, b.period_ns):
            self.last, self.last_ns = value, seen
        return value, self.last_ns


class Dead(File):
    """The file behind an unsupported column: never polled, always NaN."""

    def __init__(self) -> None:  # no blob: nothing to open
        self.raw, self.sample_ns = NAN, 0


DEAD = Dead()

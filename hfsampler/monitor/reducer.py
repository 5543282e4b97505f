"""The Monitor's reducer: a process of its own that turns a window's rows into its numbers.

``end_window`` in the job's process only takes the time and writes the window's span to a pipe
(one write of 32 bytes): finding its rows, copying and reducing them, the p99 and the throttled
time included, happens here, in a process spawned beside the sampler that maps the same rings.
The answer goes into a slot of a shared-memory table (``_Slots``: one per window asked, reused
every ``SLOTS`` windows), and a byte down a second pipe wakes a job's thread that waits for it.
A ``Measurement`` reads its slot on its first read: a job that reads it a step later finds it
there and pays a few microseconds; one that reads it at once waits for it (about a
millisecond), asleep. Nothing in the job's process runs for a window it never reads.

A slot starts with its window's number, written after the rest (a reader that finds another
number, before or after reading, knows the slot was reused meanwhile). A window still held
unread when its slot comes round again has its record copied out first, by the ``end_window``
that reuses it (bytes, decoded when read); one the process had not answered by then (``SLOTS``
windows behind) is reduced in the job's process when read, if the rings still hold it.
``close`` asks its last question, stop, after every other: the windows ended before it are
answered first, and copied out of the table before it is freed. Where the process is gone
(killed, or it failed) or has not answered for ``_PATIENCE_S``, or by the time the rings would
let go of the window's rows (stopped), a waiting window is reduced in the job's process
instead, from the same rings, said once; so is a window ended while the pipe stays full (2,048
behind) as long. The process ignores the signals a terminal sends the whole process group (the
job owns Ctrl-C) and dies with the job (``PR_SET_PDEATHSIG``), as the sampler does.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import multiprocessing
import os
import select
import signal
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from hfsampler.errors import ConfigError
from hfsampler.fields import CLOCK_EVENT_REASONS
from hfsampler.monitor.measurement import Answer
from hfsampler.monitor.spans import Parts, SpanReader
from hfsampler.sampling import spawning
from hfsampler.sampling.lanes import PR_SET_PDEATHSIG, prctl
from hfsampler.sampling.ring import (
    ROOM_FIX,
    Ring,
    SharedInts,
    block_bytes,
    format_bytes,
    shm_dir,
)

# A request: its number, the window's [t0_ns, t1_ns), and the rings' head when it ended (-1:
# the rows read up to t1_ns). Each is written whole, with no framing (every one is this size).
_REQUEST = struct.Struct("<qqqq")
_STOP = _REQUEST.pack(-1, 0, 0, 0)
_UNTIL_T1 = -1
SLOTS = 1024  # answers kept in the table: a Measurement read within this many windows is there
_START_TIMEOUT_S = 30.0
_WAKE_S = 0.002  # a waiting thread looks again this often (another may have taken its byte)
_CHECK_S = 0.5  # and whether the process is still there this often
_PATIENCE_S = 5.0  # how long a window waits for the process before it is reduced here
_REASONS = tuple(CLOCK_EVENT_REASONS.values())
_PER_GPU = 6 + len(_REASONS)  # energy, covered, peak, p99, memory, counter; then each reason
_OK, _LOST, _FAILED = 0, 1, 2
# A warning points at the job's line: the first frame outside hfsampler (a Measurement read
# through ``total_energy`` or an item passes through a few of its frames).
_INSIDE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# What a waiting window gets: an answer, or None: the rings no longer held its rows.
Reply = Answer | None


class ReducerGone(RuntimeError):
    """The reducer process ended before it answered."""


class Pending:
    """A window asked of the reducer: its number and span, and its answer once read."""

    __slots__ = ("__weakref__", "kept", "number", "read", "reply", "stop", "t0_ns", "t1_ns")

    def __init__(self, number: int, t0_ns: int, t1_ns: int, stop: int | None) -> None:
        self.number, self.t0_ns, self.t1_ns, self.stop = number, t0_ns, t1_ns, stop
        self.read = False
        self.reply: Reply = None
        self.kept: bytes | None = None  # its record, copied out of the table before reuse


class _Slots:
    """The answers' table in shared memory, as 8-byte words: per slot, the window's number, its
    status, then per GPU ``_PER_GPU`` float64s."""

    def __init__(self, table: SharedInts, gpus: int) -> None:
        self.table = table
        self.gpus = gpus
        self.words = 2 + gpus * _PER_GPU
        self._bytes = table.view()
        self._ints = self._bytes.cast("q")
        self._record = struct.Struct(f"<{gpus * _PER_GPU}d")

    @property
    def name(self) -> str:
        return self.table.name

    @classmethod
    def create(cls, gpus: int) -> _Slots:
        """A new table, in the rings' directory; a ``ConfigError`` naming it, the bytes and the
        fix where it has no room left (the rings, made first, took it)."""
        words = SLOTS * (2 + gpus * _PER_GPU)
        try:
            return cls(SharedInts.create(words), gpus)
        except OSError as exc:
            need = block_bytes(8 * words)
            raise ConfigError(
                str(shm_dir()),
                f"cannot make the Monitor's table of answers, {format_bytes(need)} ({need} "
                f"bytes) beside its sample rings: {exc.strerror}",
                ROOM_FIX,
            ) from None

    def number_at(self, number: int) -> int:
        return self._ints[(number % SLOTS) * self.words]

    def write(self, number: int, status: int, answer: Answer | None) -> None:
        """The reducer's side: the record, then its number (which says it is whole)."""
        at = (number % SLOTS) * self.words
        self._ints[at] = -1  # being written
        self._ints[at + 1] = status
        if answer is not None:
            values: list[float] = []
            for g in range(self.gpus):
                counter = answer.counter_j[g]
                reasons = answer.throttled_s[g]
                values += [answer.energy_j[g], answer.covered_s[g], answer.peak_w[g],
                           answer.p99_w[g], answer.memory_mib[g],
                           math.nan if counter is None else counter]  # fmt: skip
                values += [reasons.get(r, 0.0) for r in _REASONS]
            self._record.pack_into(self._bytes, 8 * (at + 2), *values)
        self._ints[at] = number

    def read(self, number: int) -> tuple[int, Answer | None] | None:
        """The job's side: the status and answer of window ``number``; None where its slot does
        not hold it (not yet, or reused since)."""
        record = self.copy(number)
        return None if record is None else self.decode(record)

    def copy(self, number: int) -> bytes | None:
        """Window ``number``'s record as it is in its slot (a copy: a few hundred bytes, what
        ``decode`` takes); None where its slot does not hold it (not yet, or reused since)."""
        at = (number % SLOTS) * self.words
        ints = self._ints
        if ints[at] != number:
            return None
        record = bytes(self._bytes[8 * (at + 1) : 8 * (at + self.words)])
        if ints[at] != number:  # reused while we read
            return None
        return record

    def decode(self, record: bytes) -> tuple[int, Answer | None]:
        """A record's status and answer (no shared memory read: after ``close`` too)."""
        status = int.from_bytes(record[:8], "little", signed=True)
        if status != _OK:
            return status, None
        values = self._record.unpack_from(record, 8)
        per = [values[g * _PER_GPU : (g + 1) * _PER_GPU] for g in range(self.gpus)]
        answer = Answer(
            energy_j=[v[0] for v in per], covered_s=[v[1] for v in per],
            peak_w=[v[2] for v in per], p99_w=[v[3] for v in per],
            memory_mib=[v[4] for v in per],
            throttled_s=[{r: s for r, s in zip(_REASONS, v[6:], strict=True) if s}
                         for v in per],
            counter_j=[None if math.isnan(v[5]) else v[5] for v in per],
        )  # fmt: skip
        return _OK, answer

    def close(self) -> None:
        self._ints.release()
        self._bytes.release()
        self.table.close()


class Reducer:
    """The job's side: asks windows of the process, and reads its answers."""

    def __init__(self, parts: Parts, rows: Sequence[int], rings: dict[str, Ring]) -> None:
        """Starts the process (``wait_ready`` waits until it has mapped the rings)."""
        self._slots: _Slots | None = _Slots.create(len(rows))
        self._decoder = self._slots  # decodes kept records after close() too
        ctx = multiprocessing.get_context("spawn")
        theirs, ours = ctx.Pipe(duplex=False)  # requests: we write, they read
        woken, wakes = ctx.Pipe(duplex=False)  # a byte per answer: they write, we read
        names = {group: ring.name for group, ring in rings.items()}
        process = ctx.Process(
            target=_serve,
            args=(theirs, wakes, parts, list(rows), names, self._slots.name, os.getpid()),
            name="hfsampler-reducer",
            daemon=True,
        )
        try:
            spawning.start(process)
        except BaseException:
            for conn in (ours, woken, theirs):
                conn.close()
            self._slots.close()
            raise
        finally:
            wakes.close()  # the process holds its own copy
        self._process = process
        # the requests' read end stays open here too: a write to a pipe nobody reads (the
        # process killed) would raise SIGPIPE, which kills a job that set it back to its
        # default (as scripts piped into `head` do); the dead process is found by its exit
        self._requests, self._woken, self._unread = ours, woken, theirs
        self._request_fd, self._woken_fd = ours.fileno(), woken.fileno()
        os.set_blocking(self._woken_fd, False)
        # a process kept from running (stopped, starved) must not stop the job: a full pipe
        # (2,048 windows behind) refuses the request, and the job reduces that window itself
        os.set_blocking(self._request_fd, False)
        self._send = threading.Lock()
        self._numbers = itertools.count(1)  # 0 is an empty slot's
        # windows not read yet; one nobody holds any more is let go
        self._waiting: weakref.WeakValueDictionary[int, Pending] = weakref.WeakValueDictionary()
        self._gone = self._closing = self._told_stop = False
        self._said_gone = self._said_late = False
        # it let a window wait out its patience and has answered none since: the windows read
        # meanwhile do not wait for it again, each its whole patience
        self._late = False

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Wait until the process has mapped the rings; a ``ReducerGone`` if it could not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._process.is_alive():
            if select.select([self._woken_fd], [], [], 0.05)[0] and _drain(self._woken_fd):
                return
        self.close()
        raise ReducerGone(f"the Monitor's reducer process did not start ({self._why()})")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def gone(self) -> bool:
        return self._gone

    def ask(self, t0_ns: int, t1_ns: int, stop: int | None) -> Pending | None:
        """Ask for the numbers of ``[t0_ns, t1_ns)`` (``stop``: the rings' head when it ended,
        or None: the rows read until ``t1_ns``); ``wait`` reads them. A few dozen bytecodes and
        one write: what ``end_window`` spends here, unless the pipe is full (the process 2,048
        windows behind: windows ended faster than it reduces them), which waits for room.
        None: no room came for ``_PATIENCE_S`` (it is stopped, or starved of CPU; said once),
        or none since: the job reduces the window itself, as right, until it answers again."""
        number = next(self._numbers)
        # this window's slot holds the answer of the one asked SLOTS windows ago until the
        # process answers this one: a Measurement still held unread keeps it now (read after
        # close(), or after the rings moved on, it is then still whole)
        kept = self._waiting.get(number - SLOTS)
        if kept is not None:
            self._keep(kept)
        pending = Pending(number, t0_ns, t1_ns, stop)
        self._waiting[number] = pending
        request = _REQUEST.pack(number, t0_ns, t1_ns, _UNTIL_T1 if stop is None else stop)
        try:  # a full pipe waits for room once; while it is late, the job reduces them
            if not self._send_whole(request, 0.0 if self._late else _PATIENCE_S):
                self._waiting.pop(number, None)
                if not self._late:
                    self._late = True
                    self._say_late(f"has taken no window for {_PATIENCE_S:g} s")
                return None
        except OSError:  # the process is gone: ``wait`` reduces it here
            self._gone = True
        return pending

    def wait(
        self, pending: Pending, here: Callable[[Pending], Reply], patience_s: float = _PATIENCE_S
    ) -> Reply:
        """The window's answer, read from its slot (waited for); reduced by ``here`` (in the
        job's process) where the rings no longer held it or the process failed at it (``here``
        then says which), where its slot was reused before it was read, where the process ended
        without answering it, or has not answered for ``patience_s`` (at most ``_PATIENCE_S``;
        less where the rings would let go of the window's rows sooner: it is stopped, or
        starved of CPU), the last two said once. Once one window waited out its patience, the
        next ones read do not wait, until the process answers one again."""
        began = time.monotonic()
        checked = began - _CHECK_S  # an answer not there yet: is the process still there?
        deadline = began + (0.0 if self._late else min(patience_s, _PATIENCE_S))
        while not pending.read:
            slots = self._slots
            try:
                kept = pending.kept  # copied out of the table: before its reuse, or close()
                if kept is not None:
                    got: tuple[int, Answer | None] | None = self._decoder.decode(kept)
                    reused = False
                else:
                    got = None if slots is None else slots.read(pending.number)
                    reused = slots is None or slots.number_at(pending.number) > pending.number
            except ValueError:  # close() let go of the table just now: it copied it out
                continue
            if got is not None:
                self._late = False
                status, answer = got
                if status == _OK:
                    return self._settle(pending, answer)
                break
            if reused or self._gone:
                break
            now = time.monotonic()
            if now >= deadline:
                self._late = True
                soon = ", its samples about to leave the rings" if patience_s < _PATIENCE_S else ""
                self._say_late(f"has not answered a window in {now - began:.1f} s{soon}")
                break
            if now - checked >= _CHECK_S:
                checked = now
                if not self._process.is_alive():
                    self._gone = True
                    continue
            if select.select([self._woken_fd], [], [], _WAKE_S)[0]:
                _drain(self._woken_fd)
        if pending.read:  # copied out by close() meanwhile
            return pending.reply
        if self._gone:
            self.say_gone()
        return self._settle(pending, here(pending))

    def _keep(self, pending: Pending) -> None:
        """Copy a window's record out of its slot into its ``Pending`` (bytes: decoded when
        read), where the process has written it; where it has not yet, the window is reduced in
        the job's process when read, if the rings still hold it."""
        slots = self._slots
        kept = None if slots is None else slots.copy(pending.number)
        if kept is not None:
            pending.kept = kept
            self._waiting.pop(pending.number, None)

    def _settle(self, pending: Pending, reply: Reply) -> Reply:
        pending.reply, pending.read = reply, True
        self._waiting.pop(pending.number, None)
        return reply

    def say_gone(self) -> None:
        """Warn, once, that the process ended and windows are reduced in the job's process."""
        if self._said_gone or self._closing:
            return
        self._said_gone = True
        warnings.warn(
            f"the Monitor's reducer process ended ({self._why()}): windows are reduced in this "
            "process from now on",
            RuntimeWarning,
            stacklevel=_job_stacklevel(),
        )

    def _say_late(self, what: str) -> None:
        """Warn, once, that the process is behind and windows are reduced in the job's."""
        if self._said_late:
            return
        self._said_late = True
        warnings.warn(
            f"the Monitor's reducer process (pid {self.pid}) {what} (stopped, or starved of "
            "CPU): windows are reduced in this process until it catches up",
            RuntimeWarning,
            stacklevel=_job_stacklevel(),
        )

    def _why(self) -> str:
        code = self._process.exitcode
        if code is None:
            return "it did not answer"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Tell the process to stop once it has answered every window asked before (it maps
        the rings on its own: their owner may free them meanwhile); whether it was told (a
        full pipe waits for room up to ``timeout_s``: a stopped process never makes any)."""
        if self._closing:
            return self._told_stop
        self._closing = True
        with contextlib.suppress(OSError):
            self._told_stop = self._send_whole(_STOP, timeout_s)
        return self._told_stop

    def _send_whole(self, message: bytes, room_s: float) -> bool:
        """Write one message, whole (a pipe takes 32 bytes at once); where the pipe is full,
        wait up to ``room_s`` for the process to take some. False: no room came."""
        deadline = None  # taken only once the pipe is found full: not on end_window's path
        with self._send:
            while True:
                try:
                    os.write(self._request_fd, message)
                    return True
                except BlockingIOError:
                    if deadline is None:
                        deadline = time.monotonic() + room_s
                    left_s = deadline - time.monotonic()
                    if left_s <= 0 or not self._process.is_alive():
                        return False
                    select.select([], [self._request_fd], [], min(left_s, _CHECK_S))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the process, wait until it has (killed where it could not be told), copy out
        the answers not yet read and free the table; safe twice."""
        told = self.stop(timeout_s)
        self._process.join(timeout_s if told else 0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._gone = True
        slots = self._slots
        if slots is None:
            return
        for pending in list(self._waiting.values()):  # after the last answer: all are there
            self._keep(pending)
        self._slots = None
        slots.close()
        self._requests.close()
        self._woken.close()
        self._unread.close()


def _job_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for the method that calls this, that names the job's own
    line: how a Measurement is read (an item, ``total_energy``, ``.values()``) changes how many
    frames are hfsampler's."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame = frame.f_back
        level += 1
    return level


def _drain(fd: int) -> bool:
    """Read what wake-up bytes there are; whether there were any."""
    try:
        return bool(os.read(fd, 65536))
    except BlockingIOError:
        return False


def _serve(
    requests: Connection,
    wakes: Connection,
    parts: Parts,
    rows: list[int],
    names: dict[str, str],
    table: str,
    parent_pid: int,
) -> None:
    """The process: map the rings and the table, then answer each request in turn until told
    to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the job's to handle; close() stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        return
    wake_fd = wakes.fileno()
    # never wait for the job to read its wake-ups: a full pipe only means it is awake already
    fcntl.fcntl(wake_fd, fcntl.F_SETFL, fcntl.fcntl(wake_fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    rings = {group: Ring.attach(name) for group, name in names.items()}
    slots = _Slots(SharedInts.attach(table), len(rows))
    incoming = os.fdopen(os.dup(requests.fileno()), "rb")  # buffered: whole requests
    try:
        reader = SpanReader(parts, rows, rings)
        _wake(wake_fd)  # ready
        while len(request := incoming.read(_REQUEST.size)) == _REQUEST.size:
            number, t0_ns, t1_ns, stop = _REQUEST.unpack(request)
            if number < 0:  # stop
                return
            try:
                until = None if stop == _UNTIL_T1 else stop
                answer = reader.answer(t0_ns, t1_ns, until)
                slots.write(number, _LOST if answer is None else _OK, answer)
            except Exception:  # the job reduces it itself, and says why where it reads it
                slots.write(number, _FAILED, None)
            _wake(wake_fd)
    finally:
        incoming.close()
        slots.close()
        for ring in rings.values():
            ring.close()
        requests.close()
        wakes.close()


def _wake(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, BrokenPipeError):
        os.write(fd, b"!")

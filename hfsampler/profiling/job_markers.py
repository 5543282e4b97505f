"""The recorder's side of markers: the socket ``hfsampler.markers`` sends to, and output matching.

``MarkerSocket`` is a Unix datagram socket in a private directory (mode 0700) that ``record``
names to its child in ``HFSAMPLER_MARKER_SOCKET``. Once told the job's pid (``watch``), it takes
a datagram only from the job's process tree, and only with the pid the kernel says sent it
(``SCM_CREDENTIALS``); a sender already gone from /proc (a forked child, reaped) is judged by the
parent its version-3 datagram names; a count of drops larger than the job could have made is
refused too.
A thread of its own reads it as datagrams arrive (Linux queues only
``net.unix.max_dgram_qlen`` datagrams, 10 by default, so a reader that looked between ticks
would lose bursts) and checks each against the wire format, version 1 (an event) or 2 (a batch;
see ``hfsampler.markers``): anything else is counted, logged once (escaped) and dropped.
``drain`` hands over what was read, never waiting. ``OutputTap`` copies
the child's stdout and stderr to ours unchanged, chunk by chunk as they arrive, and turns lines
matched by a ``--mark-pattern`` into markers (``pattern_marker`` says which kind), named by the
rule the API's names follow (``markers.clean_name``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from hfsampler.errors import ConfigError
from hfsampler.markers import (
    BACKLOG_EVENTS,
    BATCH_EVENT_KEYS,
    BATCH_KEYS,
    BATCH_WIRE_VERSION,
    EVENT_KEYS,
    MAX_BATCH_EVENTS,
    MAX_DATAGRAM_BYTES,
    MAX_NAME_CHARS,
    PARENT_BATCH_KEYS,
    PARENT_WIRE_VERSION,
    STEP_LIMIT,
    WIRE_VERSION,
    clean_name,
)
from hfsampler.profiling.recording_format import MARKER_KINDS, Marker

log = logging.getLogger(__name__)

# a socket's path must fit sockaddr_un.sun_path (108 bytes on Linux, with its NUL)
_MAX_SOCKET_PATH = 107
_RECEIVE_BUFFER_BYTES = 4 << 20
_POLL_CLOSED_S = 0.1  # how often the reading thread looks whether the socket is closing
# how far a marker's own time may lie from its arrival: a datagram waits in the buffer for
# seconds at most; a clock this far off is not the job's
_PAST_S, _FUTURE_S = 600.0, 5.0
# a process cannot make more marker calls than this a second (each is a Python call and a JSON
# encoding, ~1 us at the very least): a count of drops beyond it since the socket opened is forged
_MAX_CALLS_PER_S = 10_000_000
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid (SCM_CREDENTIALS)
_MAX_TREE_DEPTH = 64  # parents walked up from a sender to find the job
# longer lines are matched on their first part only, so a line without an end cannot grow memory
MAX_LINE_BYTES = 64 * 1024
_LINE_END = re.compile(rb"[\r\n]")  # a progress bar (tqdm) redraws its line with \r
_READ_BYTES = 64 * 1024


class BadDatagram(ValueError):
    """A datagram, or an event in one, that is not a marker event; the message says why."""


@dataclass(frozen=True, slots=True)
class Datagram:
    """What one datagram carried: its good events as markers, the sender's pid, its parent's
    (version 3; else None) and its count of events dropped so far, and why each bad event of a
    batch was refused."""

    markers: list[Marker]
    pid: int
    parent: int | None
    dropped: int
    refused: list[str]


def parse_datagram(data: bytes, now_ns: int) -> Datagram:
    """A version-1 event or a version-2 or -3 batch (``hfsampler.markers``), or ``BadDatagram``
    saying what is wrong with it; a batch's bad events are refused one by one."""
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadDatagram(f"not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise BadDatagram("not a JSON object")
    version = message.get("v")
    keys = EVENT_KEYS if version == WIRE_VERSION else None
    keys = BATCH_KEYS if version == BATCH_WIRE_VERSION else keys
    keys = PARENT_BATCH_KEYS if version == PARENT_WIRE_VERSION else keys
    if keys is None or not _is_int(version):  # not `true`, which equals 1
        raise BadDatagram(f"wire version {version!r}; this recorder reads "
                          f"{WIRE_VERSION} to {PARENT_WIRE_VERSION}")  # fmt: skip
    if set(message) != keys:
        raise BadDatagram(f"keys {sorted(message)}, expected {sorted(keys)}")
    pid, dropped = message["pid"], message["dropped"]
    if not (_is_int(pid) and pid > 0):
        raise BadDatagram(f"pid {pid!r} is not a process id")
    if not (_is_int(dropped) and dropped >= 0):
        raise BadDatagram(f"dropped {dropped!r} is not a count")
    parent: Any = message.get("ppid")
    if version == PARENT_WIRE_VERSION and not (_is_int(parent) and parent >= 0):
        raise BadDatagram(f"ppid {parent!r} is not a process id")
    if version == WIRE_VERSION:
        return Datagram([_marker(message, pid, now_ns)], pid, None, dropped, [])
    events = message["events"]
    if not isinstance(events, list) or len(events) > MAX_BATCH_EVENTS:
        raise BadDatagram(f"events must be a list of at most {MAX_BATCH_EVENTS}")
    found, refused = [], []
    for event in events:
        try:
            if not isinstance(event, dict) or set(event) != BATCH_EVENT_KEYS:
                raise BadDatagram(f"an event must be an object with {sorted(BATCH_EVENT_KEYS)}")
            found.append(_marker(event, pid, now_ns))
        except BadDatagram as exc:
            refused.append(str(exc))
    return Datagram(found, pid, parent, dropped, refused)


def _marker(event: dict[str, Any], pid: int, now_ns: int) -> Marker:
    t_ns, kind, name, step = (event[k] for k in ("t_ns", "kind", "name", "step"))
    if not _is_int(t_ns) or not now_ns - _PAST_S * 1e9 <= t_ns <= now_ns + _FUTURE_S * 1e9:
        raise BadDatagram(f"t_ns {t_ns!r} is not a time near now ({now_ns})")
    if kind not in MARKER_KINDS:
        raise BadDatagram(f"kind {kind!r} is not one of {', '.join(MARKER_KINDS)}")
    if not isinstance(name, str) or not name or clean_name(name) != name:
        raise BadDatagram(f"name must be 1-{MAX_NAME_CHARS} printable characters")
    if kind == "step" and not (_is_int(step) and 0 <= step < STEP_LIMIT):
        raise BadDatagram(f"a step event needs a step number in [0, 2**63), not {step!r}")
    if kind != "step" and step is not None:
        raise BadDatagram(f"a {kind} event has no step number")
    return Marker(t_ns, kind, name, step, "api", pid)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MarkerSocket:
    """The socket the job's ``hfsampler.markers`` calls send to; read without waiting."""

    def __init__(self) -> None:
        base = None if len(tempfile.gettempdir()) < 60 else "/tmp"  # sun_path limit
        self.directory = Path(tempfile.mkdtemp(prefix="hfsampler-markers-", dir=base))  # 0700
        self.path = self.directory / "sock"
        if len(os.fsencode(self.path)) > _MAX_SOCKET_PATH:
            os.rmdir(self.directory)
            raise OSError(f"socket path {self.path} is too long for a Unix socket")
        self.received = 0
        self.rejected = 0
        self.job_dropped: dict[int, int] = {}  # per sending pid: what it could not send
        self.opened_ns = time.time_ns()
        self._job_pid: int | None = None
        self._in_job: set[int] = set()  # senders found in the job's tree (they may exit later)
        self._found: queue.SimpleQueue[Marker] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(OSError):  # a bigger buffer if the system allows it
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER_BYTES)
            # the kernel then tells each datagram's sender, whatever the datagram claims
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._sock.bind(str(self.path))
            self._sock.settimeout(_POLL_CLOSED_S)
        except OSError:
            self._sock.close()
            os.rmdir(self.directory)
            raise
        self._thread = threading.Thread(target=self._read, daemon=True, name="record-markers")
        self._thread.start()

    def watch(self, job_pid: int) -> None:
        """From now on take datagrams only from ``job_pid`` and the processes below it."""
        self._job_pid = job_pid
        self._in_job.add(job_pid)

    def _receive(self, flags: int = 0) -> tuple[bytes, int | None]:
        """One datagram and the pid the kernel says sent it (None where it does not say)."""
        data, ancillary, _, _ = self._sock.recvmsg(
            MAX_DATAGRAM_BYTES + 1, socket.CMSG_SPACE(_UCRED.size), flags
        )
        for level, kind, value in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                return data, _UCRED.unpack_from(value)[0]
        return data, None

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                data, sender = self._receive()
            except (TimeoutError, InterruptedError):
                continue
            except OSError as exc:  # closed, or something odd: markers are never worth a crash
                log.debug("reading the marker socket: %s", exc)
                return
            self.take(data, time.time_ns(), sender)

    def take(self, data: bytes, now_ns: int, sender: int | None = None) -> None:
        """One datagram (``sender``: the pid the kernel gave): its markers queued for ``drain``,
        garbage and strangers' datagrams counted (the first logged)."""
        try:
            if len(data) > MAX_DATAGRAM_BYTES:
                raise BadDatagram(f"longer than {MAX_DATAGRAM_BYTES} bytes")
            got = parse_datagram(data, now_ns)
            self._check_sender(got, sender, now_ns)
        except BadDatagram as exc:
            self._refuse(1, str(exc), data)
            return
        if got.refused:
            self._refuse(len(got.refused), got.refused[0], data)
        self.received += len(got.markers)
        self.job_dropped[got.pid] = max(self.job_dropped.get(got.pid, 0), got.dropped)
        for marker in got.markers:
            self._found.put(marker)

    def _check_sender(self, got: Datagram, sender: int | None, now_ns: int) -> None:
        most = BACKLOG_EVENTS + (now_ns - self.opened_ns) * _MAX_CALLS_PER_S // 10**9
        if got.dropped > most:
            raise BadDatagram(f"dropped {got.dropped} is more than a process could have made")
        if self._job_pid is None:
            return
        if sender is None or got.pid != sender:
            raise BadDatagram(f"pid {got.pid} is not the sender's ({sender})")
        if self._of_job(sender):
            return
        # a sender gone from /proc cannot be walked up from: its parent, if it named one,
        # vouches for it (a child that sent and exited, reaped before its datagram was read)
        gone = parent_pid(sender) is None
        if not (gone and got.parent and got.parent > 1 and self._of_job(got.parent)):
            raise BadDatagram(f"pid {sender} is not in the job's process tree")

    def _of_job(self, pid: int) -> bool:
        """Whether ``pid`` is the job or below it (its parents walked up in /proc)."""
        seen: list[int] = []
        for _ in range(_MAX_TREE_DEPTH):
            if pid in self._in_job:
                self._in_job.update(seen)
                return True
            seen.append(pid)
            parent = parent_pid(pid)
            if parent is None or parent <= 1:
                return False
            pid = parent
        return False

    def _refuse(self, n: int, why: str, data: bytes) -> None:
        self.rejected += n
        if self.rejected == n:
            log.warning("dropped a datagram or event on the marker socket that is not a "
                        "marker (%s): %s; later ones are counted only",
                        why, ascii(data[:120]))  # fmt: skip

    def drain(self) -> list[Marker]:
        """The markers read since the last call, in arrival order."""
        return _drain(self._found)

    @property
    def dropped_by_job(self) -> int:
        """Events the job's processes said they could not send (a full socket queue)."""
        return sum(self.job_dropped.values())

    def close(self) -> None:
        """Stop reading, close the socket, remove it and its directory; safe to call twice."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join()
        # what the job sent last (its exit's count of drops) may still wait in the queue
        while True:
            try:
                data, sender = self._receive(socket.MSG_DONTWAIT)
            except OSError:
                break
            self.take(data, time.time_ns(), sender)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.directory.rmdir()
        if self.rejected:
            log.warning("%d datagrams on the marker socket were not markers and were dropped",
                        self.rejected)  # fmt: skip


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from /proc, None once it has gone (or where there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _drain(found: queue.SimpleQueue[Marker]) -> list[Marker]:
    out = []
    while True:
        try:
            out.append(found.get_nowait())
        except queue.Empty:
            return out


# -- output matching -----------------------------------------------------------------------------

PATTERN_HELP = (
    "turn lines of the command's stdout/stderr matching REGEX (Python syntax, searched) into "
    "markers; repeatable, the first matching pattern wins. A named group says the kind: "
    "(?P<step>\\d+) a step, (?P<phase>...) a phase named by the group that ends the previous "
    "one (a line naming the phase already open changes nothing), (?P<begin>...) / "
    "(?P<end>...) a phase's edges, else a mark named by (?P<name>...) or the whole match. The "
    "output still reaches the terminal unchanged; its stdout and stderr are then pipes, not a "
    "terminal (no colours or progress bars where a program checks). A background process the "
    "job leaves behind gets SIGPIPE on its next write once record exits."
)


def compile_patterns(texts: Sequence[str]) -> tuple[re.Pattern[str], ...]:
    """``--mark-pattern`` values compiled; a bad one is the user's error (exit 2)."""
    out = []
    for text in texts:
        try:
            pattern = re.compile(text)
        except re.error as exc:
            raise ConfigError("--mark-pattern", f"{text!r} is not a regular expression ({exc})",
                              "e.g. --mark-pattern 'step (?P<step>\\d+)'") from None  # fmt: skip
        if "step" in pattern.groupindex and pattern.groupindex.keys() & {"phase", "begin", "end"}:
            raise ConfigError("--mark-pattern", f"{text!r} has a step group and a phase group",
                              "one kind of marker per pattern")  # fmt: skip
        out.append(pattern)
    return tuple(out)


def pattern_marker(
    match: re.Match[str], t_ns: int, pid: int | None, open_phase: str | None
) -> list[Marker]:
    """The markers one matched line makes (``open_phase``: the phase a ``phase`` group began)."""
    groups = match.groupdict()

    def named(key: str) -> str:  # the API's rule for names (markers.clean_name), never empty
        for text in (groups.get(key) or "", match.group(0), match.re.pattern):
            if name := clean_name(text):
                return name
        return "mark" if key == "name" else key

    if groups.get("step") is not None:
        # 0 <= n < 2**63, as on the socket: the recording stores 64-bit JSON numbers; a bigger
        # one (a sample counter, say) or one int() refuses (over 4300 digits) makes no marker
        number = _step_number(groups["step"])
        return [] if number is None else [Marker(t_ns, "step", "step", number, "output", pid)]
    if groups.get("phase") is not None:
        began = Marker(t_ns, "begin", named("phase"), None, "output", pid)
        if began.name == open_phase:  # the same phase again (a progress bar redrawn): no news
            return []
        if open_phase is None:
            return [began]
        return [Marker(t_ns, "end", open_phase, None, "output", pid), began]
    for kind in ("begin", "end"):
        if groups.get(kind) is not None:
            return [Marker(t_ns, kind, named(kind), None, "output", pid)]
    return [Marker(t_ns, "mark", named("name"), None, "output", pid)]


def _step_number(text: str) -> int | None:
    try:
        number = int(text)
    except ValueError:
        return None
    return number if 0 <= number < STEP_LIMIT else None


class OutputTap:
    """Copies a child's piped stdout and stderr to ours and matches their lines to markers.

    A thread per stream reads what the child wrote as soon as it is there, writes the same bytes
    to our stream, then splits lines (``\\n`` or ``\\r``) for the patterns; so a chatty child
    never fills a pipe and waits on us, and its output keeps its bytes, decoded only to match.
    When what reads our stream has gone (a closed pipe), the thread closes the child's pipe too,
    so the child learns it as it would unpiped (EPIPE, SIGPIPE).
    """

    def __init__(self, patterns: Sequence[re.Pattern[str]], pid: int | None) -> None:
        self.patterns = tuple(patterns)
        self.pid = pid
        self._found: queue.SimpleQueue[Marker] = queue.SimpleQueue()
        self._phase_lock = threading.Lock()
        self._open_phase: str | None = None
        self._threads: list[threading.Thread] = []
        self._said_broken = False

    def attach(self, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        for src, dst in ((stdout, sys.stdout), (stderr, sys.stderr)):
            if src is not None:
                t = threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                                     name="record-output")  # fmt: skip
                t.start()
                self._threads.append(t)

    def _pump(self, src: IO[bytes], dst: Any) -> None:
        out_fd: int | None
        try:
            dst.flush()
            out_fd = dst.fileno()
        except (AttributeError, OSError, ValueError):
            out_fd = None  # no real stream to copy to (a test's capture): match only
        lines = LineSplitter()
        with src:  # leaving closes the pipe's read end: the child's next write gets EPIPE
            while data := _read(src):
                try:
                    out_fd = _copy(out_fd, data)
                except BrokenPipeError:  # `record ... | head`: what reads us has gone
                    if not self._said_broken:
                        self._said_broken = True
                        log.warning("our output's reader has gone (a closed pipe): the job's "
                                    "output pipes are closed too, so it gets EPIPE or SIGPIPE "
                                    "as it would unpiped")  # fmt: skip
                    return
                for line in lines.feed(data):
                    self._match(line)
        for line in lines.end():
            self._match(line)

    def _match(self, line: bytes) -> None:
        if not line:
            return
        text = line.decode("utf-8", "replace")
        for pattern in self.patterns:
            match = pattern.search(text)
            if match is None:
                continue
            with self._phase_lock:
                found = pattern_marker(match, time.time_ns(), self.pid, self._open_phase)
                for m in found:
                    self._found.put(m)
                    if match.groupdict().get("phase") is not None and m.kind == "begin":
                        self._open_phase = m.name
            return

    def drain(self) -> list[Marker]:
        """The markers matched since the last call."""
        return _drain(self._found)

    def finish(self, end_ns: int, wait_s: float = 1.0) -> list[Marker]:
        """After the child's exit: wait (briefly) for the streams' last lines, end an open
        ``phase``, and return what is left. A grandchild that keeps a pipe open is not waited
        for longer than ``wait_s``."""
        deadline = time.monotonic() + wait_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("a process the job left behind still holds its stdout or stderr: its "
                        "output is no longer copied, and once record exits its next write "
                        "there gets SIGPIPE (redirect a background process's output to a file, "
                        "or wait for it in the job)")  # fmt: skip
        out = self.drain()
        with self._phase_lock:
            if self._open_phase is not None:
                out.append(Marker(end_ns, "end", self._open_phase, None, "output", self.pid))
                self._open_phase = None
        return out


class LineSplitter:
    """Bytes as they come to lines (ended by ``\\n`` or ``\\r``), each at most
    ``MAX_LINE_BYTES`` (a longer one is cut, the rest of it skipped); one split per chunk, so
    a chunk of many short lines costs its length, not lines x length."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []  # the start of an unfinished line
        self._pending_bytes = 0
        self._skipping = False  # past MAX_LINE_BYTES of the unfinished line: matched already

    def feed(self, data: bytes) -> list[bytes]:
        parts = _LINE_END.split(data)
        out: list[bytes] = []
        if len(parts) > 1:
            self._pending.append(parts[0])
            first = b"".join(self._pending)
            if not self._skipping:
                out.append(first[:MAX_LINE_BYTES])
            out.extend(p[:MAX_LINE_BYTES] for p in parts[1:-1])
            self._pending, self._pending_bytes, self._skipping = [], 0, False
        tail = parts[-1]
        if self._skipping or not tail:
            return [line for line in out if line]
        self._pending.append(tail)
        self._pending_bytes += len(tail)
        if self._pending_bytes > MAX_LINE_BYTES:
            out.append(b"".join(self._pending)[:MAX_LINE_BYTES])
            self._pending, self._pending_bytes, self._skipping = [], 0, True
        return [line for line in out if line]

    def end(self) -> list[bytes]:
        """The last line, when the stream ended without a line end."""
        line = b"".join(self._pending)
        self._pending, self._pending_bytes = [], 0
        return [line] if line and not self._skipping else []


def _read(src: IO[bytes]) -> bytes:
    try:
        return os.read(src.fileno(), _READ_BYTES)
    except OSError:
        return b""


def _copy(fd: int | None, data: bytes) -> int | None:
    """Write all of ``data`` to ``fd``; a closed terminal stops the copying, not the reading (a
    pipe whose reader has gone raises ``BrokenPipeError``: the caller stops reading too)."""
    if fd is None:
        return None
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        raise
    except OSError:
        return None
    return fd

"""The recorder's side of markers: the socket ``hfsampler.markers`` sends to, and output matching.

``MarkerSocket`` is a Unix datagram socket in a private directory (mode 0700) that ``record``
names to its child in ``HFSAMPLER_MARKER_SOCKET``. A thread of its own reads it as datagrams
arrive (Linux queues only ``net.unix.max_dgram_qlen`` datagrams, 10 by default, so a reader that
looked between ticks would lose bursts) and checks each against the wire format
(``hfsampler.markers``): anything else is counted, logged once (escaped) and dropped. ``drain``
hands over what was read, never waiting. ``OutputTap`` copies the child's stdout and
stderr to ours unchanged, chunk by chunk as they arrive, and turns lines matched by a
``--mark-pattern`` into markers (``pattern_marker`` says which kind).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from hfsampler.errors import ConfigError
from hfsampler.markers import EVENT_KEYS, MAX_DATAGRAM_BYTES, MAX_NAME_CHARS, WIRE_VERSION
from hfsampler.recording import MARKER_KINDS, Marker

log = logging.getLogger(__name__)

# a socket's path must fit sockaddr_un.sun_path (108 bytes on Linux, with its NUL)
_MAX_SOCKET_PATH = 107
_RECEIVE_BUFFER_BYTES = 4 << 20
_POLL_CLOSED_S = 0.1  # how often the reading thread looks whether the socket is closing
# how far a marker's own time may lie from its arrival: a datagram waits in the buffer for
# seconds at most; a clock this far off is not the job's
_PAST_S, _FUTURE_S = 600.0, 5.0
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# longer lines are matched on their first part only, so a line without an end cannot grow memory
MAX_LINE_BYTES = 64 * 1024
_LINE_END = re.compile(rb"[\r\n]")  # a progress bar (tqdm) redraws its line with \r
_READ_BYTES = 64 * 1024


class BadDatagram(ValueError):
    """A datagram that is not a version-1 marker event; the message says why."""


def parse_event(data: bytes, now_ns: int) -> tuple[Marker, int]:
    """The marker a datagram carries and the sender's count of events it dropped so far, or
    ``BadDatagram`` saying what is wrong with it."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadDatagram(f"not JSON ({exc})") from None
    if not isinstance(event, dict):
        raise BadDatagram("not a JSON object")
    if event.get("v") != WIRE_VERSION:
        raise BadDatagram(f"wire version {event.get('v')!r}; this recorder reads {WIRE_VERSION}")
    if set(event) != EVENT_KEYS:
        raise BadDatagram(f"keys {sorted(event)}, expected {sorted(EVENT_KEYS)}")
    t_ns, kind, name, step, pid, dropped = (
        event[k] for k in ("t_ns", "kind", "name", "step", "pid", "dropped")
    )
    if not _is_int(t_ns) or not now_ns - _PAST_S * 1e9 <= t_ns <= now_ns + _FUTURE_S * 1e9:
        raise BadDatagram(f"t_ns {t_ns!r} is not a time near now ({now_ns})")
    if kind not in MARKER_KINDS:
        raise BadDatagram(f"kind {kind!r} is not one of {', '.join(MARKER_KINDS)}")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or _CONTROL.search(name):
        raise BadDatagram(f"name must be 1-{MAX_NAME_CHARS} printable characters")
    if kind == "step" and not (_is_int(step) and step >= 0):
        raise BadDatagram(f"a step event needs a step number >= 0, not {step!r}")
    if kind != "step" and step is not None:
        raise BadDatagram(f"a {kind} event has no step number")
    if not (_is_int(pid) and pid > 0):
        raise BadDatagram(f"pid {pid!r} is not a process id")
    if not (_is_int(dropped) and dropped >= 0):
        raise BadDatagram(f"dropped {dropped!r} is not a count")
    return Marker(t_ns, kind, name, step, "api", pid), dropped


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
        self._found: queue.SimpleQueue[Marker] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(OSError):  # a bigger buffer if the system allows it
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER_BYTES)
            self._sock.bind(str(self.path))
            self._sock.settimeout(_POLL_CLOSED_S)
        except OSError:
            self._sock.close()
            os.rmdir(self.directory)
            raise
        self._thread = threading.Thread(target=self._read, daemon=True, name="record-markers")
        self._thread.start()

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES + 1)
            except (TimeoutError, InterruptedError):
                continue
            except OSError as exc:  # closed, or something odd: markers are never worth a crash
                log.debug("reading the marker socket: %s", exc)
                return
            self.take(data, time.time_ns())

    def take(self, data: bytes, now_ns: int) -> None:
        """One datagram: a marker queued for ``drain``, or garbage counted (logged once)."""
        try:
            if len(data) > MAX_DATAGRAM_BYTES:
                raise BadDatagram(f"longer than {MAX_DATAGRAM_BYTES} bytes")
            marker, dropped = parse_event(data, now_ns)
        except BadDatagram as exc:
            self.rejected += 1
            if self.rejected == 1:
                log.warning("dropped a datagram on the marker socket that is not a marker (%s): "
                            "%s; later ones are counted only", exc, ascii(data[:120]))  # fmt: skip
            return
        self.received += 1
        pid = marker.pid or 0
        self.job_dropped[pid] = max(self.job_dropped.get(pid, 0), dropped)
        self._found.put(marker)

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
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.directory.rmdir()
        if self.rejected:
            log.warning("%d datagrams on the marker socket were not markers and were dropped",
                        self.rejected)  # fmt: skip


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
    "output still reaches the terminal unchanged."
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

    def named(key: str) -> str:
        text = (groups.get(key) or "").strip() or match.group(0).strip() or match.re.pattern
        return text[:MAX_NAME_CHARS]

    if groups.get("step") is not None:
        with contextlib.suppress(ValueError):
            return [Marker(t_ns, "step", "step", int(groups["step"]), "output", pid)]
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


class OutputTap:
    """Copies a child's piped stdout and stderr to ours and matches their lines to markers.

    A thread per stream reads what the child wrote as soon as it is there, writes the same bytes
    to our stream, then splits lines (``\\n`` or ``\\r``) for the patterns; so a chatty child
    never fills a pipe and waits on us, and its output keeps its bytes, decoded only to match.
    """

    def __init__(self, patterns: Sequence[re.Pattern[str]], pid: int | None) -> None:
        self.patterns = tuple(patterns)
        self.pid = pid
        self._found: queue.SimpleQueue[Marker] = queue.SimpleQueue()
        self._phase_lock = threading.Lock()
        self._open_phase: str | None = None
        self._threads: list[threading.Thread] = []

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
        pending = b""
        skipping = False  # the rest of a line past MAX_LINE_BYTES
        with src:
            while data := _read(src):
                out_fd = _copy(out_fd, data)
                pending += data
                while (end := _LINE_END.search(pending)) is not None:
                    line, pending = pending[: end.start()], pending[end.end() :]
                    if not skipping:
                        self._match(line)
                    skipping = False
                if len(pending) > MAX_LINE_BYTES:
                    if not skipping:
                        self._match(pending[:MAX_LINE_BYTES])
                    pending, skipping = b"", True
        if pending and not skipping:
            self._match(pending)

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
        out = self.drain()
        with self._phase_lock:
            if self._open_phase is not None:
                out.append(Marker(end_ns, "end", self._open_phase, None, "output", self.pid))
                self._open_phase = None
        return out


def _read(src: IO[bytes]) -> bytes:
    try:
        return os.read(src.fileno(), _READ_BYTES)
    except OSError:
        return b""


def _copy(fd: int | None, data: bytes) -> int | None:
    """Write all of ``data`` to ``fd``; a closed terminal stops the copying, not the reading."""
    if fd is None:
        return None
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        return None
    return fd

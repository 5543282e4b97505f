"""Markers from the job: ``mark``, ``phase`` and ``step``, sent to a running ``hfsampler record``.

Import this from the training script; it needs nothing beyond the standard library::

    from hfsampler import markers

    for epoch in range(3):
        with markers.phase(f"epoch {epoch}"):
            for n, batch in enumerate(loader):
                markers.step(n)
                ...
        markers.mark("checkpoint")

``record`` names a Unix datagram socket in ``HFSAMPLER_MARKER_SOCKET``; without it (the script
runs outside ``record``) every call is a cheap no-op. A call never blocks and never raises: a
missing socket, a recorder that is gone, an invalid argument (a step that is not an integer in
``[0, 2**63)``, a name whose ``str()`` raises) drops the event, counted in ``dropped()``. When
the socket's queue is full (Linux queues 10 datagrams, ``net.unix.max_dgram_qlen``) up to
``BACKLOG_EVENTS`` events wait in this process and go with the next call's datagram, several in
one; beyond that they are dropped. A call made while another call of this process is sending (a
second thread, or a signal handler that interrupted one) hands its event to that call instead of
waiting for it. Safe across ``fork``: a child opens its own socket and sends its own pid. At
interpreter exit what still waits is sent, with the count of drops the recorder was not yet told,
waiting at most ``EXIT_WAIT_S`` for room (``os._exit``, as in a forked child, skips this).

Wire format: UTF-8 JSON datagrams of two versions; the recorder reads both and drops, counted
and logged once, anything else.

- Version 1, one event: exactly the keys ``v`` (1), ``t_ns`` (``time.time_ns()`` when the call
  was made), ``kind`` (``mark``, ``begin``, ``end`` or ``step``), ``name`` (see ``clean_name``),
  ``step`` (the step number of a ``step`` event, else null), ``pid`` (the sender) and
  ``dropped`` (how many events this process dropped so far, so the recorder can say what it
  missed), e.g. ``{"v":1,"t_ns":1764583200000000000,"kind":"step","name":"step","step":12,
  "pid":4242,"dropped":0}``.
- Version 2, a batch: exactly ``v`` (2), ``pid``, ``dropped`` and ``events``, a list of up to
  ``MAX_BATCH_EVENTS`` objects with exactly ``t_ns``, ``kind``, ``name`` and ``step`` as above
  (possibly none: a last count of drops). Sent when events waited; a single event goes as
  version 1, so a recorder that reads only version 1 still gets the common case.
- Version 3, a batch with the sender's parent: version 2's keys and ``ppid``
  (``os.getppid()`` when it was sent). The recorder takes a datagram only from the job's process
  tree, which it finds by walking up /proc from the sender; a forked child that sends and exits
  is often reaped before its datagram is read, and only its parent, named here, can vouch for
  it. Sent, for every datagram, only when the recorder says it reads it (``WIRE_ENV``), so an
  older recorder still gets versions 1 and 2.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import operator
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

ENV = "HFSAMPLER_MARKER_SOCKET"
WIRE_VERSION = 1  # one event per datagram
BATCH_WIRE_VERSION = 2  # several events per datagram
PARENT_WIRE_VERSION = 3  # several events and the sender's parent
# the newest wire version the recorder reads, set by ``record`` beside ``ENV``
WIRE_ENV = "HFSAMPLER_MARKER_WIRE"
MAX_NAME_CHARS = 256
STEP_LIMIT = 1 << 63  # step numbers are 0 <= n < 2**63: a recording stores them as 64-bit JSON
# the largest datagram the recorder reads: a batch of short events, or a few with long names
MAX_DATAGRAM_BYTES = 32 * 1024
MAX_BATCH_EVENTS = 1024
BACKLOG_EVENTS = 4096  # events kept, per process, while the socket's queue is full
EXIT_WAIT_S = 0.5
# the recorder takes events up to 10 minutes old; one that waited longer is dropped here
_STALE_NS = 300 * 10**9
EVENT_KEYS = frozenset(("v", "t_ns", "kind", "name", "step", "pid", "dropped"))
BATCH_KEYS = frozenset(("v", "pid", "dropped", "events"))
PARENT_BATCH_KEYS = BATCH_KEYS | {"ppid"}
BATCH_EVENT_KEYS = frozenset(("t_ns", "kind", "name", "step"))
# terminal escape sequences (colours, titles): removed whole, they are not part of a name
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?")
# C0, DEL, C1, bidirectional overrides and marks, line and paragraph separators, lone surrogates
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)
_PASSES = 4  # a call sends for others at most this often before it returns

__all__ = [
    "ENV", "WIRE_VERSION", "clean_name", "dropped", "edge", "enabled", "flush", "mark", "phase",
    "sent", "step", "waiting",
]  # fmt: skip


def clean_name(text: str) -> str:
    """The one rule for marker names, from the API and from output alike: escape sequences
    removed, other control, bidirectional and separator characters made spaces, the ends
    stripped, at most ``MAX_NAME_CHARS`` characters; empty when nothing printable is left."""
    text = _UNPRINTABLE.sub(" ", _ESCAPES.sub("", text)).strip()
    return text[:MAX_NAME_CHARS].rstrip()


class _Event(NamedTuple):
    t_ns: int
    body: bytes  # the event's JSON object: t_ns, kind, name, step


class _Datagram(NamedTuple):
    first: _Event | None  # the backlog's first event when it was built
    events: int
    dropped: int  # the drop count it tells
    data: bytes


class _Sender:
    """The process's socket to the recorder, opened on first use and again after a fork.

    ``lock`` guards the socket, the backlog and the counts; it is only ever tried, never waited
    for: a call that finds it taken leaves its event in ``handed`` for the holder, which looks
    there again after releasing it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handed: deque[_Event] = deque()  # append and popleft are atomic: no lock needed
        self.loose_drops: list[None] = []  # drops counted without the lock (append is atomic)
        self.backlog: deque[_Event] = deque()
        self.pid = -1
        self.sock: socket.socket | None = None
        self.sent = 0
        self.dropped = 0
        self.reported = 0  # the drop count the recorder has been told
        self._ready: _Datagram | None = None  # built, not yet taken by a full queue

    def after_fork(self) -> None:
        # a lock held by another thread at fork time would stay held in the child forever; the
        # events waiting are the parent's to send
        self.lock = threading.Lock()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.handed, self.loose_drops, self.backlog = deque(), [], deque()
        self.sock, self.pid, self.sent, self.dropped, self.reported = None, -1, 0, 0, 0
        self._ready = None

    def drop(self) -> bool:
        self.loose_drops.append(None)
        return False

    def send(self, kind: str, name: str, step: int | None, t_ns: int | None = None) -> bool:
        """True when the event was sent or waits to go with the next datagram; ``t_ns``: when
        it happened, if not now."""
        address = os.environ.get(ENV)
        if not address:
            return False
        t_ns = time.time_ns() if t_ns is None else t_ns
        body = json.dumps({"t_ns": t_ns, "kind": kind, "name": name, "step": step},
                          ensure_ascii=False, separators=(",", ":")).encode()  # fmt: skip
        event = _Event(t_ns, body)
        if len(self.handed) >= BACKLOG_EVENTS:  # a holder that does not come back (a handler
            return self.drop()  # looping while it interrupted one): bounded all the same
        self.handed.append(event)
        kept = True
        for _ in range(_PASSES):
            if not self.lock.acquire(blocking=False):
                return True  # the holder takes ours: it looks at `handed` after releasing
            try:
                kept = self._pass(address, event) and kept
            finally:
                self.lock.release()
            if not self.handed:
                break
        return kept

    def _pass(self, address: str, mine: _Event | None) -> bool:
        """Under the lock: take what was handed over, send what waits; False if ``mine`` was
        dropped."""
        if n := len(self.loose_drops):
            del self.loose_drops[:n]
            self.dropped += n
        kept = True
        while self.handed:
            event = self.handed.popleft()
            if len(self.backlog) < BACKLOG_EVENTS:
                self.backlog.append(event)
            else:
                self.dropped += 1
                kept = kept and event is not mine
        stale = time.time_ns() - _STALE_NS
        while self.backlog and self.backlog[0].t_ns < stale:
            self.backlog.popleft()
            self.dropped += 1
        while self.backlog or self.dropped > self.reported:
            ready = self._ready
            first = self.backlog[0] if self.backlog else None
            if ready is None or ready.first is not first:
                ready = self._ready = self._datagram(first)
            # while the queue stays full, each call retries the same datagram: built once, not
            # once per call (the drop count in it may lag; the next one tells the rest)
            try:
                self._send(address, ready.data)
            except BlockingIOError:  # the queue is full: they wait for the next call
                return kept
            except OSError:  # no socket, nobody bound to it, name too long: all of it is lost
                self.dropped += len(self.backlog)
                self.reported = self.dropped  # nobody to tell; a new recorder starts afresh
                kept = kept and mine not in self.backlog
                self.backlog.clear()
                self._ready = None
                return kept
            for _ in range(ready.events):
                self.backlog.popleft()
            self.sent += ready.events
            self.reported = max(self.reported, ready.dropped)
            self._ready = None
        return kept

    def _datagram(self, first: _Event | None) -> _Datagram:
        """The next datagram: the backlog's first events, as many as fit."""
        batch: list[_Event] = []
        size = 64
        for event in self.backlog:
            size += len(event.body) + 1
            if len(batch) == MAX_BATCH_EVENTS or (batch and size > MAX_DATAGRAM_BYTES):
                break
            batch.append(event)
        pid, told = os.getpid(), self.dropped
        if _recorder_reads_parents():
            head = (f'{{"v":{PARENT_WIRE_VERSION},"pid":{pid},"ppid":{os.getppid()},'
                    f'"dropped":{told},"events":[')  # fmt: skip
            data = head.encode() + b",".join(e.body for e in batch) + b"]}"
        elif len(batch) == 1:
            tail = f',"pid":{pid},"dropped":{told}}}'.encode()
            data = b'{"v":%d,' % WIRE_VERSION + batch[0].body[1:-1] + tail
        else:
            head = f'{{"v":{BATCH_WIRE_VERSION},"pid":{pid},"dropped":{told},"events":['
            data = head.encode() + b",".join(e.body for e in batch) + b"]}"
        return _Datagram(first, len(batch), told, data)

    def _send(self, address: str, data: bytes) -> None:
        pid = os.getpid()
        if self.sock is None or self.pid != pid:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.sock.setblocking(False)
            self.pid = pid
        self.sock.sendto(data, address)

    def flush(self, wait_s: float = 0.0) -> int:
        """Send what waits (and a drop count not yet told); how many events still wait."""
        address = os.environ.get(ENV)
        if not address:
            return 0
        deadline = time.monotonic() + wait_s
        while True:
            if self.lock.acquire(blocking=False):
                try:
                    self._pass(address, None)
                    left = len(self.backlog) + len(self.handed)
                    untold = self.dropped > self.reported
                finally:
                    self.lock.release()
                if not (left or untold) or time.monotonic() >= deadline:
                    return left
            elif time.monotonic() >= deadline:
                return len(self.backlog) + len(self.handed)
            time.sleep(0.002)

    def at_exit(self) -> None:
        """Send what waits, with the drops not yet told; what still cannot go is dropped."""
        if self.flush(EXIT_WAIT_S) and self.lock.acquire(blocking=False):
            try:
                self.dropped += len(self.backlog) + len(self.handed)
                self.backlog.clear()
                self.handed.clear()
            finally:
                self.lock.release()


def _recorder_reads_parents() -> bool:
    newest = os.environ.get(WIRE_ENV, "")
    return newest.isdecimal() and len(newest) < 10 and int(newest) >= PARENT_WIRE_VERSION


_sender = _Sender()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_sender.after_fork)
atexit.register(_sender.at_exit)


def enabled() -> bool:
    """True when a recorder gave this process a socket (``HFSAMPLER_MARKER_SOCKET`` is set)."""
    return bool(os.environ.get(ENV))


def sent() -> int:
    """Events this process handed to the recorder's socket."""
    return _sender.sent


def dropped() -> int:
    """Events this process dropped: invalid, no recorder, or no room left to keep them."""
    return _sender.dropped + len(_sender.loose_drops)


def waiting() -> int:
    """Events kept to go with the next datagram (the socket's queue was full)."""
    return len(_sender.backlog) + len(_sender.handed)


def flush(wait_s: float = 0.0) -> int:
    """Try to send what waits now, for at most ``wait_s``; returns how many events still wait.
    Called at exit with ``EXIT_WAIT_S``."""
    return _sender.flush(wait_s)


def _name(name: object, kind: str) -> str | None:
    try:
        text = name if isinstance(name, str) else str(name)
    except Exception:  # a __str__ that raises is the caller's bug, never the job's end
        return None
    return clean_name(text) or kind


def mark(name: str) -> bool:
    """An instant event, e.g. ``mark("checkpoint saved")``; True if it was sent or waits."""
    if not enabled():  # outside record: nothing to clean, nothing to count
        return False
    text = _name(name, "mark")
    return _sender.drop() if text is None else _sender.send("mark", text, None)


def step(n: int) -> bool:
    """Step ``n`` starts now (it lasts until the next step or the end of its phase); ``n`` is an
    integer in ``[0, 2**63)``, anything else is dropped and counted."""
    if not enabled():
        return False
    try:
        number = None if isinstance(n, bool) else operator.index(n)
    except Exception:  # a float or a string step: the caller's bug, never the job's end
        number = None
    if number is None or not 0 <= number < STEP_LIMIT:
        return _sender.drop()
    return _sender.send("step", "step", number)


def edge(kind: str, name: str, t_ns: int) -> bool:
    """A phase's ``begin`` or ``end`` at ``t_ns`` (``time.time_ns()``), taken by the caller: the
    Monitor's windows, whose edges are the times it measured between."""
    if not enabled():
        return False
    text = _name(name, "phase")
    if text is None or kind not in ("begin", "end"):
        return _sender.drop()
    return _sender.send(kind, text, None, t_ns)


F = TypeVar("F", bound=Callable[..., Any])


class phase(contextlib.ContextDecorator):  # lower case: it reads as a function, `with phase()`
    """A named stretch of the job: ``with phase("eval"):``, ``@phase("eval")`` on a function or
    an ``async def`` (the phase lasts until its coroutine returns).

    Sends ``begin`` on entry and ``end`` on exit, an exception included. Phases may nest. A
    generator function (plain or async) is refused with ``TypeError`` at decoration: its body
    runs while it is iterated, interleaved with its consumer's, so no one stretch is its phase;
    use ``with phase(...)`` inside it.
    """

    def __init__(self, name: str) -> None:
        self.name = _name(name, "phase")

    def __call__(self, func: F) -> F:
        import inspect  # here: most jobs never decorate, and inspect is a big import

        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"@phase({self.name!r}) on the generator function {func.__qualname__}: its "
                "body runs while it is iterated, so the phase would not say when; use "
                "`with phase(...)` inside it"
            )
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def timed(*args: Any, **kwargs: Any) -> Any:
                with self._recreate_cm():
                    return await func(*args, **kwargs)

            return timed  # type: ignore[return-value]
        return super().__call__(func)

    def __enter__(self) -> phase:
        self._edge("begin")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._edge("end")

    def _edge(self, kind: str) -> None:
        if self.name is None:
            if enabled():
                _sender.drop()
        else:
            _sender.send(kind, self.name, None)

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
runs outside ``record``) every call is a cheap no-op. A call never blocks and never raises for
want of a listener: a missing socket, a recorder that is gone or a full buffer drops the event,
counted in ``dropped()``. Safe from several threads (a datagram is sent whole or not at all) and
across ``fork`` (a child process opens its own socket and sends its own pid).

Wire format, version 1: one datagram per event, a UTF-8 JSON object with exactly the keys
``v`` (1), ``t_ns`` (``time.time_ns()`` when the call was made), ``kind`` (``mark``, ``begin``,
``end`` or ``step``), ``name`` (1 to ``MAX_NAME_CHARS`` printable characters: longer names are
cut, control characters become spaces), ``step`` (the step number of a ``step`` event, else
null), ``pid`` (the sender) and ``dropped`` (how many events this process could not send
before this one, so the recorder can say what it missed), e.g. ``{"v":1,"t_ns":
1764583200000000000,"kind":"step","name":"step","step":12,"pid":4242,"dropped":0}``. The
recorder drops, counted and logged once, anything else.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import re
import socket
import threading
import time
from types import TracebackType

ENV = "HFSAMPLER_MARKER_SOCKET"
WIRE_VERSION = 1
MAX_NAME_CHARS = 256
# the largest datagram the recorder reads: a version-1 event with the longest name fits easily
MAX_DATAGRAM_BYTES = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # the recorder takes printable names only
EVENT_KEYS = frozenset(("v", "t_ns", "kind", "name", "step", "pid", "dropped"))

__all__ = ["ENV", "WIRE_VERSION", "dropped", "enabled", "mark", "phase", "sent", "step"]


class _Sender:
    """The process's socket to the recorder, opened on first use and again after a fork."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = -1
        self.sock: socket.socket | None = None
        self.sent = 0
        self.dropped = 0

    def after_fork(self) -> None:
        # a lock held by another thread at fork time would stay held in the child forever
        self.lock = threading.Lock()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock, self.pid, self.sent, self.dropped = None, -1, 0, 0

    def send(self, kind: str, name: str, step: int | None) -> bool:
        address = os.environ.get(ENV)
        if not address:
            return False
        pid = os.getpid()
        name = _CONTROL.sub(" ", name).strip()[:MAX_NAME_CHARS] or kind
        event = {"v": WIRE_VERSION, "t_ns": time.time_ns(), "kind": kind,
                 "name": name, "step": step, "pid": pid}  # fmt: skip
        with self.lock:
            event["dropped"] = self.dropped
            text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
            data = text.encode("utf-8", "replace")  # a lone surrogate in a name must not raise
            try:
                if self.sock is None or self.pid != pid:
                    self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self.sock.setblocking(False)
                    self.pid = pid
                self.sock.sendto(data, address)
            except OSError:  # no socket, nobody bound to it, its buffer full, name too long
                self.dropped += 1
                return False
            self.sent += 1
            return True


_sender = _Sender()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_sender.after_fork)


def enabled() -> bool:
    """True when a recorder gave this process a socket (``HFSAMPLER_MARKER_SOCKET`` is set)."""
    return bool(os.environ.get(ENV))


def sent() -> int:
    """Events this process handed to the recorder's socket."""
    return _sender.sent


def dropped() -> int:
    """Events this process could not send (a recorder was named but did not take them)."""
    return _sender.dropped


def mark(name: str) -> bool:
    """An instant event, e.g. ``mark("checkpoint saved")``; True if the recorder got it."""
    return _sender.send("mark", str(name), None)


def step(n: int) -> bool:
    """Step ``n`` starts now (it lasts until the next step or the end of its phase)."""
    number = operator.index(n)  # a float or a string step is the caller's bug: TypeError
    return _sender.send("step", "step", number)


class phase(contextlib.ContextDecorator):  # lower case: it reads as a function, `with phase()`
    """A named stretch of the job: ``with phase("eval"):`` or ``@phase("eval")``.

    Sends ``begin`` on entry and ``end`` on exit, an exception included. Phases may nest.
    """

    def __init__(self, name: str) -> None:
        self.name = str(name)

    def __enter__(self) -> phase:
        _sender.send("begin", self.name, None)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _sender.send("end", self.name, None)

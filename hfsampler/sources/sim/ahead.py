"""The sim source's helper thread: computes a reader's next block of rows ahead of need.

The sampler's fast lane reads the sim every millisecond; computing its block of 100 rows there
(4.8 ms at 64 GPUs) made the lane miss ticks that a real GPU would not. The helper computes the
next block while the lane copies rows from the current one.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
THREAD_NAME = "hfsampler-sim-ahead"
_JOIN_S = 1.0  # close waits this long for a block being computed


@dataclass(slots=True)
class Ahead(Generic[T]):
    """One result being computed on the helper: ``result`` is set before ``done`` (None if the
    computation raised: the caller then computes it itself and sees the error)."""

    start_ms: int
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None


_Job = tuple[Callable[[], object], Ahead[object]]


def _work(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """The helper thread: run each job asked for, until told to stop (None)."""
    # Started from a lane that may already run under SCHED_FIFO, and a new thread inherits
    # that: at the fast lane's priority it would hold a core the fast lane waits for.
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    while (job := jobs.get()) is not None:
        compute, ahead = job
        try:
            ahead.result = compute()
        except Exception:  # the caller computes it again on its own thread, and raises there
            ahead.result = None
        finally:
            ahead.done.set()
        del job, compute, ahead  # no reference to the source kept while idle


class Helper:
    """One thread of its owner's, started on the first job and stopped by ``close`` (or when
    the owner is collected)."""

    def __init__(self, owner: object) -> None:
        self._owner = weakref.ref(owner)
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None

    def ask(self, start_ms: int, compute: Callable[[], T]) -> Ahead[T]:
        """Have ``compute`` run on the helper thread; its result, once done, in the answer."""
        jobs = self._jobs
        if jobs is None:
            jobs = self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=_work, args=(jobs,), name=THREAD_NAME, daemon=True
            )
            self._thread.start()
            owner = self._owner()
            if owner is not None:  # an owner never closed still stops it
                weakref.finalize(owner, jobs.put, None)
        ahead: Ahead[T] = Ahead(start_ms)
        jobs.put((compute, ahead))  # type: ignore[arg-type]  # Ahead[T] is filled with a T
        return ahead

    def close(self) -> None:
        """Stop the thread once its current job is done (a later ``ask`` starts another)."""
        thread, jobs = self._thread, self._jobs
        self._thread = self._jobs = None
        if thread is not None and jobs is not None:
            jobs.put(None)
            thread.join(_JOIN_S)

"""The sim source's helper thread: computes a reader's next block of rows ahead of need.

The sampler's fast lane reads the sim every millisecond; computing its block of 100 rows there
(4.8 ms at 64 GPUs) made the lane miss ticks that a real GPU would not. The helper computes the
next block while the lane copies rows from the current one.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
THREAD_NAME = "hfsampler-sim-ahead"
_JOIN_S = 1.0  # close waits this long for a block being computed
_ALIVE_S = 0.01  # how often a wait for a result looks whether its helper is still there


@dataclass(slots=True)
class Ahead(Generic[T]):
    """One result being computed on the helper: ``result`` is set before ``done`` (None if the
    computation raised: the caller then computes it itself and sees the error)."""

    start_ms: int
    thread: threading.Thread  # the helper that computes it
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None


_Job = tuple[Callable[[], object], Ahead[object]]


def _work(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """The helper thread: run each job asked for, until told to stop (None).

    It keeps the scheduling of the lane that started it (a new thread inherits it): its numpy
    work takes the GIL between calls, and at a lower priority than the fast lane's the kernel
    would preempt it while it holds the GIL the fast lane waits for (``sampling.lanes``).
    """
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
        jobs, thread = self._jobs, self._thread
        if jobs is None or thread is None or not thread.is_alive():  # first, or in a forked child
            jobs = self._jobs = queue.SimpleQueue()
            thread = self._thread = threading.Thread(
                target=_work, args=(jobs,), name=THREAD_NAME, daemon=True
            )
            thread.start()
            owner = self._owner()
            if owner is not None:  # an owner never closed still stops it
                weakref.finalize(owner, jobs.put, None)
        ahead: Ahead[T] = Ahead(start_ms, thread)
        jobs.put((compute, ahead))  # type: ignore[arg-type]  # Ahead[T] is filled with a T
        return ahead

    @staticmethod
    def wait(ahead: Ahead[T]) -> T | None:
        """``ahead``'s result once done; None if it never will be: its helper is gone (asked
        before this process was forked from the one that has it) or the computation raised."""
        while not ahead.done.wait(_ALIVE_S):
            if not ahead.thread.is_alive():
                return None
        return ahead.result

    def close(self) -> None:
        """Stop the thread once its current job is done (a later ``ask`` starts another)."""
        thread, jobs = self._thread, self._jobs
        self._thread = self._jobs = None
        if thread is not None and jobs is not None:
            jobs.put(None)
            thread.join(_JOIN_S)

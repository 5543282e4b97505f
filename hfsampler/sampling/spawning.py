"""Starting the sampler process so that it lives and dies with this process, whoever starts it.

Three things in multiprocessing and Linux would otherwise tie it to less, or refuse it:
PR_SET_PDEATHSIG (which the sampler sets, so that a parent killed with SIGKILL takes it along)
fires when the *thread* that started it ends, so a process started from a thread that returns (a
``Monitor`` made in a worker thread, an executor's) would be killed with that thread: such starts
are made from a thread of ours that lasts as long as the process. multiprocessing refuses children
to a daemonic process (a DataLoader or Pool worker), for fear of orphans: the sampler is no orphan
(the death signal, its getppid() check), so the flag is lifted while it starts. And spawn would
have the child import the parent's ``__main__`` again: a training script that made a ``Monitor``
at its top level (no ``if __name__ == "__main__"``) would run again in the sampler process.

A plain ``os.fork`` copies multiprocessing's list of this process's children: the child's exit
hook would signal and join the parent's samplers as its own (an AssertionError at its exit), so
a forked child forgets them.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import queue
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future

# The sampler processes this process started (a forked child forgets them).
_STARTED: weakref.WeakSet[multiprocessing.process.BaseProcess] = weakref.WeakSet()
_Job = tuple[Callable[[], None], "Future[None]"]
_lasting: queue.SimpleQueue[_Job] | None = None  # the lasting thread's jobs; None: not started
_lasting_lock = threading.Lock()


def start(process: multiprocessing.process.BaseProcess) -> None:
    """Start ``process`` (spawn context) to live as long as this process."""

    def launch() -> None:
        with _main_not_inherited(), _children_allowed():
            process.start()

    if threading.current_thread() is threading.main_thread():
        launch()
    else:
        done: Future[None] = Future()
        _lasting_thread().put((launch, done))
        done.result()
    _STARTED.add(process)


def _lasting_thread() -> queue.SimpleQueue[_Job]:
    """The queue of a daemon thread that lives until this process exits (never joined)."""
    global _lasting
    with _lasting_lock:
        if _lasting is None:
            jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name="hfsampler-spawner",
                             daemon=True).start()  # fmt: skip
            _lasting = jobs
        return _lasting


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        job, done = jobs.get()
        try:
            job()
        except BaseException as exc:  # the caller's to raise
            done.set_exception(exc)
        else:
            done.set_result(None)


@contextlib.contextmanager
def _main_not_inherited() -> Iterator[None]:
    """While the process is spawned, a bare ``__main__`` (spawn imports the parent's again)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """While the process is started, this one not daemonic (multiprocessing's private flag)."""
    config: dict[str, object] = getattr(multiprocessing.current_process(), "_config", {})
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is None:
            config.pop("daemon", None)
        else:
            config["daemon"] = daemon


def _forget_in_child() -> None:
    """After ``os.fork``: the parent's samplers are not this child's, nor its lasting thread."""
    global _lasting
    children: set[object] | None = getattr(multiprocessing.process, "_children", None)
    if children is not None:
        children.difference_update(_STARTED)
    _STARTED.clear()
    _lasting = None


os.register_at_fork(after_in_child=_forget_in_child)

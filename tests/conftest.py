"""Shared test settings: async tests run on uvloop (as `run` does), and also on asyncio's own loop
where the loop matters to what they test (``pytest.mark.both_loops``); shared fixtures."""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings
from run_dir import RUN_DIR_VARIABLE
from run_dir import run_dir as shared_run_dir
from xdist.scheduler import LoadScopeScheduling

ROOT = Path(__file__).resolve().parents[1]

# A shared 2-core runner can stall generation for seconds: a property test judges the property,
# never the machine's speed (each test's own settings add to these). Every run tries Hypothesis's
# default hundred examples per property, enough to cover every branch of the encoders and the
# config parser; `pytest --hypothesis-profile=thorough` tries twenty times as many, for a change
# to those parts (it adds some minutes).
_PROPERTY_SETTINGS: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow],
}
settings.register_profile("hfsampler", **_PROPERTY_SETTINGS)
settings.register_profile("thorough", max_examples=2000, **_PROPERTY_SETTINGS)
settings.load_profile("hfsampler")

LOOP_FACTORIES: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.get_closest_marker("both_loops") is not None:
        return LOOP_FACTORIES
    return {"uvloop": LOOP_FACTORIES["uvloop"]}


# The suite runs on several workers (pyproject's addopts), each module on one worker (its
# fixtures start once). The tests that measure the machine's time (tick lateness, deadlines,
# rates: ``pytest.mark.alone``) must not share the CPUs. They form one unit of work, the first one
# handed out, so they run one after another on one worker while every other worker waits at a
# barrier before its first test; then the rest runs in parallel with nothing to wait for. (A
# lock taken around each timing test made it wait for whatever long test was running elsewhere,
# and everyone else wait with it: that cost the suite minutes.) Where the worker may raise its
# own priority (root, as CI runs), it does so instead, to the highest nice, and the others go on
# meanwhile: they get only what CPU the timing tests leave (a nice -20 thread outweighs a nice 0
# one 87 to 1), which was a minute of the 2-core machine's two cores idle.
ALONE_SCOPE = "timing tests, alone"
_ALONE_STARTS_WITHIN_S = 120.0  # the barrier's bound, should the timing unit never start
_ALONE_NICE = -20


def _is_alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


def pytest_configure(config: pytest.Config) -> None:
    # The controller's directory for the workers' barrier (they inherit its environment).
    if "PYTEST_XDIST_WORKER" not in os.environ and RUN_DIR_VARIABLE not in os.environ:
        run_dir = tempfile.mkdtemp(prefix="hfsampler-tests-")
        os.environ[RUN_DIR_VARIABLE] = run_dir
        config.add_cleanup(lambda: shutil.rmtree(run_dir, ignore_errors=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not _is_alone(item))  # stable: alone first
    global _ALONE_IN_SESSION
    _ALONE_IN_SESSION = any(_is_alone(item) for item in items)
    run_dir = shared_run_dir()
    if run_dir is not None and "PYTEST_XDIST_WORKER" in os.environ:
        # For the controller's scheduler, which sees node ids only; every worker writes the same.
        marked = {
            mark: [item.nodeid for item in items if item.get_closest_marker(mark) is not None]
            for mark in ("alone", "long")
        }
        partial = run_dir / f"marked.{os.environ['PYTEST_XDIST_WORKER']}"
        partial.write_text(json.dumps(marked))
        partial.replace(run_dir / "marked.json")


_ALONE_IN_SESSION = False


class _WorkQueue(OrderedDict[str, dict[str, bool]]):
    """xdist's queue of units (biggest first), with the timing unit first and the long ones
    next: a minute-long module handed out last would end the run alone."""

    def __init__(self, long_scopes: set[str]) -> None:
        super().__init__()
        self.long_scopes = long_scopes

    def __setitem__(self, key: str, value: dict[str, bool]) -> None:
        super().__setitem__(key, value)
        if key in self.long_scopes:
            self.move_to_end(key, last=False)
        if ALONE_SCOPE in self:
            self.move_to_end(ALONE_SCOPE, last=False)


class _AloneFirstScheduling(LoadScopeScheduling):
    """xdist's loadscope, with the timing tests gathered into one unit handed out first, and the
    units holding a ``long`` test handed out next."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)
        self._long_scopes: set[str] = set()
        self.workqueue = _WorkQueue(self._long_scopes)
        self._marked: dict[str, set[str]] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._marked is None:
            run_dir = shared_run_dir()
            path = run_dir / "marked.json" if run_dir is not None else None
            found = json.loads(path.read_text()) if path and path.exists() else {}
            self._marked = {mark: set(found.get(mark, ())) for mark in ("alone", "long")}
        if nodeid in self._marked["alone"]:
            return ALONE_SCOPE
        scope: str = super()._split_scope(nodeid)
        if nodeid in self._marked["long"]:
            self._long_scopes.add(scope)
        return scope


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "loadscope":
        return None  # another distribution asked for by name: xdist's own
    return _AloneFirstScheduling(config, log)


_alone_lock: IO[str] | None = None  # held by the worker running the timing unit


def _wait_for_timing_tests(run_dir: Path) -> None:
    started = run_dir / "alone.started"
    since = time.monotonic()
    while not (run_dir / "alone.done").exists():
        if (run_dir / "alone.raised").exists():
            return  # they run before us: nothing to wait for
        if started.exists():
            with (run_dir / "alone.lock").open("a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return  # its worker is gone without saying it was done (a crash)
                except BlockingIOError:
                    pass
        elif time.monotonic() - since > _ALONE_STARTS_WITHIN_S:
            return
        time.sleep(0.05)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    global _alone_lock
    run_dir = shared_run_dir()
    if "PYTEST_XDIST_WORKER" not in os.environ or run_dir is None or not _ALONE_IN_SESSION:
        return (yield)
    if not _is_alone(item):
        _wait_for_timing_tests(run_dir)
        return (yield)
    if _alone_lock is None:
        _alone_lock = (run_dir / "alone.lock").open("a")
        fcntl.flock(_alone_lock, fcntl.LOCK_EX)  # a second worker's timing tests wait
        if _raise_priority():
            (run_dir / "alone.raised").touch()
        (run_dir / "alone.started").touch()
    try:
        return (yield)
    finally:
        if not _is_alone(nextitem):
            os.setpriority(os.PRIO_PROCESS, 0, 0)  # a lower priority is always allowed
            (run_dir / "alone.done").touch()
            fcntl.flock(_alone_lock, fcntl.LOCK_UN)
            _alone_lock.close()
            _alone_lock = None


def _raise_priority() -> bool:
    """This thread (the one running tests, and what it starts) to the highest priority, where
    it may."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, _ALONE_NICE)
    except PermissionError:
        return False
    return True


@pytest.fixture
def sock_dir() -> Generator[Path]:
    """A fresh directory for a test's Unix sockets (a fake kubelet's, a fake container
    runtime's): a socket's path is limited to 108 bytes, which pytest's tmp_path can pass."""
    with tempfile.TemporaryDirectory(prefix="hfs-sock") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """benchmarks/gpu_check.py as a module, so tests run its measurements against the fake NVML."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module

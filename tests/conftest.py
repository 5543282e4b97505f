"""Shared test settings: async tests run on uvloop (as `run` does), and also on asyncio's own loop
where the loop matters to what they test (``pytest.mark.both_loops``); shared fixtures."""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from types import ModuleType

import pytest
import uvloop
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]

# A shared 2-core runner can stall generation for seconds: a property test judges the property,
# never the machine's speed (each test's own settings add to these). Every run tries Hypothesis's
# default hundred examples per property, enough to cover every branch of the encoders and the
# config parser; `pytest --hypothesis-profile=thorough` tries twenty times as many, for a change
# to those parts (it adds some minutes).
_PROPERTY_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
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
# fixtures start once). A test that measures the machine's time (tick lateness, deadlines, rates:
# ``pytest.mark.alone``) must not share the CPUs: such tests are collected first, and each takes
# the lock exclusively while every other test takes it shared. The turnstile gives the exclusive
# side precedence: once an alone test waits, the others finish the test they are in and wait for
# it, instead of starving it to the end of the run (and the rest of its worker's queue with it).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
_LOCK = Path(tempfile.gettempdir()) / f"hfsampler-tests-{_RUN}.lock"
_TURNSTILE = Path(tempfile.gettempdir()) / f"hfsampler-tests-{_RUN}.turnstile"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("alone") is None)  # stable: alone first


def _is_alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    with _TURNSTILE.open("a") as turnstile, _LOCK.open("a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if _is_alone(item):
            fcntl.flock(lock, fcntl.LOCK_EX)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)  # only passing through
            fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if _is_alone(item) and not _is_alone(nextitem):
                fcntl.flock(turnstile, fcntl.LOCK_UN)


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

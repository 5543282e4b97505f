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
# never the machine's speed (each test's own settings add to these).
settings.register_profile("hfsampler", deadline=None, suppress_health_check=[HealthCheck.too_slow])
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


# The suite runs on several workers (pyproject's addopts). A test that measures the machine's time
# (tick lateness, deadlines, rates: ``pytest.mark.alone``) takes this lock exclusively, every
# other test takes it shared: a timing test runs while no other test does.
_LOCK = Path(tempfile.gettempdir()) / (
    "hfsampler-tests-" + os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid())) + ".lock"
)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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

"""Shared test settings: async tests run on uvloop (as `run` does), and also on asyncio's own loop
where the loop matters to what they test (``pytest.mark.both_loops``); shared fixtures."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Mapping
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

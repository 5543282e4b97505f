"""Fixtures that start real Prometheus (2.x and 3.x) and VictoriaMetrics on free loopback ports.

Each receiver runs from Debian's binary (Prometheus 3 from sid, unpacked by
``.ci/fetch-prometheus3``) with a temporary data directory and a log file, is started when a test
first needs it, and is stopped at the end of the session. A missing binary skips the tests that
need it on a workstation but fails them when ``CI`` is set: CI must never pass by skipping its
integration tests.

Fixtures:
- ``prometheus_build`` (module scope, parametrised ``prometheus-2`` / ``prometheus-3``): the
  checked binary of each Prometheus version in turn, for tests that start their own Prometheus.
- ``prometheus`` (module scope, parametrised the same way): that version's shared, started
  ``receivers.Prometheus`` with ``base_url``, ``write_url``, ``query``, ``query_range``,
  ``series``, ``raw_samples``, ``flush``, ``wait_for``, ``log_text`` and ``log_problems``.
- ``prometheus_builds_here`` and ``every_prometheus`` (session): every version that can run
  here, as builds and as the started shared servers, for one hfsampler run that feeds them all.
- ``victoria_metrics`` (session): the shared, started ``receivers.VictoriaMetrics``.
- ``receivers`` (session): all of them by name (``receivers.RECEIVER_NAMES``); asking it for one
  that cannot run here skips (or, under CI, fails) only the test that asks.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import receivers as rx  # the harness module beside this file


def _refuse(message: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {message}", pytrace=False)
    pytest.skip(message)


def _missing_binary(binary: str, how_to_get: str) -> str | None:
    if rx.binary_path(binary) is None:
        return f"{binary} not found (PATH, /usr/bin): {how_to_get}"
    return None


@functools.cache
def _prometheus_problem(name: str) -> str | None:
    """Why ``name``'s binary cannot run its tests here (absent, or another major), or None."""
    build = rx.PROMETHEUS_BUILDS[name]
    missing = _missing_binary(build.binary, build.how_to_get)
    if missing:
        return f"{name}: {missing}"
    path = rx.binary_path(build.binary) or build.binary
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    found = re.search(r"version (\d+)\.", done.stdout + done.stderr)
    if found is None or int(found.group(1)) != build.major:
        first = (done.stdout + done.stderr).strip().split("\n", 1)[0]
        return f"{name}: {path} is not Prometheus {build.major}.x ({first!r}): {build.how_to_get}"
    return None


def _victoria_metrics_problem() -> str | None:
    return _missing_binary(
        rx.VICTORIA_METRICS_BIN,
        "install Debian's victoria-metrics package "
        "(apt-get install --no-install-recommends victoria-metrics)",
    )


class _PrometheusPool:
    """One shared Prometheus per version, started on first use, stopped with the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: dict[str, rx.Prometheus] = {}

    def get(self, build: rx.PrometheusBuild) -> rx.Prometheus:
        if build.name not in self.started:
            prom = rx.start_prometheus(self.root / build.name, name=build.name, binary=build.binary)
            self.started[build.name] = prom
            version = prom.version()
            if not version.startswith(f"{build.major}."):
                raise rx.ReceiverError(f"{build.name} answers buildinfo version {version}")
        return self.started[build.name]

    def stop(self) -> None:
        for prom in self.started.values():
            prom.stop()


class Receivers(dict[str, rx.Receiver]):
    """The started receivers by name; a name that cannot run here skips the test that asks."""

    def __init__(self, started: dict[str, rx.Receiver], unavailable: dict[str, str]) -> None:
        super().__init__(started)
        self.unavailable = unavailable

    def __missing__(self, name: str) -> NoReturn:
        if name in self.unavailable:
            _refuse(self.unavailable[name])
        raise KeyError(name)


@pytest.fixture(scope="session")
def receivers_root() -> Iterator[Path]:
    """A temporary directory holding every receiver's data and log, removed at the end."""
    root = rx.temp_root()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def prometheus_pool(receivers_root: Path) -> Iterator[_PrometheusPool]:
    pool = _PrometheusPool(receivers_root)
    try:
        yield pool
    finally:
        pool.stop()


# Module scope: pytest runs a module's tests for one version, then for the next, so the module's
# own fixtures (a sim run, a recording) are made once per version, and never more often.
@pytest.fixture(scope="module", params=sorted(rx.PROMETHEUS_BUILDS))
def prometheus_build(request: pytest.FixtureRequest) -> rx.PrometheusBuild:
    """Each Prometheus version in turn, its binary checked (missing: skip, or under CI fail)."""
    name: str = request.param
    problem = _prometheus_problem(name)
    if problem:
        _refuse(problem)
    return rx.PROMETHEUS_BUILDS[name]


@pytest.fixture(scope="session")
def prometheus_builds_here() -> dict[str, rx.PrometheusBuild]:
    """Every Prometheus build whose binary can run here, by name; one that cannot is left out
    (its version's tests skip, or under CI fail, through ``prometheus_build``)."""
    return {n: b for n, b in sorted(rx.PROMETHEUS_BUILDS.items()) if not _prometheus_problem(n)}


@pytest.fixture(scope="session")
def every_prometheus(
    prometheus_builds_here: dict[str, rx.PrometheusBuild], prometheus_pool: _PrometheusPool
) -> dict[str, rx.Prometheus]:
    """The shared Prometheus of every version that runs here, started, by build name: for a
    module whose one hfsampler run pushes to all of them at once, while its tests, taking
    ``prometheus``, check each version in turn (one run, not one per version)."""
    return {name: prometheus_pool.get(build) for name, build in prometheus_builds_here.items()}


@pytest.fixture(scope="module")
def prometheus(
    prometheus_build: rx.PrometheusBuild, prometheus_pool: _PrometheusPool
) -> rx.Prometheus:
    """Prometheus 2.x, then 3.x, accepting Remote-Write on ``write_url``, with no scrape jobs."""
    return prometheus_pool.get(prometheus_build)


@pytest.fixture(scope="session")
def victoria_metrics(receivers_root: Path) -> Iterator[rx.VictoriaMetrics]:
    """A single-node VictoriaMetrics accepting Remote-Write on ``write_url``."""
    problem = _victoria_metrics_problem()
    if problem:
        _refuse(problem)
    vm = rx.start_victoria_metrics(receivers_root / "victoria-metrics")
    try:
        yield vm
    finally:
        vm.stop()


@pytest.fixture(scope="session")
def receivers(
    request: pytest.FixtureRequest, prometheus_pool: _PrometheusPool
) -> dict[str, rx.Receiver]:
    """Every receiver in ``receivers.RECEIVER_NAMES`` that can run here, by name, started."""
    started: dict[str, rx.Receiver] = {}
    unavailable: dict[str, str] = {}
    for name in rx.RECEIVER_NAMES:
        if name in rx.PROMETHEUS_BUILDS:
            problem = _prometheus_problem(name)
            if problem is None:
                started[name] = prometheus_pool.get(rx.PROMETHEUS_BUILDS[name])
        elif name == "victoria-metrics":
            problem = _victoria_metrics_problem()
            if problem is None:
                started[name] = request.getfixturevalue("victoria_metrics")
        else:
            raise AssertionError(f"no fixture for receiver {name!r}")
        if problem:
            unavailable[name] = problem  # the tests of the others still run
    return Receivers(started, unavailable)

"""Fixtures that start real Prometheus and VictoriaMetrics on free loopback ports.

Each receiver runs from Debian's binary with a temporary data directory and a log file, and is
stopped at the end of the session. A missing binary skips the tests on a workstation but fails
them when ``CI`` is set: CI must never pass by skipping its integration tests.

Fixtures (session scope):
- ``prometheus`` / ``victoria_metrics``: a started ``receivers.Receiver`` with ``base_url``,
  ``write_url``, ``query``, ``query_range``, ``series``, ``raw_samples``, ``flush``,
  ``wait_for``, ``log_text`` and ``log_problems``.
- ``receivers``: both, as a ``{"prometheus": ..., "victoria-metrics": ...}`` dict.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import receivers as rx  # the harness module beside this file


def _require(binary: str, package: str) -> str:
    path = rx.binary_path(binary)
    if path is None:
        message = (
            f"{binary} not found (PATH, /usr/bin): install Debian's {package} package "
            f"(apt-get install --no-install-recommends {package})"
        )
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {message}", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def receivers_root() -> Iterator[Path]:
    """A temporary directory holding every receiver's data and log, removed at the end."""
    root = rx.temp_root()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def prometheus(receivers_root: Path) -> Iterator[rx.Prometheus]:
    """A Prometheus 2.x accepting Remote-Write on ``write_url``, with no scrape jobs."""
    _require(rx.PROMETHEUS_BIN, "prometheus")
    prom = rx.start_prometheus(receivers_root / "prometheus")
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="session")
def victoria_metrics(receivers_root: Path) -> Iterator[rx.VictoriaMetrics]:
    """A single-node VictoriaMetrics accepting Remote-Write on ``write_url``."""
    _require(rx.VICTORIA_METRICS_BIN, "victoria-metrics")
    vm = rx.start_victoria_metrics(receivers_root / "victoria-metrics")
    try:
        yield vm
    finally:
        vm.stop()


@pytest.fixture(scope="session")
def receivers(
    prometheus: rx.Prometheus, victoria_metrics: rx.VictoriaMetrics
) -> dict[str, rx.Receiver]:
    """Both receivers by name."""
    return {prometheus.name: prometheus, victoria_metrics.name: victoria_metrics}

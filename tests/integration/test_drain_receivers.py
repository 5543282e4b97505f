"""A spooled backlog drained into each real receiver (Prometheus 2 and 3, VictoriaMetrics): its
records go as they were stored, joined into requests in which a series comes once per window,
and every window of both runs is stored once, in order, with nothing refused in the logs."""

from __future__ import annotations

import itertools
import time
import uuid
from pathlib import Path

import pytest
import receivers as rx
import yaml

pytestmark = pytest.mark.integration

SERIES = "DCGM_FI_DEV_POWER_USAGE_max"
WINDOW_S = 0.5


def _args(tmp_path: Path, url: str, run: str, duration: str) -> list[str]:
    """A sim run whose endpoint is named, so that its spool outlives a change of URL."""
    config = {
        "queue_dir": str(tmp_path / "queue"),
        "remote_write": [{"url": url, "name": "drain", "queue_config": {"max_backoff": "1s"}}],
    }
    path = tmp_path / "drain.yml"
    path.write_text(yaml.safe_dump(config))
    args = rx.sim_run_args([], window="500ms", duration=duration, labels={"run": run})
    return [*args, "--config", str(path)]


@pytest.mark.parametrize("name", rx.RECEIVER_NAMES)
def test_a_spooled_backlog_drains_into_the_receiver_whole(
    receivers: dict[str, rx.Receiver], name: str, tmp_path: Path
) -> None:
    receiver = receivers[name]
    run = uuid.uuid4().hex[:12]
    log_at = len(receiver.log_text())
    started = time.time()
    dead = f"http://127.0.0.1:{rx.free_port()}/api/v1/write"
    rx.run_cli(_args(tmp_path, dead, run, "4s"), timeout_s=60).check()  # all spooled
    assert any((tmp_path / "queue").rglob("*.seg"))
    rx.run_cli(_args(tmp_path, receiver.write_url, run, "2s"), timeout_s=60).check()
    ended = time.time()
    selector = f'{SERIES}{{run="{run}"}}'
    receiver.wait_for(f"count_over_time({selector}[1m])", time_s=ended, min_results=2)
    stored = receiver.raw_samples(selector, started - 1, ended + 1)
    assert {dict(k)["gpu"] for k in stored} == {"0", "1"}
    for samples in stored.values():
        stamps = [t for t, _ in samples]
        assert stamps == sorted(set(stamps))  # each window once, in order
        # both runs' windows: about 8 spooled and 4 sent live (a window more or less at the ends)
        assert len(stamps) >= 10, stamps
        gaps = [b - a for a, b in itertools.pairwise(stamps) if b - a != int(WINDOW_S * 1000)]
        assert len(gaps) <= 1, stamps  # one gap only: between the runs
    assert receiver.log_problems(log_at) == []

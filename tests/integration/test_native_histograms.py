"""Native histograms against real receivers (issue 26): Prometheus 2.42 and 3 with
``--enable-feature=native-histograms`` store them, and PromQL's ``histogram_quantile`` over two
GPUs' ``sum(increase(...))`` agrees with the exact quantiles of the known samples within the
schema's error, ``histogram_count`` with their number; the same Prometheus without the flag
refuses them and gets every float series still; VictoriaMetrics 1.79, without
``send_native_histograms``, stores every float series and refuses nothing.

Snapshots are made as the sampling half makes them (tests/support/hist_snapshots.py) and pushed
by ``RemoteWriter`` in this process: 1.0 to both Prometheus versions, 2.0 to Prometheus 3 too.
Per Prometheus version one more Prometheus is started, with the flag (3.5 needs it as 2.42 does:
without it a request with a histogram is answered 500 "native histograms are disabled").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import receivers as rx
from hist_snapshots import HISTOGRAM, POWER, PowerWindows

from hfsampler import selfmetrics as sm
from hfsampler.histograms import quantile_error_bound
from hfsampler.remote_write.config import PROTOBUF_V1, PROTOBUF_V2, EndpointConfig, QueueConfig
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.selfmetrics import SelfMetrics

pytestmark = pytest.mark.integration

WINDOWS = 20
SAMPLES = 1000  # per GPU and window
SCHEMA = 3
QUEUE = QueueConfig(batch_send_deadline_s=0.01, min_backoff_s=0.01, max_backoff_s=0.1)
QUANTILES = (0.5, 0.99, 0.999)


@dataclass
class Pushed:
    """What one module run pushed: per protocol the windows (their exact samples), the last
    timestamp, and the writers' self-metrics per receiver."""

    first_ms: int
    last_ms: int
    windows: dict[str, PowerWindows] = field(default_factory=dict)
    metrics: dict[str, SelfMetrics] = field(default_factory=dict)
    configs: dict[str, EndpointConfig] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)


def _push(targets: list[tuple[str, EndpointConfig, PowerWindows]], first_ms: int) -> Pushed:
    """Push ``WINDOWS`` windows of each target's snapshots, then flush every writer."""
    pushed = Pushed(first_ms, first_ms + (WINDOWS - 1) * 1000)

    async def run() -> None:
        writers = []
        for key, config, windows in targets:
            metrics = pushed.metrics[key] = SelfMetrics()
            pushed.configs[key] = config
            pushed.windows[key] = windows
            writer = RemoteWriter(config, metrics)
            await writer.start()
            writers.append((writer, windows))
        for i in range(WINDOWS):
            for writer, windows in writers:
                writer.push(windows.window(first_ms + i * 1000))
            await asyncio.sleep(0.01)
        for writer, _ in writers:
            await writer.close(30)

    asyncio.run(run())
    return pushed


@pytest.fixture(scope="module")
def flagged(
    prometheus_build: rx.PrometheusBuild, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[rx.Prometheus]:
    """This version's Prometheus with native histograms on."""
    root: Path = tmp_path_factory.mktemp(f"{prometheus_build.name}-nh")
    prom = rx.start_prometheus(
        root,
        name=f"{prometheus_build.name}-native-histograms",
        binary=prometheus_build.binary,
        extra_flags=["--enable-feature=native-histograms"],
    )
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def pushed(
    prometheus_build: rx.PrometheusBuild,
    flagged: rx.Prometheus,
    prometheus: rx.Prometheus,
    victoria_metrics: rx.VictoriaMetrics,
) -> Pushed:
    build = prometheus_build.name
    protocols = {"1.0": PROTOBUF_V1}
    if prometheus_build.major >= 3:
        protocols["2.0"] = PROTOBUF_V2
    targets: list[tuple[str, EndpointConfig, PowerWindows]] = []

    def windows(run: str) -> PowerWindows:
        return PowerWindows(2, SAMPLES, schema=SCHEMA, extra_labels={"run": f"{build}-{run}"})

    for proto, message in protocols.items():
        url, off = flagged.write_url, prometheus.write_url
        on = EndpointConfig(url, f"nh-{proto}", queue=QUEUE, protobuf_message=message,
                            send_native_histograms=True)  # fmt: skip
        targets.append((f"nh-{proto}", on, windows(f"nh-{proto}")))
        refusing = EndpointConfig(off, f"off-{proto}", queue=QUEUE, protobuf_message=message,
                                  send_native_histograms=True)  # fmt: skip
        targets.append((f"off-{proto}", refusing, windows(f"off-{proto}")))
    vm = EndpointConfig(victoria_metrics.write_url, "vm", queue=QUEUE)
    targets.append(("vm", vm, windows("vm")))
    handler = _Lines()
    logger = logging.getLogger("hfsampler.remote_write")
    logger.addHandler(handler)
    try:
        result = _push(targets, int(time.time() * 1000) - (WINDOWS + 5) * 1000)
    finally:
        logger.removeHandler(handler)
    result.refusals = [line for line in handler.lines if "refuses native histograms" in line]
    for receiver in (flagged, prometheus, victoria_metrics):
        receiver.flush()
    return result


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _runs(pushed: Pushed, prefix: str) -> list[str]:
    return [key for key in pushed.windows if key.startswith(prefix)]


def test_histogram_quantile_and_count_agree_with_the_exact_samples(
    pushed: Pushed, flagged: rx.Prometheus
) -> None:
    at_s = pushed.last_ms / 1000
    for key in _runs(pushed, "nh-"):
        windows = pushed.windows[key]
        run = dict(windows.hist_series[0].labels)["run"]
        metrics = pushed.metrics[key]
        assert metrics.total(sm.RW_DROPPED) == 0, key
        selector = f'{HISTOGRAM}{{run="{run}"}}'
        found = flagged.query(f"histogram_count(sum({selector}))", time_s=at_s)
        assert len(found) == 1, (key, found)
        assert float(found[0]["value"][1]) == len(windows.all_samples()), key
        # increase() subtracts the first window's histogram (and extrapolates, which scales
        # every bucket alike and so moves no quantile): the samples of the later windows
        later = windows.all_samples(from_window=1)
        bound = quantile_error_bound(SCHEMA)
        for q in QUANTILES:
            promql = f"histogram_quantile({q}, sum(increase({selector}[{WINDOWS + 10}s])))"
            (answer,) = flagged.query(promql, time_s=at_s)
            got = float(answer["value"][1])
            exact = float(np.quantile(later, q))
            assert abs(got - exact) <= bound * exact, (key, q, got, exact, bound)
        assert not flagged.log_problems(), flagged.log_problems()[:5]


def test_a_prometheus_without_the_flag_refuses_them_and_keeps_every_float(
    pushed: Pushed, prometheus: rx.Prometheus
) -> None:
    start_s, end_s = pushed.first_ms / 1000 - 1, pushed.last_ms / 1000 + 1
    for key in _runs(pushed, "off-"):
        windows = pushed.windows[key]
        run = dict(windows.floats[0].labels)["run"]
        metrics, config = pushed.metrics[key], pushed.configs[key]
        labels = {"remote_name": config.remote_name, "url": config.display_url}
        refused = metrics.get(sm.RW_DROPPED, {**labels, "reason": "histograms_refused"})
        assert refused == 2 * WINDOWS, key
        assert metrics.total(sm.RW_DROPPED) == refused, key  # nothing else lost
        stored = prometheus.raw_samples(f'{POWER}{{run="{run}"}}', start_s, end_s)
        assert sorted(len(v) for v in stored.values()) == [WINDOWS, WINDOWS], key
    assert len(pushed.refusals) == len(_runs(pushed, "off-"))  # once per endpoint
    assert all("native histograms are disabled" in line for line in pushed.refusals)


def test_victoria_metrics_without_send_native_histograms_stores_every_float(
    pushed: Pushed, victoria_metrics: rx.VictoriaMetrics
) -> None:
    run = dict(pushed.windows["vm"].floats[0].labels)["run"]
    start_s, end_s = pushed.first_ms / 1000 - 1, pushed.last_ms / 1000 + 1
    stored = victoria_metrics.raw_samples(f'{{run="{run}"}}', start_s, end_s)
    assert {dict(k)["__name__"] for k in stored} == {POWER}
    assert sorted(len(v) for v in stored.values()) == [WINDOWS, WINDOWS]
    assert pushed.metrics["vm"].total(sm.RW_DROPPED) == 0
    assert pushed.metrics["vm"].total(sm.RW_SAMPLES) == 2 * WINDOWS

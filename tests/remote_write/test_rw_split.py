"""Request size: batches over ``max_request_bytes`` go as several requests, and a 413 splits.

A 413 is not a drop: the sender halves the request at a ``TimeSeries`` boundary and sends both
halves, down to one series; only a single series that still gets 413 is dropped and counted
(``reason="too_large"``). Memory and spooled queues alike.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest
from test_rw_sender import FAST, Receiver, eventually, labels_of, make_series, snap

from hfsampler import selfmetrics as sm
from hfsampler.errors import ConfigError
from hfsampler.remote_write.config import EndpointConfig, parse_remote_write
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import SeriesRegistry, Snapshot

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops

WINDOWS = 5
SERIES = 400


def expected(n_series: int, windows: int) -> set[tuple[str, int]]:
    return {(f"GPU-{i}", 1000 * (t + 1)) for i in range(n_series) for t in range(windows)}


def delivered(rx: Receiver) -> list[tuple[str, int]]:
    """(UUID, timestamp) of every accepted sample, duplicates kept."""
    out = []
    for r in rx.received:
        if 200 <= r.status < 300:
            for ts in r.request.timeseries:
                uuid = next(lb.value for lb in ts.labels if lb.name == "UUID")
                out.extend((uuid, s.timestamp) for s in ts.samples)
    return out


async def push_windows(
    cfg: EndpointConfig, rx: Receiver, queue_dir: Path | None = None
) -> SelfMetrics:
    metrics = SelfMetrics()
    writer = RemoteWriter(cfg, metrics, queue_dir)
    await writer.start()
    series = make_series(SERIES)
    for t in range(WINDOWS):
        writer.push(snap(series, 1000 * (t + 1)))
    await eventually(
        lambda: metrics.total(sm.RW_SAMPLES) + metrics.total(sm.RW_DROPPED) >= SERIES * WINDOWS
    )
    await writer.close(5)
    return metrics


async def test_batches_over_max_request_bytes_go_as_several_requests() -> None:
    async with Receiver(max_body_bytes=16 << 10) as rx:
        queue = replace(FAST, max_samples_per_send=SERIES * WINDOWS, max_request_bytes=16 << 10)
        cfg = EndpointConfig(rx.url, name="t", queue=queue)
        m = await push_windows(cfg, rx)
    assert [r.status for r in rx.received if r.status != 204] == []  # never a 413
    assert max(r.size for r in rx.received) <= 16 << 10
    got = delivered(rx)
    assert sorted(got) == sorted(expected(SERIES, WINDOWS))  # every sample exactly once
    assert m.get(sm.RW_SAMPLES, labels_of(cfg)) == SERIES * WINDOWS
    assert m.get(sm.RW_BYTES, labels_of(cfg)) == sum(r.size for r in rx.received)


@pytest.mark.parametrize("spooled", [False, True], ids=["memory", "spool"])
async def test_413_splits_until_the_receiver_takes_every_sample(
    tmp_path: Path, spooled: bool
) -> None:
    """A receiver refusing bodies over 6 KiB still gets every sample, in more requests."""
    async with Receiver(max_body_bytes=6 << 10) as rx:
        queue = replace(FAST, max_samples_per_send=SERIES * WINDOWS)
        cfg = EndpointConfig(rx.url, name="t", queue=queue)
        m = await push_windows(cfg, rx, tmp_path if spooled else None)
    got = delivered(rx)
    assert sorted(got) == sorted(expected(SERIES, WINDOWS))
    statuses = [r.status for r in rx.received]
    assert 413 in statuses
    assert statuses.count(204) > statuses.count(413)
    assert m.total(sm.RW_DROPPED) == 0
    assert m.get(sm.RW_REQUESTS, labels_of(cfg, status="413")) == statuses.count(413)
    assert m.get(sm.RW_SAMPLES, labels_of(cfg)) == SERIES * WINDOWS


async def test_single_series_over_the_limit_is_dropped_as_too_large(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = SeriesRegistry()
    small = make_series(3, reg)
    big = reg.series("DCGM_FI_DEV_XID_ERRORS", {"UUID": "GPU-big", "gpu": "9", "note": "x" * 3000})
    async with Receiver(max_body_bytes=2 << 10) as rx:
        cfg = EndpointConfig(rx.url, name="t", queue=replace(FAST, max_samples_per_send=100))
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        writer.push(Snapshot(1000, [*small, big], [1.0, 2.0, 3.0, 4.0]))
        await eventually(lambda: metrics.total(sm.RW_SAMPLES) + metrics.total(sm.RW_DROPPED) >= 4)
        await writer.close(5)
    assert sorted(delivered(rx)) == [(f"GPU-{i}", 1000) for i in range(3)]
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="too_large")) == 1
    assert metrics.total(sm.RW_DROPPED) == 1
    assert any("too large" in r.getMessage() for r in caplog.records)


def test_max_request_bytes_is_validated() -> None:
    (ep,) = parse_remote_write(
        [{"url": "http://r/w", "queue_config": {"max_request_bytes": "1MiB"}}]
    )
    assert ep.queue.max_request_bytes == 1 << 20
    assert EndpointConfig("http://r/w").queue.max_request_bytes == 8 << 20
    for bad in ("1KiB", "1GiB", -5, "lots", True):
        with pytest.raises(ConfigError, match=r"queue_config\.max_request_bytes"):
            parse_remote_write([{"url": "http://r/w", "queue_config": {"max_request_bytes": bad}}])


async def test_prometheus3_400_for_a_decoded_body_too_large_splits_like_413() -> None:
    """Prometheus 3 answers 400 "decoded length N exceeds limit M": split, never drop."""
    async with Receiver(max_body_bytes=6 << 10) as rx:
        rx.too_large_status = 400
        rx.too_large_text = "snappy: decoded length 38235231 exceeds limit 33554432"
        queue = replace(FAST, max_samples_per_send=SERIES * WINDOWS)
        cfg = EndpointConfig(rx.url, name="t", queue=queue)
        m = await push_windows(cfg, rx)
    assert sorted(delivered(rx)) == sorted(expected(SERIES, WINDOWS))
    assert 400 in [r.status for r in rx.received]
    assert m.total(sm.RW_DROPPED) == 0


async def test_after_a_413_later_batches_fit_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """The size a receiver took is remembered: one window's 413s, not every window's."""
    caplog.set_level(logging.INFO)
    async with Receiver(max_body_bytes=6 << 10) as rx:
        cfg = EndpointConfig(rx.url, name="t", queue=replace(FAST, max_samples_per_send=SERIES))
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        series = make_series(SERIES)
        for t in range(WINDOWS):
            writer.push(snap(series, 1000 * (t + 1)))
            await eventually(lambda t=t: metrics.total(sm.RW_SAMPLES) >= SERIES * (t + 1))  # type: ignore[misc]
        await writer.close(5)
    statuses = [r.status for r in rx.received]
    first_window_413s = statuses.count(413)
    assert 0 < first_window_413s <= 4, statuses  # a halving per 413, the rest cut to fit
    assert sorted(delivered(rx)) == sorted(expected(SERIES, WINDOWS))
    lowered = [r for r in caplog.records if "from now on" in r.getMessage()]
    assert len(lowered) == len({r.getMessage() for r in lowered}) <= 3


async def test_a_receiver_refusing_everything_as_too_large_costs_one_line_per_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with Receiver(max_body_bytes=0) as rx:
        cfg = EndpointConfig(rx.url, name="t", queue=replace(FAST, max_samples_per_send=1000))
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        series = make_series(20)
        for t in range(3):
            writer.push(snap(series, 1000 * (t + 1)))
        await eventually(lambda: metrics.total(sm.RW_DROPPED) >= 60)
        await writer.close(5)
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="too_large")) == 60
    assert metrics.total(sm.RW_SAMPLES) == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) <= 3, [r.getMessage() for r in errors]  # one per batch, not per series
    counts = [re.search(r"refused \d+ series \((\d+) samples\)", r.getMessage()) for r in errors]
    assert sum(int(m.group(1)) for m in counts if m) == 60
    assert len(rx.received) <= 3 * (2 * 20 + 2)


async def test_shutdown_during_a_split_batch_counts_each_sample_once() -> None:
    """Delivered + dropped is exactly what was pushed, however far a batch got."""
    async with Receiver() as rx:
        rx.delay_s = 0.05
        queue = replace(FAST, max_samples_per_send=SERIES * WINDOWS, max_request_bytes=4 << 10)
        cfg = EndpointConfig(rx.url, name="t", queue=queue)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        series = make_series(SERIES)
        for t in range(WINDOWS):
            writer.push(snap(series, 1000 * (t + 1)))
        await eventually(lambda: metrics.total(sm.RW_SAMPLES) > 0)
        await writer.close(0.2)
    sent = len(delivered(rx))
    counted = metrics.get(sm.RW_SAMPLES, labels_of(cfg))
    assert 0 < counted < SERIES * WINDOWS
    assert (
        counted + metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="shutdown")) == SERIES * WINDOWS
    )
    # the request cut off by the shutdown may have reached the receiver, unanswered
    assert counted <= sent <= counted + SERIES


async def test_a_backlog_batch_carries_each_series_once() -> None:
    """Windows queued while a receiver was away go as one TimeSeries per series, not per window."""
    async with Receiver() as rx:
        queue = replace(FAST, max_samples_per_send=SERIES * WINDOWS, batch_send_deadline_s=0.5)
        cfg = EndpointConfig(rx.url, name="t", queue=queue)
        m = await push_windows(cfg, rx)
    assert m.total(sm.RW_DROPPED) == 0
    for r in rx.received:
        uuids = [
            next(lb.value for lb in ts.labels if lb.name == "UUID") for ts in r.request.timeseries
        ]
        assert len(uuids) == len(set(uuids)), "a series came twice in one request"
    assert max(len(ts.samples) for r in rx.received for ts in r.request.timeseries) == WINDOWS
    assert sorted(delivered(rx)) == sorted(expected(SERIES, WINDOWS))


@pytest.mark.parametrize("spooled", [False, True], ids=["memory", "spool"])
async def test_a_batch_partly_sent_when_a_reload_replaces_the_writer_is_finished_first(
    tmp_path: Path, spooled: bool
) -> None:
    """A batch that goes as several requests is delivered whole by the old writer before it
    hands over: handing it over half sent would send its first requests twice."""
    async with Receiver() as rx:
        rx.delay_s = 0.05  # the handover starts while the batch's requests go one by one
        queue = replace(FAST, max_samples_per_send=SERIES * WINDOWS, max_request_bytes=16 << 10)
        cfg = EndpointConfig(rx.url, name="t", queue=queue)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics, tmp_path if spooled else None)
        await writer.start()
        series = make_series(SERIES)
        for t in range(WINDOWS):
            writer.push(snap(series, 1000 * (t + 1)))
        await eventually(lambda: len(rx.received) >= 1)
        left = await writer.hand_over(5.0)
    assert left == [[]]
    assert len(rx.received) > 2  # several requests, all sent by the old writer
    assert sorted(delivered(rx)) == sorted(expected(SERIES, WINDOWS))  # each sample once
    assert metrics.total(sm.RW_DROPPED) == 0

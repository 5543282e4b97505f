"""Request size: batches over ``max_request_bytes`` go as several requests, and a 413 splits.

A 413 is not a drop: the sender halves the request at a ``TimeSeries`` boundary and sends both
halves, down to one series; only a single series that still gets 413 is dropped and counted
(``reason="too_large"``). Memory and spooled queues alike.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_rw_sender import FAST, Receiver, eventually, labels_of, make_series, snap

from hfsampler.errors import ConfigError
from hfsampler.remote_write import EndpointConfig, RemoteWriter, parse_remote_write
from hfsampler.remote_write.sender import BYTES, DROPPED, REQUESTS, SAMPLES
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import SeriesRegistry, Snapshot

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
    await eventually(lambda: metrics.total(SAMPLES) + metrics.total(DROPPED) >= SERIES * WINDOWS)
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
    assert m.get(SAMPLES, labels_of(cfg)) == SERIES * WINDOWS
    assert m.get(BYTES, labels_of(cfg)) == sum(r.size for r in rx.received)


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
    assert m.total(DROPPED) == 0
    assert m.get(REQUESTS, labels_of(cfg, status="413")) == statuses.count(413)
    assert m.get(SAMPLES, labels_of(cfg)) == SERIES * WINDOWS


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
        await eventually(lambda: metrics.total(SAMPLES) + metrics.total(DROPPED) >= 4)
        await writer.close(5)
    assert sorted(delivered(rx)) == [(f"GPU-{i}", 1000) for i in range(3)]
    assert metrics.get(DROPPED, labels_of(cfg, reason="too_large")) == 1
    assert metrics.total(DROPPED) == 1
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

"""Receivers that refuse, over and over or oddly: bounded requests, bounded log, nothing lost
that is not counted, spooled records never acknowledged unless answered.

Reproduced before these rules existed: ``Retry-After: ²`` passed ``str.isdigit()`` and failed
``float()``, a traceback per request with the batch dropped as ``error`` and, with a
``queue_dir``, its records acknowledged; refusals (400, 401, 409) were logged on every window
for ever; a receiver answering 413 to everything got 2,786 requests in 4 s; the spool's disk
gauge stayed 0 while an outage spooled 145 KB.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from test_rw_sender import FAST, Receiver, Reply, eventually, labels_of, make_series, snap

from hfsampler import selfmetrics as sm
from hfsampler.remote_write.config import EndpointConfig
from hfsampler.remote_write.episode import Episode
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.retry import parse_retry_after
from hfsampler.selfmetrics import SelfMetrics


@pytest.mark.parametrize(
    "value", ["\u00b2", "\u0663", "\uff11\uff10", "-5", "5.5", "1e3", "+5", "0x10", "5 s"]
)  # superscript two, Arabic-Indic three, fullwidth ten: str.isdigit() takes them all
def test_retry_after_is_delta_seconds_in_ascii_digits_or_an_http_date(value: str) -> None:
    assert parse_retry_after(value) is None


def test_retry_after_ascii_digits_are_taken() -> None:
    assert parse_retry_after(" 7 ") == 7.0
    assert parse_retry_after("0") == 0.0


async def test_an_unparsable_retry_after_is_ignored_and_the_backoff_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Receiver([Reply(503, headers={"Retry-After": "²"})] * 3) as rx:
        cfg = EndpointConfig(rx.url, "ra", queue=FAST)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics, tmp_path)
        await writer.start()
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    assert metrics.total(sm.RW_RETRIES) == 3
    assert metrics.total(sm.RW_DROPPED) == 0
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def _post_raising(monkeypatch: pytest.MonkeyPatch, times: int) -> list[int]:
    """aiohttp's ``post`` raises an unexpected error ``times`` times (a bug stand-in: no
    hfsampler code is replaced), then posts; returns the calls made, as a one-item list."""
    real = aiohttp.ClientSession.post
    calls = [0]

    def post(self: aiohttp.ClientSession, *args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] <= times:
            raise RuntimeError("unexpected")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(aiohttp.ClientSession, "post", post)
    return calls


async def test_an_unexpected_error_never_acknowledges_a_spooled_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch stays spooled and is sent again after a pause: nothing dropped."""
    calls = _post_raising(monkeypatch, 1)
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, "u", queue=replace(FAST, max_backoff_s=0.05))
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics, tmp_path)
        await writer.start()
        writer.push(snap(make_series(3), 1000))
        await eventually(lambda: len(rx.accepted()) == 3)
        await writer.close(5)
    assert calls[0] == 2
    assert metrics.total(sm.RW_DROPPED) == 0
    assert metrics.get(sm.RW_SAMPLES, labels_of(cfg)) == 3
    assert metrics.get(sm.RW_RETRIES, labels_of(cfg)) == 1
    assert len([r for r in caplog.records if r.exc_info]) == 1  # the traceback, once


async def test_a_spooled_batch_an_unexpected_error_kept_is_sent_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _post_raising(monkeypatch, 10**9)
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, "u", queue=replace(FAST, max_backoff_s=0.05))
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics, tmp_path)
        await writer.start()
        writer.push(snap(make_series(3), 1000))
        await eventually(lambda: calls[0] >= 2)
        await writer.close(0.1)
        assert metrics.total(sm.RW_DROPPED) == 0
        monkeypatch.undo()
        writer = RemoteWriter(cfg, SelfMetrics(), tmp_path)
        assert writer.queued() == 3
        await writer.start()
        await eventually(lambda: len(rx.accepted()) == 3)
        await writer.close(5)


async def test_an_unexpected_error_drops_a_memory_batch_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a spool there is nothing to keep it in: dropped, counted as ``error``."""
    _post_raising(monkeypatch, 1)
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, "m", queue=FAST)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: metrics.total(sm.RW_DROPPED) == 2)
        writer.push(snap(make_series(2), 2000))
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="error")) == 2


async def test_refusals_are_said_when_they_start_change_and_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Six windows refused with 400, two with 409, then accepted: two error lines (the start,
    the new status), the others at debug, one line when it delivers again; every refused
    sample counted."""
    script = [Reply(400, "out of order sample")] * 6 + [Reply(409, "conflict")] * 2
    caplog.set_level(logging.DEBUG, logger="hfsampler")
    async with Receiver(script) as rx:
        cfg = EndpointConfig(rx.url, "t", queue=FAST)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        series = make_series(2)
        for t in range(1, 10):
            writer.push(snap(series, 1000 * t))
            await eventually(lambda t=t: len(rx.received) == t)  # type: ignore[misc]
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 16
    refusals = [r for r in caplog.records if "not retrying" in r.getMessage()]
    assert len(refusals) == 8
    loud = [r.getMessage() for r in refusals if r.levelno >= logging.WARNING]
    assert len(loud) == 2, loud
    assert "HTTP 400: out of order sample" in loud[0]
    assert "later refusals are said every 300 s" in loud[0]
    assert "HTTP 409: conflict" in loud[1]
    assert "7 refusals" in loud[1]
    again = [r.getMessage() for r in caplog.records if "delivering again" in r.getMessage()]
    assert len(again) == 1
    assert "after 8 refusals" in again[0]


def test_an_episode_is_said_again_every_reminder() -> None:
    now = [0.0]
    episode = Episode("refusals", reminder_s=300.0, clock=lambda: now[0])
    assert episode.happened("HTTP 400") is not None
    now[0] = 299.0
    assert episode.happened("HTTP 400") is None
    now[0] = 301.0
    note = episode.happened("HTTP 400")
    assert note is not None
    assert "3 refusals over 301 s" in note
    now[0] = 302.0
    assert episode.happened("HTTP 400") is None
    assert episode.ended() == (4, 302.0)
    assert episode.ended() is None
    assert episode.happened("HTTP 400") is not None  # a new episode


async def test_a_receiver_refusing_everything_as_too_large_gets_few_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """413 to every request: once one series alone is refused, the batch's other pieces of
    that size or more are dropped without being sent, each counted once as ``too_large``."""
    windows, n_series = 3, 400
    async with Receiver(max_body_bytes=0) as rx:
        queue = replace(FAST, max_samples_per_send=10_000)
        cfg = EndpointConfig(rx.url, "big", queue=queue)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        series = make_series(n_series)
        for t in range(1, windows + 1):
            writer.push(snap(series, 1000 * t))
            await eventually(lambda t=t: metrics.total(sm.RW_DROPPED) == t * n_series)  # type: ignore[misc]
        await writer.close(5)
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="too_large")) == windows * n_series
    assert metrics.total(sm.RW_SAMPLES) == 0
    per_window = len(rx.received) / windows
    assert per_window <= 30, len(rx.received)  # was 2 per series: 800
    dropped = [r for r in caplog.records if "too large even alone" in r.getMessage()]
    assert len(dropped) == windows  # one line per batch, as before


async def test_the_disk_gauge_follows_the_spool_during_an_outage(tmp_path: Path) -> None:
    async with Receiver() as probe:
        url = probe.url  # nothing listens there once the probe is closed
    cfg = EndpointConfig(url, "out", queue=replace(FAST, max_backoff_s=0.05))
    metrics = SelfMetrics()
    writer = RemoteWriter(cfg, metrics, tmp_path)
    await writer.start()
    series = make_series(20)

    def gauge() -> float:
        return metrics.get(sm.RW_QUEUE_DISK_BYTES, labels_of(cfg))

    for t in range(1, 11):
        writer.push(snap(series, 1000 * t))
    await eventually(lambda: writer.disk_bytes() > 0 and gauge() == writer.disk_bytes())
    first = gauge()
    for t in range(11, 41):
        writer.push(snap(series, 1000 * t))
    await eventually(lambda: gauge() > first and gauge() == writer.disk_bytes())
    await writer.close(0.1)
    async with Receiver(port=int(url.split(":")[2].split("/")[0])) as rx:
        writer = RemoteWriter(cfg, metrics, tmp_path)
        await writer.start()
        await eventually(lambda: len(rx.accepted()) == 40 * 20)
        await eventually(lambda: writer.disk_bytes() == 0 and gauge() == 0)
        await writer.close(5)

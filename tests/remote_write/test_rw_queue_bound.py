"""The queue's bound: sized in windows of the plan, an explicit capacity never below one window,
the newest window kept whole, and a full queue's drops said once per episode."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest
from conformance import ConformanceReceiver

from hfsampler import selfmetrics as sm
from hfsampler.remote_write.blocks import Block, Labels
from hfsampler.remote_write.config import EndpointConfig, QueueConfig, parse_remote_write
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.queue import MemoryQueue
from hfsampler.remote_write.sizing import DEFAULT_WINDOWS, queue_bound, raised_warning
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import STALE_NAN, Series, SeriesRegistry, Snapshot

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops


def test_without_capacity_a_shard_holds_ten_windows_or_prometheus_10000_samples() -> None:
    default = QueueConfig()
    assert not default.capacity_set
    big = queue_bound(default, 14_000)  # 64 sim GPUs
    assert (big.samples, big.window_samples, big.windows, big.raised_from) == (
        DEFAULT_WINDOWS * 14_000, 14_000, DEFAULT_WINDOWS, None)  # fmt: skip
    assert queue_bound(default, 800).samples == 10_000  # 3 GPUs: Prometheus's default holds more
    # over shards: each holds its share of a window, rounded up
    assert queue_bound(default, 14_001, n_shards=2).window_samples == 7_001
    assert queue_bound(default, 0).samples == 10_000  # no plan (replay): capacity as it is


def test_an_explicit_capacity_is_the_bound_but_never_below_one_window() -> None:
    (endpoint,) = parse_remote_write([{"url": "http://r/w", "queue_config": {"capacity": 20000}}])
    assert endpoint.queue.capacity_set
    assert queue_bound(endpoint.queue, 1_800).samples == 20_000  # not raised to 10 windows
    small = queue_bound(endpoint.queue, 25_000)
    assert (small.samples, small.raised_from) == (25_000, 20_000)
    assert small.describe() == "1 window, 25000 samples per shard"


def test_the_raised_capacity_warning_counts_in_words() -> None:
    """capacity: 1 (an operator trying the smallest bound) read 'is 1 samples'."""
    (endpoint,) = parse_remote_write([{"url": "http://r/w", "queue_config": {"capacity": 1}}])
    said = raised_warning("remote_write[0].queue_config.capacity", queue_bound(endpoint.queue, 9))
    assert said.startswith("remote_write[0].queue_config.capacity is 1 sample, less than one ")
    assert "(9 samples per shard" in said
    assert "raised to 9 at start" in said


def _window(ts: int, n: int, first: int = 0) -> Block:
    labels = [Labels.of([("__name__", f"m{i}")]) for i in range(first, first + n)]
    return Block.of(labels, ts, [1.0] * n)


def test_the_memory_queue_keeps_its_newest_window_whole_past_its_bound() -> None:
    """A window larger than the bound (more series than the plan said) is kept whole: the
    older windows make way, never a part of the one arriving."""
    queue = MemoryQueue(10)
    assert queue.put(_window(1000, 6)) == 0
    dropped = sum(queue.put(_window(2000, 6, first)) for first in (0, 6, 12))  # 18 > 10
    assert dropped == 6  # the older window only
    assert len(queue) == 18


def _snapshot(series: list[Series], ts: int) -> Snapshot:
    return Snapshot(ts, series, [float(i) for i in range(len(series))])


async def test_a_full_queue_is_said_once_per_episode_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The receiver away: every window drops the oldest one, counted each time, said once (not
    a line per window); its end said once when the queue has room again."""
    caplog.set_level(logging.DEBUG, logger="hfsampler.remote_write.intake")
    reg = SeriesRegistry()
    series = [reg.series("DCGM_FI_DEV_POWER_USAGE", {"gpu": str(i)}) for i in range(5)]
    base = (time.time_ns() // 10**9 - 60) * 1000  # a minute ago: recent enough for a receiver
    async with ConformanceReceiver() as rx:
        queue = replace(QueueConfig(capacity=10, capacity_set=True), max_samples_per_send=100)
        cfg = EndpointConfig(rx.url, name="edge", queue=queue)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics, window_samples=5)  # not started: nothing is sent
        assert writer.bound.samples == 10  # 2 windows, as the user said
        for t in range(12):
            writer.push(_snapshot(series, base + 1000 * (t + 1)))
        labels = {"remote_name": "edge", "url": cfg.display_url, "reason": "queue_full"}
        assert metrics.get(sm.RW_DROPPED, labels) == 50  # 10 windows of 5
        said = [r for r in caplog.records if "queue is full" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING] + [logging.DEBUG] * 9
        assert "2 windows, 10 samples per shard" in said[0].getMessage()
        assert "queue_dir" in said[0].getMessage()  # the fix
        await writer.start()
        await rx.wait_async(lambda r: r.report()["samples"] == 10)
        writer.push(_snapshot(series, base + 13_000))  # room again: the episode ends
        await rx.wait_async(lambda r: r.report()["samples"] == 15)
        await writer.close(5)
    ended = [r.getMessage() for r in caplog.records if "has room again" in r.getMessage()]
    assert len(ended) == 1
    assert "50 samples dropped" in ended[0]
    rx.assert_conformant()
    stamps = sorted({t for v in rx.series_named("DCGM_FI_DEV_POWER_USAGE").values() for t, _ in v})
    assert stamps == [base + 11_000, base + 12_000, base + 13_000]  # the newest windows, whole


async def test_a_series_that_ends_and_returns_stays_on_its_shard() -> None:
    """A series that ended (its stale marker queued) and returns is a new Series with a new id;
    sharded by id it could land on another shard, whose requests race the first one's: after
    an outage the receiver stored the returning samples first and refused the older ones,
    stale marker included, as out of order (a relabelled endpoint's series get fresh ids on
    every reload too). Sharded by its labels, it stays where its older samples are."""
    reg = SeriesRegistry()
    labels = [{"gpu": str(i)} for i in range(7)]  # 7 new ids a return: not a multiple of 4
    cfg = EndpointConfig("http://127.0.0.1:9/w", name="edge", queue=QueueConfig(min_shards=4))
    writer = RemoteWriter(cfg, SelfMetrics(), window_samples=28)  # not started: nothing is sent
    for t in range(6):
        series = [reg.series("DCGM_FI_DEV_POWER_USAGE", lab) for lab in labels]
        values = [STALE_NAN if t % 2 else 1.0] * len(series)  # each window ends them all
        writer.push(Snapshot(1000 * (t + 1), series, values))
        if t % 2:
            reg.forget(series)  # as the model does once a stale marker went: a new id next time
    shards_of: dict[str, set[int]] = {}
    for k, queue in enumerate(writer._queues):
        queue.start_flush()
        batch = await queue.get_batch(10**6, 0.0)
        for block in batch.blocks:
            for lab in block.series:
                shards_of.setdefault(lab.v1.hex(), set()).add(k)
    assert len(shards_of) == len(labels)
    assert all(len(shards) == 1 for shards in shards_of.values()), shards_of
    await writer.close(0.0)


async def test_a_receiver_a_little_too_slow_is_said_once_not_every_few_windows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sender takes the queue every third window (a request takes 3 windows' time): every
    third window drops one, the others fit. Each put that dropped nothing ended the episode, so
    each cycle said a warning and a 'room again' line (17 and 16 in 60 windows against a real
    receiver 3.5 windows a request). The first is said; the ones that follow within
    REMINDER_S are counted, and at debug."""
    caplog.set_level(logging.DEBUG, logger="hfsampler.remote_write.intake")
    reg = SeriesRegistry()
    series = [reg.series("DCGM_FI_DEV_POWER_USAGE", {"gpu": str(i)}) for i in range(5)]
    queue = replace(QueueConfig(capacity=10, capacity_set=True), max_samples_per_send=100)
    cfg = EndpointConfig("http://127.0.0.1:9/w", name="edge", queue=queue)
    metrics = SelfMetrics()
    writer = RemoteWriter(cfg, metrics, window_samples=5)  # not started: the test takes batches
    (shard,) = writer._queues
    t = 0
    for _ in range(20):
        for _ in range(3):  # the third drops the oldest window
            t += 1
            writer.push(_snapshot(series, 1000 * t))
        await shard.get_batch(100, 0.0)  # the sender takes what is queued
    labels = {"remote_name": "edge", "url": cfg.display_url, "reason": "queue_full"}
    assert metrics.get(sm.RW_DROPPED, labels) == 20 * 5  # every drop counted
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    full = [m for _, m in said if "queue is full" in m]
    room = [m for _, m in said if "has room again" in m]
    assert len(full) == 1
    assert len(room) == 1
    await writer.close(0.0)

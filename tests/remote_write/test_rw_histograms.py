"""Native histograms from ``RemoteWriter.push`` to a receiver: only to endpoints with
``send_native_histograms``, conformant in both protocols, and a receiver that refuses them loses
them alone (counted, said once) while every float series is still delivered."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conformance import (
    HISTOGRAMS_WRITTEN_HEADER,
    SAMPLES_WRITTEN_HEADER,
    ConformanceReceiver,
    Reply,
)
from hist_snapshots import HISTOGRAM, POWER, PowerWindows
from histograms_check import histogram_problems
from test_rw_sender import FAST, eventually, labels_of

from hfsampler import selfmetrics as sm
from hfsampler.histograms import ResetHint
from hfsampler.remote_write.config import PROTOBUF_V1, PROTOBUF_V2, EndpointConfig, QueueConfig
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.prompb import writev2_pb2
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import STALE_NAN

pytestmark = pytest.mark.both_loops
WINDOWS = 3
GPUS = 2


def now_ms() -> int:
    return int(time.time() * 1000) - 10_000


def names(store: dict[tuple[tuple[str, str], ...], list[object]]) -> dict[str, int]:
    """Points stored per metric name."""
    out: dict[str, int] = {}
    for labels, points in store.items():
        name = dict(labels)["__name__"]
        out[name] = out.get(name, 0) + len(points)
    return out


@pytest.mark.parametrize("protocol", [PROTOBUF_V1, PROTOBUF_V2])
async def test_histograms_go_only_where_asked_and_are_conformant(
    protocol: str, tmp_path: Path
) -> None:
    windows = PowerWindows(GPUS, 200)
    async with ConformanceReceiver() as yes, ConformanceReceiver() as no:
        on = EndpointConfig(yes.url, "on", queue=FAST, protobuf_message=protocol,
                            send_native_histograms=True)  # fmt: skip
        off = EndpointConfig(no.url, "off", queue=FAST, protobuf_message=protocol)
        metrics = SelfMetrics()
        writers = [RemoteWriter(on, metrics, tmp_path), RemoteWriter(off, metrics)]
        for w in writers:
            await w.start()
        for snapshot in windows.windows(now_ms(), WINDOWS):
            for w in writers:
                w.push(snapshot)
        await eventually(lambda: sum(names(yes.histograms).values()) == GPUS * WINDOWS)
        await eventually(lambda: sum(names(no.samples).values()) == GPUS * WINDOWS)
        for w in writers:
            await w.close(5)
    assert yes.violations == []
    assert no.violations == []
    assert names(yes.samples) == {POWER: GPUS * WINDOWS}
    assert names(no.samples) == {POWER: GPUS * WINDOWS}
    assert no.histograms == {}
    assert metrics.total(sm.RW_DROPPED) == 0
    for (labels, points), series in zip(
        sorted(yes.histograms.items()), windows.hist_series, strict=True
    ):
        assert dict(labels)["gpu"] == dict(series.labels)["gpu"]
        last = writev2_pb2.Histogram.FromString(points[-1][1])  # type: ignore[arg-type]
        assert histogram_problems(last) == []
        assert last.count_int == WINDOWS * 200
    if protocol == PROTOBUF_V1:
        assert yes.metadata == 2  # the power family and the histogram family
        assert no.metadata == 1  # no histogram family where no histogram goes
    else:
        hist_meta = {meta[0] for labels, meta in yes.metadata_of.items()
                     if dict(labels)["__name__"] == HISTOGRAM}  # fmt: skip
        assert hist_meta == {"histogram"}
        assert {meta[0] for meta in no.metadata_of.values()} == {"gauge"}


@pytest.mark.parametrize(
    ("protocol", "refusal"),
    [
        (PROTOBUF_V1, (500, "native histograms are disabled")),  # Prometheus 2.42 and 3.5
        (PROTOBUF_V2, (500, "native histograms are disabled")),  # without the feature flag
        (PROTOBUF_V1, (400, "native histograms are disabled")),
        (PROTOBUF_V1, (422, "native histogram ingestion is disabled")),
    ],
)
async def test_a_receiver_refusing_histograms_loses_them_alone(
    protocol: str, refusal: tuple[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    windows = PowerWindows(GPUS, 100)
    async with ConformanceReceiver(refuse_histograms=refusal) as rx:
        cfg = EndpointConfig(rx.url, "nh", queue=FAST, protobuf_message=protocol,
                             send_native_histograms=True)  # fmt: skip
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        snaps = iter(windows.windows(now_ms(), WINDOWS))
        writer.push(next(snaps))
        await eventually(lambda: sum(names(rx.samples).values()) == GPUS)
        for snapshot in snaps:  # after the refusal: never queued
            writer.push(snapshot)
        await eventually(lambda: sum(names(rx.samples).values()) == GPUS * WINDOWS)
        await writer.close(5)
    assert rx.violations == []
    assert rx.histograms == {}
    dropped = labels_of(cfg, reason="histograms_refused")
    assert metrics.get(sm.RW_DROPPED, dropped) == GPUS * WINDOWS
    assert metrics.total(sm.RW_DROPPED) == GPUS * WINDOWS  # nothing else lost
    assert metrics.get(sm.RW_SAMPLES, labels_of(cfg)) == GPUS * WINDOWS
    said = [r for r in caplog.records if "refuses native histograms" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.ERROR
    assert refusal[1] in said[0].getMessage()
    assert "\n" not in said[0].getMessage()
    assert rx.statuses.count(refusal[0]) == 1  # refused once; then only floats went


async def test_a_400_that_does_not_name_histograms_is_an_ordinary_refusal() -> None:
    windows = PowerWindows(GPUS, 50)
    async with ConformanceReceiver(refuse_histograms=(400, "out of bounds")) as rx:
        cfg = EndpointConfig(rx.url, "nh", queue=FAST, send_native_histograms=True)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        writer.push(windows.window(now_ms()))
        await eventually(lambda: rx.requests == 1)
        await writer.close(5)
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 2 * GPUS
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="histograms_refused")) == 0


async def test_a_full_memory_queue_drops_whole_windows_histograms_counted() -> None:
    windows = PowerWindows(GPUS, 20)
    window = 2 * GPUS  # a float and a histogram series per GPU
    queue = QueueConfig(capacity=10 * window + 1, capacity_set=True)
    cfg = EndpointConfig("http://127.0.0.1:9/api/v1/write", "q", queue=queue,
                         send_native_histograms=True)  # fmt: skip
    metrics = SelfMetrics()
    writer = RemoteWriter(cfg, metrics, window_samples=window)  # never started: nothing sent
    pushes = 12
    for snapshot in windows.windows(now_ms(), pushes):
        writer.push(snapshot)
    assert writer.queued() == 10 * window  # whole windows, histograms and floats alike
    dropped = metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="queue_full"))
    assert dropped == pushes * window - writer.queued()
    await writer.close(0)


async def test_a_stale_histogram_ends_its_series() -> None:
    windows = PowerWindows(GPUS, 10)
    snapshot = windows.window(now_ms())
    series, h = snapshot.histograms[0]
    stale = replace(h, sum=STALE_NAN, reset_hint=ResetHint.NO)
    last = replace(
        snapshot, timestamp_ms=snapshot.timestamp_ms + 1000, histograms=[(series, stale)]
    )
    async with ConformanceReceiver() as rx:
        cfg = EndpointConfig(rx.url, "st", queue=FAST, send_native_histograms=True)
        writer = RemoteWriter(cfg, SelfMetrics())
        await writer.start()
        writer.push(snapshot)
        cached = writer._encoder.cached_series  # the label cache a stale marker must empty
        writer.push(last)
        assert writer._encoder.cached_series == cached - 1
        await eventually(lambda: sum(len(v) for v in rx.histograms.values()) == GPUS + 1)
        await writer.close(5)
    assert rx.violations == []


@pytest.mark.parametrize("protocol", [PROTOBUF_V1, PROTOBUF_V2])
async def test_spooled_histograms_are_sent_by_the_next_writer(
    protocol: str, tmp_path: Path
) -> None:
    windows = PowerWindows(GPUS, 30)
    snaps = list(windows.windows(now_ms(), WINDOWS))
    async with ConformanceReceiver() as rx:
        cfg = EndpointConfig(rx.url, "sp", queue=FAST, protobuf_message=protocol,
                             send_native_histograms=True)  # fmt: skip
        first = RemoteWriter(cfg, SelfMetrics(), tmp_path)  # never started: all stays spooled
        for snapshot in snaps:
            first.push(snapshot)
        await first.close(0)
        metrics = SelfMetrics()
        second = RemoteWriter(cfg, metrics, tmp_path, families=snaps[0].families)
        assert second.queued() == 2 * GPUS * WINDOWS
        await second.start()
        await eventually(lambda: sum(names(rx.histograms).values()) == GPUS * WINDOWS)
        await second.close(5)
    assert rx.violations == []
    assert names(rx.samples) == {POWER: GPUS * WINDOWS}
    assert metrics.total(sm.RW_DROPPED) == 0


async def test_a_2_0_partial_write_of_the_floats_is_not_sent_again() -> None:
    """A 2.0 receiver that stored the floats and refused the histograms (Prometheus after
    prometheus/prometheus#17181: 422 with the Written headers) gets nothing again."""
    windows = PowerWindows(GPUS, 20)
    headers = {SAMPLES_WRITTEN_HEADER: str(GPUS), HISTOGRAMS_WRITTEN_HEADER: "0"}
    reply = Reply(422, "native histograms are disabled", headers)
    async with ConformanceReceiver(script=[reply]) as rx:
        cfg = EndpointConfig(rx.url, "pw", queue=FAST, protobuf_message=PROTOBUF_V2,
                             send_native_histograms=True)  # fmt: skip
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        writer.push(windows.window(now_ms()))
        await writer.close(5)
    assert rx.requests == 1
    assert metrics.get(sm.RW_SAMPLES, labels_of(cfg)) == GPUS
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="histograms_refused")) == GPUS
    assert metrics.total(sm.RW_DROPPED) == GPUS


@pytest.mark.parametrize("protocol", [PROTOBUF_V1, PROTOBUF_V2])
async def test_spooled_histograms_are_not_sent_once_the_endpoint_no_longer_asks(
    protocol: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A spool written with ``send_native_histograms: true`` and read back by a writer whose
    endpoint turned it off (or whose config lost ``histograms:``): the floats go, the
    histograms are dropped with their own reason and said once, never sent unasked."""
    windows = PowerWindows(GPUS, 30)
    snaps = list(windows.windows(now_ms(), WINDOWS))
    async with ConformanceReceiver() as rx:
        was = EndpointConfig(rx.url, "sp", queue=FAST, protobuf_message=protocol,
                             send_native_histograms=True)  # fmt: skip
        first = RemoteWriter(was, SelfMetrics(), tmp_path)  # never started: all stays spooled
        for snapshot in snaps:
            first.push(snapshot)
        await first.close(0)
        now = replace(was, send_native_histograms=False)
        metrics = SelfMetrics()
        second = RemoteWriter(now, metrics, tmp_path, families=snaps[0].families)
        await second.start()
        await eventually(lambda: sum(names(rx.samples).values()) == GPUS * WINDOWS)
        await second.close(5)
    assert rx.violations == []
    assert rx.histograms == {}
    assert names(rx.samples) == {POWER: GPUS * WINDOWS}
    if protocol == PROTOBUF_V1:
        assert rx.metadata == 1  # the power family's: none of a histogram family it never gets
    dropped = labels_of(now, reason="histograms_not_asked")
    assert metrics.get(sm.RW_DROPPED, dropped) == GPUS * WINDOWS
    assert metrics.total(sm.RW_DROPPED) == GPUS * WINDOWS
    said = [r for r in caplog.records if "send_native_histograms" in r.getMessage()]
    assert len(said) == 1


async def test_histograms_handed_over_to_a_writer_that_no_longer_sends_them_are_counted() -> None:
    """A SIGHUP turning ``send_native_histograms`` off while a memory queue holds histograms:
    the next writer sends their floats, and drops and counts the histograms."""
    windows = PowerWindows(GPUS, 30)
    async with ConformanceReceiver() as rx:
        was = EndpointConfig(rx.url, "ho", queue=FAST, send_native_histograms=True)
        first = RemoteWriter(was, SelfMetrics())  # never started: all stays queued
        for snapshot in windows.windows(now_ms(), WINDOWS):
            first.push(snapshot)
        left = await first.hand_over(1.0)
        now = replace(was, send_native_histograms=False)
        metrics = SelfMetrics()
        second = RemoteWriter(now, metrics)
        second.take_over(left)
        await second.start()
        await eventually(lambda: sum(names(rx.samples).values()) == GPUS * WINDOWS)
        await second.close(5)
    assert rx.violations == []
    assert rx.histograms == {}
    assert metrics.get(sm.RW_DROPPED, labels_of(now, reason="histograms_not_asked")) == (
        GPUS * WINDOWS
    )
    assert metrics.total(sm.RW_DROPPED) == GPUS * WINDOWS


# Prometheus 3.5's answer to a 2.0 request whose samples are older than what it holds (a clock
# stepped back, a window sent twice): each series named, histogram series among them.
OUT_OF_ORDER = (
    'out of order sample for series {UUID="GPU-0", __name__="DCGM_FI_DEV_POWER_USAGE", '
    'gpu="0"}\nout of order sample for series {UUID="GPU-0", '
    '__name__="DCGM_FI_DEV_POWER_USAGE_histogram", gpu="0"}\n'
)


@pytest.mark.parametrize(
    "text",
    [
        OUT_OF_ORDER,
        "sample too old for series DCGM_FI_DEV_POWER_USAGE_histogram: out of bounds",
        # Prometheus's storage error, which Mimir answers with a 400
        "out-of-order native histogram ingestion is disabled",
    ],
)
async def test_a_400_refusing_some_samples_is_no_refusal_of_histograms(text: str) -> None:
    """A 400 that names a histogram series, or refuses histograms for their timestamps: that
    window is refused as any other; the next one's histograms still go."""
    windows = PowerWindows(GPUS, 20)
    async with ConformanceReceiver(script=[Reply(400, text)]) as rx:
        cfg = EndpointConfig(rx.url, "oo", queue=FAST, protobuf_message=PROTOBUF_V2,
                             send_native_histograms=True)  # fmt: skip
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        snaps = iter(windows.windows(now_ms(), 2))
        writer.push(next(snaps))
        await eventually(lambda: rx.requests == 1)
        writer.push(next(snaps))
        await eventually(lambda: sum(names(rx.histograms).values()) == GPUS)
        await writer.close(5)
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 2 * GPUS
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="histograms_refused")) == 0

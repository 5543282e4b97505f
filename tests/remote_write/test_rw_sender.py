"""RemoteWriter against a real loopback receiver that decodes snappy+protobuf and scripts faults."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import pytest
import snappy
from aiohttp import web
from aiohttp.test_utils import TestServer

import hfsampler
from hfsampler import selfmetrics as sm
from hfsampler.remote_write.config import EndpointConfig, QueueConfig
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.prompb import remote_pb2
from hfsampler.remote_write.retry import parse_retry_after
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import STALE_NAN, Family, Series, SeriesRegistry, Snapshot, is_stale

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops

FAST = QueueConfig(batch_send_deadline_s=0.02, min_backoff_s=0.005, max_backoff_s=0.02)
WAIT_S = 30.0  # a loaded 2-core runner can stall a test's loop for seconds; a pass is quick


@dataclass
class Reply:
    status: int = 204
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False  # never answer until the test ends: slower than any remote_timeout


@dataclass
class Received:
    at: float
    headers: dict[str, str]
    request: remote_pb2.WriteRequest
    status: int
    size: int  # decoded bytes


class Receiver:
    """A Remote-Write receiver on loopback; replies follow ``script``, then 204."""

    def __init__(
        self,
        script: list[Reply] | None = None,
        port: int | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.script = deque(script or [])
        self.max_body_bytes = max_body_bytes  # decoded bodies above this get 413
        self.too_large_status = 413
        self.too_large_text = "request body too large"
        self.delay_s = 0.0  # every answer waits this long
        self.received: list[Received] = []
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_post("/api/v1/write", self.handle)
        self.server = TestServer(app, port=port)

    async def __aenter__(self) -> Receiver:
        await self.server.start_server()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self.server.close()

    @property
    def url(self) -> str:
        return str(self.server.make_url("/api/v1/write"))

    async def handle(self, request: web.Request) -> web.Response:
        body = snappy.uncompress(await request.read())
        reply = self.script.popleft() if self.script else Reply()
        if self.max_body_bytes is not None and len(body) > self.max_body_bytes:
            reply = Reply(self.too_large_status, self.too_large_text)
        self.received.append(
            Received(
                time.monotonic(),
                dict(request.headers),
                remote_pb2.WriteRequest.FromString(body),
                reply.status,
                len(body),
            )
        )
        if reply.hang:
            await self.release.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(status=reply.status, text=reply.body, headers=reply.headers)

    def accepted(self) -> list[tuple[str, int, float]]:
        """(series key, timestamp, value) of every sample in a 2xx-answered request."""
        out = []
        for r in self.received:
            if 200 <= r.status < 300:
                for ts in r.request.timeseries:
                    key = ",".join(f"{lb.name}={lb.value}" for lb in ts.labels)
                    out.extend((key, s.timestamp, s.value) for s in ts.samples)
        return out


async def eventually(check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Await a condition, failing after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def make_series(n: int, reg: SeriesRegistry | None = None) -> list[Series]:
    reg = reg if reg is not None else SeriesRegistry()  # an empty registry is falsy
    return [
        reg.series("DCGM_FI_DEV_POWER_USAGE", {"gpu": str(i), "UUID": f"GPU-{i}"}) for i in range(n)
    ]


def snap(series: list[Series], ts: int, base: float = 0.0) -> Snapshot:
    return Snapshot(ts, series, [base + i for i in range(len(series))])


def labels_of(cfg: EndpointConfig, **extra: str) -> dict[str, str]:
    return {"remote_name": cfg.remote_name, "url": cfg.display_url, **extra}


async def running(cfg: EndpointConfig) -> tuple[RemoteWriter, SelfMetrics]:
    metrics = SelfMetrics()
    writer = RemoteWriter(cfg, metrics)
    await writer.start()
    return writer, metrics


async def test_503_then_204_resends_the_same_samples() -> None:
    async with Receiver([Reply(503, "try later")]) as rx:
        cfg = EndpointConfig(rx.url, name="t", queue=FAST)
        writer, m = await running(cfg)
        series = make_series(3)
        writer.push(snap(series, 1000))
        await eventually(lambda: len(rx.accepted()) == 3)
        await writer.close(5)
    assert [r.status for r in rx.received] == [503, 204]
    assert rx.received[0].request == rx.received[1].request
    assert m.get(sm.RW_RETRIES, labels_of(cfg)) == 1
    assert m.get(sm.RW_REQUESTS, labels_of(cfg, status="503")) == 1
    assert m.get(sm.RW_REQUESTS, labels_of(cfg, status="204")) == 1
    assert m.get(sm.RW_SAMPLES, labels_of(cfg)) == 3
    assert m.total(sm.RW_DROPPED) == 0


async def test_an_outage_is_logged_when_it_starts_changes_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Eight retries of a 503, two of a 502: two warnings (the start, the new reason), the
    other retries at debug, and one line when the endpoint takes the batch again."""
    script = [Reply(503, "try later")] * 8 + [Reply(502, "bad gateway")] * 2
    caplog.set_level(logging.DEBUG, logger="hfsampler")
    async with Receiver(script) as rx:
        cfg = EndpointConfig(rx.url, name="t", queue=FAST)
        writer, m = await running(cfg)
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 10 == m.total(sm.RW_RETRIES)
    loud = [r.getMessage() for r in retries if r.levelno == logging.WARNING]
    assert len(loud) == 2
    assert "HTTP 503" in loud[0]
    assert "later retries are said every 300 s" in loud[0]
    assert "HTTP 502" in loud[1]
    assert "9 retries" in loud[1]
    recovered = [r.getMessage() for r in caplog.records if "delivering again" in r.getMessage()]
    assert len(recovered) == 1
    assert "after 10 retries" in recovered[0]


async def test_429_retry_after_is_honoured() -> None:
    async with Receiver([Reply(429, headers={"Retry-After": "1"})]) as rx:
        cfg = EndpointConfig(rx.url, queue=FAST)
        writer, m = await running(cfg)
        writer.push(snap(make_series(1), 1000))
        await eventually(lambda: len(rx.accepted()) == 1)
        await writer.close(5)
    first, second = rx.received
    assert second.at - first.at >= 1.0
    assert m.total(sm.RW_RETRIES) == 1


async def test_429_not_retried_when_disabled() -> None:
    async with Receiver([Reply(429)]) as rx:
        cfg = EndpointConfig(rx.url, queue=replace(FAST, retry_on_http_429=False))
        writer, m = await running(cfg)
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: m.total(sm.RW_DROPPED) == 2)
        await writer.close(5)
    assert m.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 2
    assert len(rx.received) == 1


async def test_400_drops_batch_logs_body_and_continues(caplog: pytest.LogCaptureFixture) -> None:
    body = "out of order sample " + "x" * 2000
    async with Receiver([Reply(400, body)]) as rx:
        cfg = EndpointConfig(rx.url, queue=FAST)
        writer, m = await running(cfg)
        series = make_series(2)
        with caplog.at_level(logging.ERROR, "hfsampler.remote_write"):
            writer.push(snap(series, 1000))
            await eventually(lambda: m.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 2)
        writer.push(snap(series, 2000))
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    assert [r.status for r in rx.received] == [400, 204]
    assert {ts for _, ts, _ in rx.accepted()} == {2000}
    assert m.total(sm.RW_RETRIES) == 0
    assert m.get(sm.RW_REQUESTS, labels_of(cfg, status="400")) == 1
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "HTTP 400: out of order sample xxx" in logged
    assert "x" * 600 not in logged


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connection_refused_is_retried_and_secrets_stay_out_of_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    url = f"http://alice:hunter2@127.0.0.1:{port}/api/v1/write?token=s3cr3t"
    cfg = EndpointConfig(url, queue=FAST)
    with caplog.at_level(logging.DEBUG):
        writer, m = await running(cfg)
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: m.get(sm.RW_REQUESTS, labels_of(cfg, status="error")) >= 2)
        assert m.total(sm.RW_RETRIES) >= 2
        async with Receiver(port=port) as rx:
            await eventually(lambda: len(rx.accepted()) == 2)
            assert rx.received[0].headers["Authorization"].startswith("Basic ")
            await writer.close(5)
    ours = [r for r in caplog.records if r.name.startswith("hfsampler")]
    assert ours
    for record in ours:
        text = record.getMessage()
        assert "hunter2" not in text
        assert "s3cr3t" not in text
    for _, key, _ in m.samples():
        assert "hunter2" not in str(key)
        assert "s3cr3t" not in str(key)


async def test_receiver_slower_than_remote_timeout_is_retried() -> None:
    async with Receiver([Reply(hang=True)]) as rx:
        cfg = EndpointConfig(rx.url, remote_timeout_s=0.2, queue=FAST)
        writer, m = await running(cfg)
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    assert m.get(sm.RW_REQUESTS, labels_of(cfg, status="timeout")) == 1
    assert m.total(sm.RW_RETRIES) == 1


async def test_protocol_headers_present_and_not_overridable() -> None:
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, headers={"X-Scope-OrgID": "gpu"}, queue=FAST)
        # Config refuses these; force them in to prove the sender still wins.
        object.__setattr__(
            cfg, "headers", {"X-Scope-OrgID": "gpu", "User-Agent": "evil", "Content-Type": "x/y"}
        )
        writer, _ = await running(cfg)
        writer.push(snap(make_series(1), 1000))
        await eventually(lambda: len(rx.accepted()) == 1)
        await writer.close(5)
    h = rx.received[0].headers
    assert h["Content-Encoding"] == "snappy"
    assert h["Content-Type"] == "application/x-protobuf"
    assert h["X-Prometheus-Remote-Write-Version"] == "0.1.0"
    assert h["User-Agent"] == f"hfsampler/{hfsampler.__version__}"
    assert h["X-Scope-OrgID"] == "gpu"


async def test_per_series_order_kept_across_shards_and_retries() -> None:
    script = [Reply(503), Reply(204), Reply(503), Reply(500), Reply(204), Reply(503)]
    async with Receiver(script) as rx:
        queue = replace(FAST, min_shards=4, max_shards=4, max_samples_per_send=7)
        cfg = EndpointConfig(rx.url, queue=queue)
        writer, m = await running(cfg)
        assert writer.n_shards == 4
        series = make_series(16)
        for t in range(20):
            writer.push(snap(series, 1000 * (t + 1), base=t))
        await eventually(lambda: len(rx.accepted()) == 16 * 20)
        await writer.close(5)
    by_series: dict[str, list[int]] = {}
    for key, ts, _ in rx.accepted():
        by_series.setdefault(key, []).append(ts)
    assert len(by_series) == 16
    for stamps in by_series.values():
        assert stamps == [1000 * (t + 1) for t in range(20)]
    assert m.total(sm.RW_DROPPED) == 0


async def test_a_replaced_writer_hands_its_queue_over_in_order() -> None:
    """A reload replaces an endpoint's writer mid-send: the request on the wire is answered
    first, a batch retrying in an outage stops at its retry, and the new writer sends what is
    left before anything newer: every sample once, each series in order, nothing dropped."""
    async with Receiver([Reply(204), *[Reply(503)] * 1000]) as rx:
        rx.delay_s = 0.3  # the first request is on the wire when the handover starts
        queue = replace(FAST, min_shards=2, max_shards=2, max_samples_per_send=4)
        cfg = EndpointConfig(rx.url, name="t", queue=queue)
        old, m = await running(cfg)
        series = make_series(6)
        for t in range(5):
            old.push(snap(series, 1000 * (t + 1), base=t))
        await eventually(lambda: len(rx.received) >= 1)
        left = await old.hand_over(5.0)
        assert rx.received[0].status == 204  # answered, not abandoned
        assert sum(b.samples for blocks in left for b in blocks) == 6 * 5 - len(rx.accepted())
        rx.script.clear()
        rx.delay_s = 0.0
        new = RemoteWriter(replace(cfg, remote_timeout_s=7.0), m)
        await new.start()
        new.take_over(left)
        for t in range(5, 8):
            new.push(snap(series, 1000 * (t + 1), base=t))
        await eventually(lambda: len(rx.accepted()) == 6 * 8)
        await new.close(5)
    by_series: dict[str, list[int]] = {}
    for key, ts, _ in rx.accepted():
        by_series.setdefault(key, []).append(ts)
    for stamps in by_series.values():
        assert stamps == [1000 * (t + 1) for t in range(8)]
    assert m.total(sm.RW_DROPPED) == 0


async def test_queue_full_drops_oldest_and_counts() -> None:
    cfg = EndpointConfig("http://127.0.0.1:1/w", queue=replace(FAST, capacity=10))
    m = SelfMetrics()
    writer = RemoteWriter(cfg, m)
    series = make_series(5)
    for t in range(5):
        writer.push(snap(series, 1000 + t))
    assert m.get(sm.RW_DROPPED, labels_of(cfg, reason="queue_full")) == 15
    assert m.get(sm.RW_QUEUE_SAMPLES, labels_of(cfg)) == 10
    async with Receiver() as rx:
        object.__setattr__(cfg, "url", rx.url)
        await writer.start()
        await eventually(lambda: len(rx.accepted()) == 10)
        await writer.close(5)
    assert {ts for _, ts, _ in rx.accepted()} == {1003, 1004}


async def test_close_flushes_before_batch_deadline() -> None:
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, queue=replace(FAST, batch_send_deadline_s=60.0))
        writer, m = await running(cfg)
        writer.push(snap(make_series(5), 1000))
        await writer.close(5)
        assert len(rx.accepted()) == 5
    assert m.total(sm.RW_DROPPED) == 0
    assert m.get(sm.RW_QUEUE_SAMPLES, labels_of(cfg)) == 0
    writer.push(snap(make_series(2), 2000))
    assert m.get(sm.RW_DROPPED, labels_of(cfg, reason="shutdown")) == 2


async def test_close_counts_unsent_as_shutdown_drops() -> None:
    async with Receiver([Reply(503)] * 1000) as rx:
        cfg = EndpointConfig(rx.url, queue=replace(FAST, max_samples_per_send=3))
        writer, m = await running(cfg)
        writer.push(snap(make_series(7), 1000))
        await eventually(lambda: len(rx.received) >= 2)
        started = time.monotonic()
        await writer.close(0.2)
        assert time.monotonic() - started < 2.0
    assert m.get(sm.RW_DROPPED, labels_of(cfg, reason="shutdown")) == 7
    assert m.total(sm.RW_SAMPLES) == 0


async def test_metadata_and_stale_markers() -> None:
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, queue=FAST)
        writer, _ = await running(cfg)
        series = make_series(2)
        fams = {"DCGM_FI_DEV_POWER_USAGE": Family("DCGM_FI_DEV_POWER_USAGE", "Power (W).", "gauge")}
        writer.push(Snapshot(1000, series, [1.0, STALE_NAN], fams))
        await eventually(lambda: len(rx.accepted()) == 2)
        writer.push(Snapshot(2000, series, [2.0, 3.0], fams))
        await eventually(lambda: len(rx.accepted()) == 4)
        await writer.close(5)
    first, second = rx.received[0].request, rx.received[1].request
    assert [md.metric_family_name for md in first.metadata] == ["DCGM_FI_DEV_POWER_USAGE"]
    assert list(second.metadata) == []
    assert is_stale(first.timeseries[1].samples[0].value)


async def test_metadata_of_a_family_first_seen_later_goes_out_then() -> None:
    """A replay meets its families batch by batch: each family's metadata goes out once, with
    the first push that has it, not only with the very first push."""
    power = Family("DCGM_FI_DEV_POWER_USAGE", "Power (W).", "gauge")
    temp = Family("DCGM_FI_DEV_GPU_TEMP", "Temperature (C).", "gauge")
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, queue=FAST)
        writer, _ = await running(cfg)
        series = make_series(1)
        writer.push(Snapshot(1000, series, [1.0], {power.name: power}))
        await eventually(lambda: len(rx.accepted()) == 1)
        writer.push(Snapshot(2000, series, [2.0], {power.name: power, temp.name: temp}))
        await eventually(lambda: len(rx.accepted()) == 2)
        writer.push(Snapshot(3000, series, [3.0], {power.name: power, temp.name: temp}))
        await eventually(lambda: len(rx.accepted()) == 3)
        await writer.close(5)
    sent = [[md.metric_family_name for md in r.request.metadata] for r in rx.received]
    assert sent == [[power.name], [temp.name], []]


async def test_large_batches_encode_in_executor() -> None:
    async with Receiver() as rx:
        cfg = EndpointConfig(rx.url, queue=replace(FAST, max_samples_per_send=500))
        writer, _ = await running(cfg)
        writer.delivery.executor_threshold = 100
        series = make_series(400)
        for t in range(3):
            writer.push(snap(series, 1000 * (t + 1)))
        await eventually(lambda: len(rx.accepted()) == 1200)
        await writer.close(5)


def test_parse_retry_after() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("5", lambda: now) == 5.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    date = "Tue, 14 Nov 2023 22:13:40 GMT"  # now + 20 s
    assert parse_retry_after(date, lambda: now) == pytest.approx(20.0)
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:00 GMT", lambda: now) == 0.0


@pytest.mark.parametrize(
    "scenario",
    [
        test_503_then_204_resends_the_same_samples,
        test_receiver_slower_than_remote_timeout_is_retried,
        test_per_series_order_kept_across_shards_and_retries,
        test_a_replaced_writer_hands_its_queue_over_in_order,
        test_queue_full_drops_oldest_and_counts,
        test_close_flushes_before_batch_deadline,
    ],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_on_uvloop(scenario: Callable[[], Awaitable[None]]) -> None:
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(scenario())

"""Sender: one ``RemoteWriter`` per endpoint, pushing queued samples over HTTP as the spec says.

Each series always lands in the same shard (``series.id % n_shards``) and each shard has one
request in flight, so per-series order is kept. Failures the spec calls recoverable (network
errors, timeouts, 5xx, 429) are retried with jittered exponential backoff honouring
``Retry-After`` (Mimir's 529 counts as a 429); any other 4xx (Thanos's 409 for out-of-order and
duplicate samples included) drops that batch and moves on. With a ``queue_dir`` each shard's queue
is a ``SpoolQueue`` and a batch leaves it only once the receiver answered; without one, a
``MemoryQueue``. Per endpoint, ``write_relabel_configs`` run once per series (cached), and auth,
TLS and proxy settings apply to every request; secrets never reach a log line or a metric.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC
from functools import partial
from pathlib import Path
from typing import TypeVar

import aiohttp
import snappy

import hfsampler
from hfsampler.errors import (
    NonRecoverableSendError,
    RecoverableSendError,
    RequestTooLargeError,
)
from hfsampler.remote_write import wire
from hfsampler.remote_write.config import EndpointConfig
from hfsampler.remote_write.encoder import Encoder, QueuedSample, compress, encode_metadata
from hfsampler.remote_write.queue import Batch, MemoryQueue, ShardQueue
from hfsampler.remote_write.relabel import apply as relabel
from hfsampler.remote_write.security import AuthHeader, TLSSendError, ssl_context
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Series, SeriesRegistry, Snapshot

log = logging.getLogger(__name__)
_T = TypeVar("_T")

SAMPLES = "hfsampler_remote_write_samples_total"
BYTES = "hfsampler_remote_write_bytes_total"
COMPRESSED_BYTES = "hfsampler_remote_write_compressed_bytes_total"
REQUESTS = "hfsampler_remote_write_requests_total"
RETRIES = "hfsampler_remote_write_retries_total"
DROPPED = "hfsampler_remote_write_samples_dropped_total"
SEND_DURATION = "hfsampler_remote_write_send_duration_seconds"
QUEUE_SAMPLES = "hfsampler_remote_write_queue_samples"
QUEUE_DISK_BYTES = "hfsampler_remote_write_queue_disk_bytes"
# Statuses retried like 429 when retry_on_http_429 is on: Mimir's "too many requests" variant.
RATE_LIMIT_STATUSES = frozenset((429, 529))

# Above this many samples a batch is encoded and compressed in a thread, off the event loop.
EXECUTOR_THRESHOLD_SAMPLES = 10_000
# How much of a receiver's error body goes into the log.
BODY_LOG_LIMIT = 512

PROTOCOL_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": f"hfsampler/{hfsampler.__version__}",
}


def define_metrics(metrics: SelfMetrics) -> None:
    """Define every Remote-Write self-metric; safe to call more than once."""
    metrics.define(SAMPLES, "Samples accepted by the receiver.", "counter")
    metrics.define(BYTES, "Uncompressed protobuf bytes accepted by the receiver.", "counter")
    metrics.define(COMPRESSED_BYTES, "Snappy-compressed bytes accepted by the receiver.", "counter")
    metrics.define(REQUESTS, "Requests by HTTP status, or error/timeout.", "counter")
    metrics.define(RETRIES, "Requests retried after a recoverable failure.", "counter")
    metrics.define(DROPPED, "Samples never delivered, by reason.", "counter")
    metrics.define(SEND_DURATION, "Latency of the last request.", "gauge")
    metrics.define(QUEUE_SAMPLES, "Samples waiting in the queue.", "gauge")
    metrics.define(QUEUE_DISK_BYTES, "Bytes of the persistent queue's segment files.", "gauge")


def spool_dir(queue_dir: Path, config: EndpointConfig) -> Path:
    """Where an endpoint's segments live: stable across restarts, safe as a file name."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", config.remote_name)[:64]
    return queue_dir / safe


def parse_retry_after(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """``Retry-After`` as seconds from now (delta-seconds or HTTP-date); None when absent/bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now())


def backoff_delay(backoff_s: float) -> float:
    """Jittered delay: between 75% and 100% of the current backoff, so shards spread out."""
    return backoff_s * (0.75 + 0.25 * random.random())


class RemoteWriter:
    """Pushes snapshots to one Remote-Write endpoint."""

    def __init__(
        self, config: EndpointConfig, metrics: SelfMetrics, queue_dir: Path | None = None
    ) -> None:
        define_metrics(metrics)
        self.config = config
        self.executor_threshold = EXECUTOR_THRESHOLD_SAMPLES
        self._metrics = metrics
        self._labels = {"remote_name": config.remote_name, "url": config.display_url}
        self._encoder = Encoder()
        self._n_shards = config.queue.min_shards
        self._queues: list[ShardQueue]
        if queue_dir is None:
            self._queues = [MemoryQueue(config.queue.capacity) for _ in range(self._n_shards)]
        else:
            base = spool_dir(queue_dir, config)
            self._queues = [
                SpoolQueue(
                    base / f"shard-{i}",
                    config.queue.capacity,
                    max(config.queue.max_disk_bytes // self._n_shards, 1 << 16),
                    self._encoder,
                    self._drop,
                )
                for i in range(self._n_shards)
            ]
        self._inflight: list[Batch | None] = [None] * self._n_shards
        # Protocol headers last: a user header can never replace them.
        self._headers = {**config.headers, **PROTOCOL_HEADERS}
        self._auth = AuthHeader(config.auth) if config.auth is not None else None
        self._ssl: ssl.SSLContext | None = None
        if config.tls is not None and config.url.startswith("https:"):
            self._ssl = ssl_context(config.tls)
        # Relabelled series get ids of their own, so the encoder's label cache stays per series.
        self._relabelled: dict[int, Series | None] = {}
        self._relabel_registry = SeriesRegistry()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._metadata_pending = b""
        self._metadata_done = not config.send_metadata
        self._closed = False

    @property
    def n_shards(self) -> int:
        return self._n_shards

    def queued(self) -> int:
        """Samples waiting in every shard's queue (not counting batches in flight)."""
        return sum(len(q) for q in self._queues)

    async def start(self) -> None:
        """Open the HTTP session and start one task per shard."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(limit=self._n_shards, ssl=self._ssl or True)
        self._session = aiohttp.ClientSession(connector=connector)
        self._tasks = [
            asyncio.create_task(self._run_shard(i), name=f"rw-{self.config.remote_name}-{i}")
            for i in range(self._n_shards)
        ]

    def push(self, snapshot: Snapshot) -> None:
        """Queue a snapshot's samples; never blocks. Full queues drop their oldest samples."""
        if self._closed:
            self._drop(len(snapshot), "shutdown")
            return
        if not self._metadata_done and snapshot.families:
            self._metadata_pending = encode_metadata(snapshot.families.values())
            self._metadata_done = True
        ts = snapshot.timestamp_ms
        n = self._n_shards
        dropped = 0
        pairs = zip(snapshot.series, snapshot.values, strict=True)
        if self.config.relabel:
            pairs = ((r, v) for s, v in pairs if (r := self._relabel(s)) is not None)  # type: ignore[assignment]
        if n == 1:
            dropped = self._queues[0].put([QueuedSample(s, v, ts) for s, v in pairs])
        else:
            buckets: list[list[QueuedSample]] = [[] for _ in range(n)]
            for s, v in pairs:
                buckets[s.id % n].append(QueuedSample(s, v, ts))
            for q, bucket in zip(self._queues, buckets, strict=True):
                if bucket:
                    dropped += q.put(bucket)
        if dropped:
            self._drop(dropped, "queue_full")
        self._metrics.set(QUEUE_SAMPLES, self.queued(), self._labels)

    def _relabel(self, series: Series) -> Series | None:
        """The series as this endpoint sends it, or None when a rule drops it (cached)."""
        try:
            return self._relabelled[series.id]
        except KeyError:
            pass
        labels = relabel(self.config.relabel, {"__name__": series.name, **dict(series.labels)})
        out = None
        if labels is not None:
            name = labels.pop("__name__")
            out = self._relabel_registry.series(name, labels)
        self._relabelled[series.id] = out
        return out

    def disk_bytes(self) -> int:
        """Bytes of spooled segments (0 without a queue_dir)."""
        return sum(q.disk_bytes for q in self._queues if isinstance(q, SpoolQueue))

    async def close(self, deadline_s: float) -> None:
        """Send what is queued within ``deadline_s``, then stop; the rest counts as dropped."""
        self._closed = True
        for q in self._queues:
            q.start_flush()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=max(0.0, deadline_s))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        left = 0
        for q, batch in zip(self._queues, self._inflight, strict=True):
            left += await q.close()
            if batch is not None and not q.persistent:
                left += batch.count  # a spooled batch stays on disk until acknowledged
        self._inflight = [None] * self._n_shards
        if left:
            log.warning(
                "remote write %s (%s): dropping %d samples not sent before shutdown",
                self.config.remote_name,
                self.config.display_url,
                left,
            )
            self._drop(left, "shutdown")
        self._metrics.set(QUEUE_SAMPLES, 0, self._labels)
        if self.disk_bytes():
            log.info(
                "remote write %s: %d bytes stay spooled for the next start",
                self.config.remote_name,
                self.disk_bytes(),
            )
        if self._session is not None:
            await self._session.close()
        self._tasks = []

    def _drop(self, count: int, reason: str) -> None:
        self._metrics.inc(DROPPED, count, {**self._labels, "reason": reason})

    async def _run_shard(self, index: int) -> None:
        queue = self._queues[index]
        qc = self.config.queue
        while True:
            batch = await queue.get_batch(qc.max_samples_per_send, qc.batch_send_deadline_s)
            self._metrics.set(QUEUE_SAMPLES, self.queued(), self._labels)
            self._metrics.set(QUEUE_DISK_BYTES, self.disk_bytes(), self._labels)
            if not batch.count:
                return
            self._inflight[index] = batch
            try:
                await self._send_batch(batch)
            except Exception:
                # A bug must not silently stop the shard: count the batch and keep going.
                log.exception("remote write %s: unexpected error", self.config.remote_name)
                self._drop(len(batch), "error")
            queue.ack(batch)
            self._inflight[index] = None

    def _prepare(self, batch: Batch, metadata: bytes) -> list[_Request]:
        """The batch as requests of at most ``max_request_bytes`` uncompressed, compressed."""
        limit = self.config.queue.max_request_bytes
        if not batch.samples and len(batch.parts) == 1 and not metadata:
            # One spooled record is already a compressed WriteRequest: send it as it is.
            body = batch.parts[0]
            raw_len = snappy_uncompressed_length(body)
            if raw_len <= limit:
                return [_Request(body, raw_len, batch.count)]
        raw = b"".join(snappy.uncompress(p) for p in batch.parts)
        if batch.samples:
            raw += self._encoder.encode_samples(batch.samples)
        raw += metadata
        chunks = wire.split(raw, limit)
        if len(chunks) == 1:
            return [_Request(compress(raw), len(raw), batch.count)]
        return [_Request.of(c) for c in chunks]

    async def _off_loop(self, work: Callable[[], _T], large: bool) -> _T:
        if not large:
            return work()
        return await asyncio.get_running_loop().run_in_executor(None, work)

    async def _send_batch(self, batch: Batch) -> None:
        metadata, self._metadata_pending = self._metadata_pending, b""
        large = len(batch) > self.executor_threshold or len(batch.parts) > 1
        requests = await self._off_loop(partial(self._prepare, batch, metadata), large)
        for request in requests:
            await self._send_request(request)

    async def _send_request(self, request: _Request) -> None:
        """Send until delivered; a 413 splits the request in two, down to one series."""
        try:
            await self._deliver(request)
        except RequestTooLargeError as err:
            raw = await self._off_loop(
                partial(snappy.uncompress, request.body), request.raw_len > 1 << 20
            )
            halves = wire.halve(raw)
            if halves is None:
                log.error(
                    "remote write %s (%s) refused one series of %d samples (%d bytes) as too "
                    "large, dropping it: %s",
                    self.config.remote_name,
                    self.config.display_url,
                    request.samples,
                    request.raw_len,
                    err,
                )
                self._drop(request.samples, "too_large")
                return
            log.info(
                "remote write %s: HTTP 413 for %d bytes; sending it as two requests",
                self.config.remote_name,
                request.raw_len,
            )
            for half in halves:
                part = await self._off_loop(partial(_Request.of, half), len(half) > 1 << 20)
                await self._send_request(part)

    async def _deliver(self, request: _Request) -> None:
        """Post one request, retrying what the spec calls recoverable."""
        qc = self.config.queue
        backoff = qc.min_backoff_s
        while True:
            try:
                await self._post(request.body, request.samples)
            except RecoverableSendError as err:
                if isinstance(err, TLSSendError):
                    # A certificate problem will not fix itself in milliseconds: wait the most.
                    backoff = qc.max_backoff_s
                delay = backoff_delay(backoff)
                if err.retry_after_s is not None:
                    delay = err.retry_after_s
                self._metrics.inc(RETRIES, 1, self._labels)
                log.warning(
                    "remote write %s (%s): %s; retrying in %.3f s",
                    self.config.remote_name,
                    self.config.display_url,
                    err,
                    delay,
                )
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, qc.max_backoff_s)
                continue
            except RequestTooLargeError:
                raise
            except NonRecoverableSendError:
                self._drop(request.samples, "rejected")
                return
            self._metrics.inc(SAMPLES, request.samples, self._labels)
            self._metrics.inc(BYTES, request.raw_len, self._labels)
            self._metrics.inc(COMPRESSED_BYTES, len(request.body), self._labels)
            return

    async def _post(self, body: bytes, n_samples: int) -> None:
        session = self._session
        assert session is not None, "start() was not awaited"
        timeout = aiohttp.ClientTimeout(total=self.config.remote_timeout_s)
        headers = self._headers
        if self._auth is not None:
            headers = {**headers, "Authorization": self._auth.value()}
        tls = self.config.tls
        started = time.monotonic()
        try:
            async with session.post(
                self.config.url,
                data=body,
                headers=headers,
                timeout=timeout,
                proxy=self.config.proxy_url or None,
                server_hostname=(tls.server_name or None) if tls is not None else None,
            ) as resp:
                status = resp.status
                self._count_request(str(status))
                if 200 <= status < 300:
                    await resp.read()
                    return
                text = (await resp.content.read(BODY_LOG_LIMIT)).decode("utf-8", "replace")
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
        except TimeoutError:
            self._count_request("timeout")
            raise RecoverableSendError(
                f"no answer within remote_timeout {self.config.remote_timeout_s} s"
            ) from None
        except aiohttp.ClientConnectorCertificateError as err:
            self._count_request("error")
            cert = err.certificate_error
            reason = getattr(cert, "verify_message", None) or getattr(cert, "reason", None)
            raise TLSSendError(
                f"TLS certificate not trusted: {reason or type(cert).__name__} "
                "(check tls_config.ca_file and server_name)",
            ) from None
        except aiohttp.ClientSSLError as err:
            self._count_request("error")
            reason = getattr(getattr(err, "os_error", None), "reason", None)
            raise TLSSendError(
                f"TLS handshake failed: {reason or type(err).__name__} "
                "(check tls_config: client certificate, CA)",
            ) from None
        except aiohttp.ClientError as err:
            self._count_request("error")
            tls_error = _ssl_error(err)
            if tls_error is not None:
                # TLS 1.3 refuses a missing client certificate only after the handshake.
                raise TLSSendError(
                    f"TLS refused: {tls_error.reason or type(tls_error).__name__} "
                    "(check tls_config: client certificate, CA)"
                ) from None
            # Only the class and OS reason: aiohttp's own text may quote the URL with credentials.
            reason = getattr(getattr(err, "os_error", None), "strerror", None)
            raise RecoverableSendError(
                f"{type(err).__name__}{f': {reason}' if reason else ''}"
            ) from None
        finally:
            self._metrics.set(SEND_DURATION, time.monotonic() - started, self._labels)
        rate_limited = status in RATE_LIMIT_STATUSES and self.config.queue.retry_on_http_429
        if rate_limited or (status >= 500 and status not in RATE_LIMIT_STATUSES):
            raise RecoverableSendError(f"HTTP {status}: {text}", retry_after)
        if status == 413:
            raise RequestTooLargeError(f"HTTP 413: {text}", status)
        log.error(
            "remote write %s (%s) refused %d samples, not retrying: HTTP %d: %s",
            self.config.remote_name,
            self.config.display_url,
            n_samples,
            status,
            text,
        )
        raise NonRecoverableSendError(f"HTTP {status}", status)

    def _count_request(self, status: str) -> None:
        self._metrics.inc(REQUESTS, 1, {**self._labels, "status": status})


@dataclass(frozen=True, slots=True)
class _Request:
    """One HTTP request's body (snappy-compressed), its uncompressed size and sample count."""

    body: bytes
    raw_len: int
    samples: int

    @classmethod
    def of(cls, raw: bytes) -> _Request:
        """A request for ``raw`` WriteRequest bytes, its samples counted from the bytes."""
        return cls(compress(raw), len(raw), wire.count_samples(raw))


def _ssl_error(err: BaseException) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` behind an aiohttp error, if one is in its chain."""
    seen: BaseException | None = err
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        nested = getattr(seen, "os_error", None)
        seen = nested if isinstance(nested, BaseException) else (seen.__cause__ or seen.__context__)
    return None


def snappy_uncompressed_length(body: bytes) -> int:
    """The uncompressed size a snappy block declares in its varint preamble."""
    value = shift = 0
    for byte in body[:5]:
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return value

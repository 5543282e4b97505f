"""Sender: one ``RemoteWriter`` per endpoint, from snapshots to delivered requests.

``push`` relabels a snapshot's series (``write_relabel_configs``, once per series), assigns each
to its shard (``series.id % n_shards``, so per-series order is kept) and queues one ``Block`` per
shard; the blocks' bytes are encoded on the writer's own thread (``BlockEncoder``), never on
the event loop. Each shard has one request in flight: it takes a batch of blocks from its
queue, concatenates and compresses them (in an executor when large) into requests of at most
``max_request_bytes``, and delivers each through the ``RemoteClient`` under the retry policy
(``retry.py``): recoverable failures are retried with backoff, a 413 splits the request in two,
any other refusal drops it, counted. With a ``queue_dir`` each shard's queue is a
``SpoolQueue`` and a batch leaves it only once the receiver answered; without one, a
``MemoryQueue``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from hfsampler import selfmetrics as sm
from hfsampler.errors import NonRecoverableSendError, RecoverableSendError, RequestTooLargeError
from hfsampler.remote_write import wire
from hfsampler.remote_write.client import RemoteClient
from hfsampler.remote_write.config import EndpointConfig
from hfsampler.remote_write.encoder import BlockEncoder, QueuedSample, compress
from hfsampler.remote_write.encoder import encode_metadata as encode_metadata
from hfsampler.remote_write.queue import Batch, MemoryQueue, ShardQueue
from hfsampler.remote_write.relabel import Relabeller
from hfsampler.remote_write.retry import Backoff
from hfsampler.remote_write.retry import parse_retry_after as parse_retry_after
from hfsampler.remote_write.security import TLSSendError
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Series, Snapshot, is_stale

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# The self-metrics this module counts, by their short names (tests and tools import them).
SAMPLES = sm.RW_SAMPLES
BYTES = sm.RW_BYTES
COMPRESSED_BYTES = sm.RW_COMPRESSED_BYTES
REQUESTS = sm.RW_REQUESTS
RETRIES = sm.RW_RETRIES
DROPPED = sm.RW_DROPPED
SEND_DURATION = sm.RW_SEND_DURATION
QUEUE_SAMPLES = sm.RW_QUEUE_SAMPLES
QUEUE_DISK_BYTES = sm.RW_QUEUE_DISK_BYTES

# Above this many samples a batch is concatenated and compressed in a thread, off the event loop.
EXECUTOR_THRESHOLD_SAMPLES = 10_000
# Above this many bytes a 413's halves are compressed in a thread.
EXECUTOR_THRESHOLD_BYTES = 1 << 20


def spool_dir(queue_dir: Path, config: EndpointConfig) -> Path:
    """Where an endpoint's segments live: stable across restarts, safe as a file name."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", config.remote_name)[:64]
    return queue_dir / safe


@dataclass(frozen=True, slots=True)
class _Request:
    """One HTTP request: its uncompressed bytes, their snappy compression, the samples in it."""

    raw: bytes
    body: bytes
    samples: int

    @classmethod
    def of(cls, raw: bytes, samples: int | None = None) -> _Request:
        """A request for ``raw`` WriteRequest bytes (samples counted from them unless given)."""
        return cls(raw, compress(raw), wire.count_samples(raw) if samples is None else samples)


class RemoteWriter:
    """Pushes snapshots to one Remote-Write endpoint."""

    def __init__(
        self, config: EndpointConfig, metrics: SelfMetrics, queue_dir: Path | None = None
    ) -> None:
        self.config = config
        self.executor_threshold = EXECUTOR_THRESHOLD_SAMPLES
        self._metrics = metrics
        self._labels = {"remote_name": config.remote_name, "url": config.display_url}
        self._blocks = BlockEncoder(f"rw-encode-{config.remote_name}")
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
                    self._drop,
                )
                for i in range(self._n_shards)
            ]
        self._inflight: list[Batch | None] = [None] * self._n_shards
        self._client = RemoteClient(config, metrics, self._n_shards)
        self._relabeller = Relabeller(config.relabel) if config.relabel else None
        self._tasks: list[asyncio.Task[None]] = []
        self._metadata_done = not config.send_metadata
        self._started = False
        self._closed = False

    @property
    def n_shards(self) -> int:
        return self._n_shards

    def queued(self) -> int:
        """Samples waiting in every shard's queue (not counting batches in flight)."""
        return sum(len(q) for q in self._queues)

    def disk_bytes(self) -> int:
        """Bytes of spooled segments (0 without a queue_dir)."""
        return sum(q.disk_bytes for q in self._queues)

    async def start(self) -> None:
        """Open the HTTP session and start one task per shard."""
        if self._started:
            return
        self._started = True
        self._client.open()
        self._tasks = [
            asyncio.create_task(self._run_shard(i), name=f"rw-{self.config.remote_name}-{i}")
            for i in range(self._n_shards)
        ]

    def push(self, snapshot: Snapshot) -> None:
        """Queue a snapshot's samples; never blocks. Full queues drop their oldest samples."""
        if self._closed:
            self._drop(len(snapshot), "shutdown")
            return
        metadata: Callable[[], bytes] | None = None
        if not self._metadata_done and snapshot.families:
            families = list(snapshot.families.values())
            metadata = partial(encode_metadata, families)
            self._metadata_done = True
        ts = snapshot.timestamp_ms
        n = self._n_shards
        buckets: list[list[QueuedSample]] = [[] for _ in range(n)]
        relabeller = self._relabeller
        for series, value in zip(snapshot.series, snapshot.values, strict=True):
            out: Series | None = series
            if relabeller is not None:
                out = relabeller.series(series)
                if value != value and is_stale(value):
                    relabeller.forget(series)  # it ends here: the cache must not keep it
            if out is not None:
                buckets[out.id % n if n > 1 else 0].append(QueuedSample(out, value, ts))
        step = self.config.queue.max_samples_per_send
        dropped = 0
        for queue, bucket in zip(self._queues, buckets, strict=True):
            for i in range(0, len(bucket), step):
                block = self._blocks.block(bucket[i : i + step], metadata)
                metadata = None  # once, in the first block
                dropped += queue.put(block)
        if dropped:
            self._drop(dropped, "queue_full")
        self._metrics.set(QUEUE_SAMPLES, self.queued(), self._labels)

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
        await self._client.close()
        self._blocks.close()
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
            if not batch.blocks:
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

    async def _off_loop(self, work: Callable[[], _T], large: bool) -> _T:
        if not large:
            return work()
        return await asyncio.get_running_loop().run_in_executor(None, work)

    async def _send_batch(self, batch: Batch) -> None:
        parts = [await block.data() for block in batch.blocks]
        large = len(batch) > self.executor_threshold or len(parts) > 1
        requests = await self._off_loop(partial(self._requests, parts, batch.count), large)
        for request in requests:
            await self._send_request(request)

    def _requests(self, parts: list[bytes], samples: int) -> list[_Request]:
        """The batch's blocks as requests of at most ``max_request_bytes`` uncompressed."""
        raw = b"".join(parts)
        chunks = wire.split(raw, self.config.queue.max_request_bytes)
        if len(chunks) == 1:
            return [_Request.of(raw, samples)]
        return [_Request.of(c) for c in chunks]

    async def _send_request(self, request: _Request) -> None:
        """Send until delivered; a 413 splits the request in two, down to one series."""
        try:
            await self._deliver(request)
        except RequestTooLargeError as err:
            halves = wire.halve(request.raw)
            if halves is None:
                log.error(
                    "remote write %s (%s) refused one series of %d samples (%d bytes) as too "
                    "large, dropping it: %s",
                    self.config.remote_name,
                    self.config.display_url,
                    request.samples,
                    len(request.raw),
                    err,
                )
                self._drop(request.samples, "too_large")
                return
            log.info(
                "remote write %s: HTTP 413 for %d bytes; sending it as two requests",
                self.config.remote_name,
                len(request.raw),
            )
            for half in halves:
                part = await self._off_loop(
                    partial(_Request.of, half), len(half) > EXECUTOR_THRESHOLD_BYTES
                )
                await self._send_request(part)

    async def _deliver(self, request: _Request) -> None:
        """Post one request, retrying what the spec calls recoverable."""
        qc = self.config.queue
        backoff = Backoff(qc.min_backoff_s, qc.max_backoff_s)
        while True:
            try:
                await self._client.post(request.body, request.samples)
            except RecoverableSendError as err:
                delay = backoff.next_delay(err.retry_after_s, slowest=isinstance(err, TLSSendError))
                self._metrics.inc(RETRIES, 1, self._labels)
                log.warning(
                    "remote write %s (%s): %s; retrying in %.3f s",
                    self.config.remote_name,
                    self.config.display_url,
                    err,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            except RequestTooLargeError:
                raise
            except NonRecoverableSendError:
                self._drop(request.samples, "rejected")
                return
            self._metrics.inc(SAMPLES, request.samples, self._labels)
            self._metrics.inc(BYTES, len(request.raw), self._labels)
            self._metrics.inc(COMPRESSED_BYTES, len(request.body), self._labels)
            return

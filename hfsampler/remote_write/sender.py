"""Sender: one ``RemoteWriter`` per endpoint, from snapshots to delivered requests.

``push`` relabels a snapshot's series (``write_relabel_configs``, once per series), assigns each
to its shard (``series.id % n_shards``, so per-series order is kept) and queues one ``Block`` per
shard; the blocks' bytes are encoded on the writer's own thread (``BlockEncoder``), never on
the event loop. Each shard has one request in flight: it takes a batch of blocks from its
queue, concatenates and compresses them (in an executor when large) into requests of at most
``max_request_bytes``, and delivers each through the ``RemoteClient`` under the retry policy
(``retry.py``): recoverable failures are retried with backoff, a 413 splits the request in two
(down to one series; no piece as large as a series refused alone is sent again in that batch),
any other refusal drops it, counted; retries and refusals are logged as ``Episode`` says. With a
``queue_dir`` each shard's queue is a ``SpoolQueue`` and a batch leaves it only once the
receiver answered, whatever error the sending met; without one, a ``MemoryQueue``.

With ``protobuf_message: io.prometheus.write.v2.Request`` each request goes as 2.0
(``encoder_v2``), negotiated as the 2.0 spec asks: a 415, a 400 that names the content type,
or a 2xx without ``X-Prometheus-Remote-Write-Samples-Written`` (a 1.x receiver that decoded an
empty message and stored nothing) sends the same request again as 1.0 and keeps the endpoint on
1.0 for ``REPROBE_S``, logged once and counted. Blocks are 1.0 bytes in every queue, so a
fallback needs nothing but the blocks, spooled ones included.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

from hfsampler import selfmetrics as sm
from hfsampler.errors import NonRecoverableSendError, RecoverableSendError, RequestTooLargeError
from hfsampler.remote_write import wire
from hfsampler.remote_write.client import RemoteClient
from hfsampler.remote_write.config import MIN_MAX_REQUEST_BYTES, PROTOBUF_V2, EndpointConfig
from hfsampler.remote_write.encoder import (
    Block,
    BlockEncoder,
    QueuedSample,
    compress,
    encode_metadata,
    wait_done,
)
from hfsampler.remote_write.encoder_v2 import RequestEncoderV2
from hfsampler.remote_write.episode import Episode
from hfsampler.remote_write.queue import Batch, MemoryQueue, ShardQueue
from hfsampler.remote_write.relabel import Relabeller
from hfsampler.remote_write.retry import Backoff
from hfsampler.remote_write.security import TLSSendError
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Family, Series, Snapshot, is_stale

log = logging.getLogger(__name__)
_T = TypeVar("_T")


# Above this many samples a batch is concatenated and compressed in a thread, off the event loop.
EXECUTOR_THRESHOLD_SAMPLES = 10_000
# Threads for concatenating, cutting, compressing and 2.0-encoding large batches.
_CPU = ThreadPoolExecutor(4, thread_name_prefix="rw-cpu")
# Above this many bytes a 413's halves are compressed in a thread.
EXECUTOR_THRESHOLD_BYTES = 1 << 20
# After a fallback from 2.0, how long an endpoint stays on 1.0 before 2.0 is tried again.
REPROBE_S = 600.0
# Words by which a 400 says the receiver does not take the 2.0 message (Prometheus, Mimir).
_CONTENT_TYPE_WORDS = re.compile(r"content.?type|proto=|unsupported|unknown remote write", re.I)


def spool_dir(queue_dir: Path, config: EndpointConfig) -> Path:
    """Where an endpoint's segments live: stable across restarts, safe as a file name."""
    return queue_dir / config.spool_name


def orphan_spools(queue_dir: Path, endpoints: Sequence[EndpointConfig]) -> list[tuple[str, int]]:
    """Spool directories with segments that no configured endpoint reads, with their bytes: an
    endpoint removed or renamed (an unnamed one is named by its URL's hash)."""
    mine = {ep.spool_name for ep in endpoints}
    out: list[tuple[str, int]] = []
    if not queue_dir.is_dir():
        return out
    for d in sorted(queue_dir.iterdir()):
        if d.is_dir() and d.name not in mine:
            size = sum(f.stat().st_size for f in d.rglob("*.seg"))
            if size:
                out.append((d.name, size))
    return out


@dataclass(slots=True)
class _Request:
    """One HTTP request: its uncompressed 1.0 bytes, the samples in it, and its bodies."""

    raw: bytes
    samples: int
    body_v2: bytes = b""  # the same as a 2.0 request, compressed; b"" for a 1.0 endpoint
    raw_v2_len: int = 0
    _body: bytes | None = None

    @classmethod
    def of(
        cls, raw: bytes, samples: int | None = None, v2: RequestEncoderV2 | None = None
    ) -> _Request:
        """A request for ``raw`` WriteRequest bytes (samples counted from them unless given).

        For a 2.0 endpoint only the 2.0 body is compressed now; the 1.0 one when a fallback
        asks for it."""
        count = wire.count_samples(raw) if samples is None else samples
        if v2 is None:
            return cls(raw, count, _body=compress(raw))
        raw_v2 = v2.encode(raw)[0]
        return cls(raw, count, compress(raw_v2), len(raw_v2))

    def encode_v2(self, v2: RequestEncoderV2) -> None:
        """Make the 2.0 body now (a request built while the endpoint was on 1.0)."""
        raw_v2 = v2.encode(self.raw)[0]
        self.body_v2, self.raw_v2_len = compress(raw_v2), len(raw_v2)

    @property
    def body(self) -> bytes:
        """The 1.0 body, compressed."""
        if self._body is None:
            self._body = compress(self.raw)
        return self._body


@dataclass(slots=True)
class _Flight:
    """A shard's batch in flight: what of it is settled (delivered or dropped, counted)."""

    batch: Batch
    shard: int = 0
    settled: int = 0
    too_large_series: int = 0
    too_large_samples: int = 0
    too_large_other: int = 0  # metadata entries: no samples, refused even alone
    # the fewest bytes refused as too large in one series: a receiver that refuses everything
    # (413 to a series alone) is sent no piece as large again, not one request per series
    refused_alone: int = 0

    @property
    def unsettled(self) -> int:
        return self.batch.count - self.settled


class _HandedOver(Exception):
    """A shard stopped at a safe point so that its endpoint's next writer takes over."""


class _Negotiation:
    """Which protocol an endpoint gets now: 2.0 unless a fallback put it on 1.0 for a while."""

    def __init__(self, wants_v2: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.wants_v2 = wants_v2
        self._clock = clock
        self._v1_until = 0.0

    @property
    def v2(self) -> bool:
        return self.wants_v2 and self._clock() >= self._v1_until

    def fall_back(self) -> None:
        self._v1_until = self._clock() + REPROBE_S

    def reprobe(self) -> None:
        self._v1_until = 0.0


class RemoteWriter:
    """Pushes snapshots to one Remote-Write endpoint."""

    def __init__(
        self,
        config: EndpointConfig,
        metrics: SelfMetrics,
        queue_dir: Path | None = None,
        families: Mapping[str, Family] | None = None,
    ) -> None:
        """``families``: the metric families known before the first snapshot (the service's
        model), so that a spool replayed at start goes out as 2.0 with its metadata."""
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
                    on_disk_bytes=lambda _: self._metrics.set(
                        sm.RW_QUEUE_DISK_BYTES, self.disk_bytes(), self._labels
                    ),
                )
                for i in range(self._n_shards)
            ]
        self._inflight: list[_Flight | None] = [None] * self._n_shards
        # Lowered after a 413, so that later batches go in pieces the receiver takes at once.
        self._request_limit = config.queue.max_request_bytes
        self._client = RemoteClient(config, metrics, self._n_shards)
        self._relabeller = Relabeller(config.relabel) if config.relabel else None
        self._families: dict[str, Family] = dict(families or {})
        # a family renamed by write_relabel_configs keeps its metadata under its new name
        self._renamed: dict[str, Family] = {}
        self._negotiation = _Negotiation(config.protobuf_message == PROTOBUF_V2)
        self._outage = Episode("retries")
        self._refusals = Episode("refusals")
        self._v2 = (
            RequestEncoderV2(lambda: ChainMap(self._renamed, self._families), _start_ms)
            if self._negotiation.wants_v2
            else None
        )
        self._tasks: list[asyncio.Task[None]] = []
        # the families whose 1.0 metadata went out: each once, in the first push that has it
        # (a replay meets its families batch by batch)
        self._metadata_sent: set[str] | None = set() if config.send_metadata else None
        self._started = False
        self._closed = False
        # hand_over: shards stop before their next request; a request on the wire is awaited
        self._stopping = False
        self._posting = [False] * self._n_shards

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
        if self._v2 is not None and len(snapshot.families) != len(self._families):
            self._families.update(snapshot.families)
        if fresh := self._new_families(snapshot.families):
            metadata = partial(encode_metadata, fresh)
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
                if out.name != series.name and out.name not in self._renamed:
                    self._learn_rename(series.name, out.name)
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
        self._metrics.set(sm.RW_QUEUE_SAMPLES, self.queued(), self._labels)

    def _new_families(self, families: Mapping[str, Family]) -> list[Family]:
        """The families whose metadata has not gone out yet (none when metadata is off)."""
        sent = self._metadata_sent
        if sent is None or families.keys() <= sent:
            return []
        fresh = [f for name, f in families.items() if name not in sent]
        sent.update(f.name for f in fresh)
        return fresh

    def _learn_rename(self, old: str, new: str) -> None:
        """A relabelled name's 2.0 metadata: the original family's, under the new name (a name
        several families are renamed to takes the first one's)."""
        family = self._families.get(old)
        if family is not None and new not in self._families:
            self._renamed[new] = replace(family, name=new)

    def push_encoded(
        self, shard: int, data: bytes, samples: int, families: Mapping[str, Family]
    ) -> None:
        """Queue ``WriteRequest`` bytes encoded elsewhere (``arrays``, for ``replay --raw``)
        on one shard; the caller keeps each series on shard ``series.id % n_shards``, as
        ``push`` does, so its samples stay in order. Never relabelled: a writer with
        ``write_relabel_configs`` refuses (it would have to decode the bytes again)."""
        if self._relabeller is not None:
            raise ValueError("push_encoded bypasses write_relabel_configs")
        if self._closed:
            self._drop(samples, "shutdown")
            return
        if self._v2 is not None and len(families) != len(self._families):
            self._families.update(families)
        if fresh := self._new_families(families):
            data = encode_metadata(fresh) + data
        dropped = self._queues[shard].put(Block.ready(data, samples))
        if dropped:
            self._drop(dropped, "queue_full")
        self._metrics.set(sm.RW_QUEUE_SAMPLES, self.queued(), self._labels)

    async def close(
        self,
        deadline_s: float,
        stop: asyncio.Event | None = None,
        grace_s: float = 0.0,
        drop_reason: str = "shutdown",
    ) -> None:
        """Send what is queued within ``deadline_s``, then stop; the rest counts as dropped
        (``drop_reason``: ``shutdown``, or ``reload`` for an endpoint a reload replaced).

        Once ``stop`` is set (Ctrl-C during a long flush) at most ``grace_s`` more is waited."""
        self._closed = True
        for q in self._queues:
            q.start_flush()
        if self._tasks:
            loop = asyncio.get_running_loop()
            end = loop.time() + max(0.0, deadline_s)
            pending = set(self._tasks)
            while pending and (left := end - loop.time()) > 0:
                if stop is not None and stop.is_set():
                    end = min(end, loop.time() + grace_s)
                    stop = None
                    continue
                _, pending = await asyncio.wait(pending, timeout=min(left, 0.1))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        left = 0
        for q, flight in zip(self._queues, self._inflight, strict=True):
            left += await q.close()
            if flight is not None and not q.persistent:
                left += flight.unsettled  # a spooled batch stays on disk until acknowledged
        self._inflight = [None] * self._n_shards
        if left:
            log.warning(
                "remote write %s (%s): dropping %d samples not sent before %s",
                self.config.remote_name,
                self.config.display_url,
                left,
                drop_reason,
            )
            self._drop(left, drop_reason)
        self._metrics.set(sm.RW_QUEUE_SAMPLES, 0, self._labels)
        if self.disk_bytes():
            log.info(
                "remote write %s: %d bytes stay spooled for the next start",
                self.config.remote_name,
                self.disk_bytes(),
            )
        await self._client.close()
        self._blocks.close()
        self._tasks = []

    async def hand_over(self, deadline_s: float) -> list[list[Block]]:
        """Stop for the endpoint's next writer (a reload changed its configuration): what is
        not delivered yet, per shard and oldest first, for ``take_over``; nothing is dropped
        (but what a full disk kept a spool from writing, counted as at ``close``).

        No request on the wire is abandoned (its answer decides whether it was delivered, and
        ``remote_timeout`` bounds the wait), so nothing goes to the receiver twice or beside the
        next writer's newer samples. A shard stops before its batch's first request or at a
        retry of it; a batch partly delivered (split by a 413) is finished first, for
        ``deadline_s`` at most, then handed over whole, said in a warning. With a
        ``queue_dir`` what is left stays spooled, unacknowledged, and the lists are empty."""
        self._closed = self._stopping = True
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, deadline_s)
        pending = set(self._tasks)
        while pending:
            late = loop.time() >= end
            for i, task in enumerate(self._tasks):
                flight = self._inflight[i]
                partial = flight is not None and flight.settled > 0
                if task in pending and not self._posting[i] and (late or not partial):
                    task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.05)
        left: list[list[Block]] = []
        twice = lost = 0
        for q, flight in zip(self._queues, self._inflight, strict=True):
            blocks: list[Block] = []
            if flight is not None and flight.unsettled:
                twice += flight.settled
                if not q.persistent:  # a spooled batch is still on disk, unacknowledged
                    blocks += flight.batch.blocks
            if not q.persistent:
                q.start_flush()
                while len(q):
                    blocks += (await q.get_batch(len(q), 0.0)).blocks
            lost += await q.close()  # a spool's records it could not write (a full disk)
            left.append(blocks)
        if lost:
            self._drop(lost, "reload")
        if twice:
            log.warning(
                "remote write %s (%s): a batch partly delivered when the endpoint's writer was "
                "replaced goes again in full: %d samples may reach the receiver twice",
                self.config.remote_name,
                self.config.display_url,
                twice,
            )
        self._inflight = [None] * self._n_shards
        self._metrics.set(sm.RW_QUEUE_SAMPLES, 0, self._labels)
        await self._client.close()
        self._blocks.close()
        self._tasks = []
        return left

    def take_over(self, left: Sequence[Sequence[Block]]) -> None:
        """Queue what the endpoint's previous writer left (``hand_over``) ahead of anything
        newer; call before the first ``push``. Needs the same number of shards, or one."""
        if not any(left):
            return
        if len(left) != self._n_shards and self._n_shards != 1:
            raise ValueError(f"{len(left)} shards handed over to {self._n_shards}")
        dropped = 0
        for i, blocks in enumerate(left):
            queue = self._queues[i if len(left) == self._n_shards else 0]
            for block in blocks:
                dropped += queue.put(block)
        if dropped:
            self._drop(dropped, "queue_full")
        self._metrics.set(sm.RW_QUEUE_SAMPLES, self.queued(), self._labels)

    def _drop(self, count: int, reason: str) -> None:
        self._metrics.inc(sm.RW_DROPPED, count, {**self._labels, "reason": reason})

    async def _run_shard(self, index: int) -> None:
        queue = self._queues[index]
        qc = self.config.queue
        while not self._stopping:
            batch = await queue.get_batch(qc.max_samples_per_send, qc.batch_send_deadline_s)
            self._metrics.set(sm.RW_QUEUE_SAMPLES, self.queued(), self._labels)
            self._metrics.set(sm.RW_QUEUE_DISK_BYTES, self.disk_bytes(), self._labels)
            if not batch.blocks:
                return
            flight = self._inflight[index] = _Flight(batch, index)
            try:
                while not await self._sent(flight, keep=queue.persistent):
                    flight = self._inflight[index] = _Flight(batch, index)
            except _HandedOver:
                return  # the flight stays for hand_over
            queue.ack(batch)
            self._inflight[index] = None

    async def _sent(self, flight: _Flight, keep: bool) -> bool:
        """Send a batch. A bug must not silently stop the shard: an unexpected error drops a
        batch from memory, counted as ``error``; a spooled one (``keep``) is never
        acknowledged unanswered, so it is tried again after ``max_backoff`` and stays on disk
        for the next start meanwhile (False)."""
        try:
            await self._send_batch(flight)
            return True
        except _HandedOver:
            raise  # a safe point for the next writer, not an error
        except Exception as err:
            if not keep:
                log.exception("remote write %s: unexpected error", self.config.remote_name)
                self._drop(flight.unsettled, "error")
                return True
            self._metrics.inc(sm.RW_RETRIES, 1, self._labels)
            note = self._outage.happened(f"unexpected {type(err).__name__}")
            log.log(
                logging.DEBUG if note is None else logging.ERROR,
                "remote write %s: unexpected error; the spooled batch stays and is sent again "
                "in %g s%s",
                self.config.remote_name,
                self.config.queue.max_backoff_s,
                note or "",
                exc_info=note is not None,
            )
            await asyncio.sleep(self.config.queue.max_backoff_s)
            return False

    async def _off_loop(self, work: Callable[[], _T], large: bool) -> _T:
        if not large:
            return work()
        return await wait_done(_CPU.submit(work))

    async def _send_batch(self, flight: _Flight) -> None:
        batch = flight.batch
        parts = [await block.data() for block in batch.blocks]
        # 2.0 requests cost ~10 us a sample to make: never on the event loop
        large = len(batch) > self.executor_threshold or len(parts) > 1 or self._v2 is not None
        requests = await self._off_loop(partial(self._requests, parts, batch.count), large)
        for request in requests:
            await self._send_request(request, flight)
        if flight.too_large_series or flight.too_large_other:
            log.error(
                "remote write %s (%s) refused %d series (%d samples)%s as too large even alone "
                "(HTTP 413 for %d bytes or fewer): dropped",
                self.config.remote_name,
                self.config.display_url,
                flight.too_large_series,
                flight.too_large_samples,
                f" and {flight.too_large_other} metadata entries" if flight.too_large_other else "",
                self._request_limit,
            )

    def _requests(self, parts: list[bytes], samples: int) -> list[_Request]:
        """The batch's blocks as requests of at most ``max_request_bytes`` uncompressed, each
        series' samples in one ``TimeSeries``."""
        raw = b"".join(parts) if len(parts) == 1 else wire.merge_series(b"".join(parts))
        chunks = wire.split(raw, self._request_limit)
        v2 = self._v2 if self._negotiation.v2 else None
        if len(chunks) == 1:
            return [_Request.of(raw, samples, v2)]
        return [_Request.of(c, v2=v2) for c in chunks]

    async def _send_request(self, request: _Request, flight: _Flight) -> None:
        """Send until delivered. A 413 lowers the request size for good and the rest of the
        request goes in pieces under it; a single series still refused is dropped, counted."""
        pending = [request]
        while pending:
            piece = pending.pop(0)
            if not flight.refused_alone or len(piece.raw) < flight.refused_alone:
                try:
                    await self._deliver(piece, flight)
                    continue
                except RequestTooLargeError:
                    self._lower_request_limit(len(piece.raw))
            chunks = wire.split(piece.raw, self._request_limit)
            if len(chunks) == 1:
                halves = wire.halve(piece.raw)
                if halves is None:
                    self._too_large(piece, flight)
                    continue
                chunks = list(halves)
            large = len(piece.raw) > EXECUTOR_THRESHOLD_BYTES or self._v2 is not None
            pending = await self._off_loop(partial(self._cut, chunks, pending), large)

    def _cut(self, chunks: list[bytes], rest: list[_Request]) -> list[_Request]:
        """Requests for ``chunks``, then ``rest`` cut again for the (lowered) size limit."""
        v2 = self._v2 if self._negotiation.v2 else None
        out = [_Request.of(c, v2=v2) for c in chunks]
        for piece in rest:
            if len(piece.raw) <= self._request_limit:
                out.append(piece)
            else:
                out += [_Request.of(c, v2=v2) for c in wire.split(piece.raw, self._request_limit)]
        return out

    def _too_large(self, piece: _Request, flight: _Flight) -> None:
        size = len(piece.raw)
        flight.refused_alone = min(flight.refused_alone or size, size)
        if piece.samples:
            flight.too_large_series += 1
            flight.too_large_samples += piece.samples
        else:
            flight.too_large_other += 1
        flight.settled += piece.samples
        self._drop(piece.samples, "too_large")

    def _lower_request_limit(self, refused_bytes: int) -> None:
        """A 413 for ``refused_bytes``: later requests stay under half of it, said once."""
        limit = max(MIN_MAX_REQUEST_BYTES, refused_bytes // 2)
        if limit < self._request_limit:
            self._request_limit = limit
            log.warning(
                "remote write %s (%s): HTTP 413 for %d bytes; sending requests of at most %d "
                "bytes from now on (max_request_bytes is %d)",
                self.config.remote_name,
                self.config.display_url,
                refused_bytes,
                limit,
                self.config.queue.max_request_bytes,
            )

    async def _deliver(self, request: _Request, flight: _Flight) -> None:
        """Post one request, retrying what the spec calls recoverable."""
        qc = self.config.queue
        backoff = Backoff(qc.min_backoff_s, qc.max_backoff_s, qc.max_retry_after_s)
        while True:
            if self._stopping and not flight.settled:
                raise _HandedOver  # before a request of a batch not begun, or a retry of one
            v2 = self._v2 is not None and self._negotiation.v2
            if v2 and not request.body_v2 and self._v2 is not None:
                await self._off_loop(partial(request.encode_v2, self._v2), True)
            if v2 and not request.samples:
                return  # only 1.0 metadata entries: 2.0 carries metadata on every series
            body = request.body_v2 if v2 else request.body
            try:
                written = await self._post(flight.shard, body, request.samples, v2)
            except RecoverableSendError as err:
                delay = backoff.next_delay(err.retry_after_s, slowest=isinstance(err, TLSSendError))
                self._metrics.inc(sm.RW_RETRIES, 1, self._labels)
                note = self._outage.happened(str(err).split(": ", 1)[0])  # "HTTP 503"
                log.log(
                    logging.DEBUG if note is None else logging.WARNING,
                    "remote write %s (%s): %s; retrying in %.3f s%s%s",
                    self.config.remote_name,
                    self.config.display_url,
                    err,
                    delay.seconds,
                    f" ({delay.adjusted})" if delay.adjusted else "",
                    note or "",
                )
                await asyncio.sleep(delay.seconds)
                continue
            except RequestTooLargeError:
                raise
            except NonRecoverableSendError as err:
                # a 400 with Written headers came from a receiver that decoded the 2.0 body
                if v2 and (
                    err.status == 415
                    or (
                        err.status == 400
                        and err.written is None
                        and _CONTENT_TYPE_WORDS.search(err.text)
                    )
                ):
                    self._fall_back(f"HTTP {err.status}: {err.text[:200]}")
                    continue
                if not v2 and err.status == 415 and self._negotiation.wants_v2:
                    # on 1.0 after a fallback, and the receiver now wants 2.0: at once
                    self._negotiation.reprobe()
                    log.warning(
                        "remote write %s (%s) answers 415 to 1.0: trying Remote-Write 2.0 again",
                        self.config.remote_name,
                        self.config.display_url,
                    )
                    continue
                self._refused(request, err, v2)
                flight.settled += request.samples
                return
            if v2 and written is None:
                # A 1.x receiver decodes a 2.0 body as an empty 1.0 message: nothing was stored.
                self._fall_back("2xx without X-Prometheus-Remote-Write-Samples-Written")
                continue
            stored = request.samples
            if v2 and written is not None and written < request.samples:
                stored = max(written, 0)
                self._partial(request, stored, "2xx")
            for episode in (self._outage, self._refusals):
                if (ended := episode.ended()) is not None:
                    log.info(
                        "remote write %s (%s): delivering again after %d %s over %.1f s",
                        self.config.remote_name,
                        self.config.display_url,
                        ended[0],
                        episode.noun,
                        ended[1],
                    )
            self._metrics.inc(sm.RW_SAMPLES, stored, self._labels)
            self._metrics.inc(
                sm.RW_BYTES, request.raw_v2_len if v2 else len(request.raw), self._labels
            )
            self._metrics.inc(sm.RW_COMPRESSED_BYTES, len(body), self._labels)
            flight.settled += request.samples
            return

    async def _post(self, shard: int, body: bytes, samples: int, v2: bool) -> int | None:
        """One attempt; while it is on the wire ``hand_over`` waits for its answer."""
        self._posting[shard] = True
        try:
            return await self._client.post(body, samples, v2)
        finally:
            self._posting[shard] = False

    def _partial(self, request: _Request, written: int, answer: str) -> None:
        """A 2.0 receiver wrote fewer samples than sent: the rest are counted as not written."""
        self._metrics.inc(sm.RW_PARTIAL_WRITES, 1, self._labels)
        self._drop(request.samples - written, "not_written")
        log.warning(
            "remote write %s (%s): a partial write: %d of %d samples written (%s)",
            self.config.remote_name,
            self.config.display_url,
            written,
            request.samples,
            answer,
        )

    def _refused(self, request: _Request, err: NonRecoverableSendError, v2: bool) -> None:
        """A refusal for good: the samples not written are dropped and counted, each time;
        logged as retries are (``Episode``), since a receiver may refuse every window."""
        written = err.written if v2 and err.written is not None else 0
        written = min(max(written, 0), request.samples)
        note = self._refusals.happened(f"HTTP {err.status}")
        log.log(
            logging.DEBUG if note is None else logging.ERROR,
            "remote write %s (%s) refused %d samples, not retrying: HTTP %d: %s%s%s",
            self.config.remote_name,
            self.config.display_url,
            request.samples - written,
            err.status,
            err.text,
            f" ({written} of {request.samples} written: a partial write)" if written else "",
            note or "",
        )
        if written:
            self._metrics.inc(sm.RW_SAMPLES, written, self._labels)
            self._metrics.inc(sm.RW_PARTIAL_WRITES, 1, self._labels)
        self._drop(request.samples - written, "rejected")

    def _fall_back(self, why: str) -> None:
        """The receiver does not take 2.0: 1.0 for a while, logged once, counted."""
        if not self._negotiation.v2:
            return  # another shard's request found out first: once per endpoint
        self._negotiation.fall_back()
        self._metrics.inc(sm.RW_PROTOCOL_FALLBACKS, 1, self._labels)
        log.warning(
            "remote write %s (%s) does not take Remote-Write 2.0 (%s): sending 1.0, trying 2.0 "
            "again in %.0f s",
            self.config.remote_name,
            self.config.display_url,
            why,
            REPROBE_S,
        )


def _start_ms(family: Family) -> int:
    """When a counter family started counting, when known: hfsampler's own, at process start.

    The driver's counters (energy, ECC, violation time) count from a driver load or a reset
    that NVML does not report: unknown (0)."""
    return sm.PROCESS_START_MS if family.name.startswith("hfsampler_") else 0

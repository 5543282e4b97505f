"""Delivery: an endpoint's shard loops, from queued blocks to delivered requests.

Each shard has one request in flight: it takes a batch of blocks from its queue, merges them
into one block (each series once) and cuts it into requests of at most ``max_request_bytes``
(measured as their 1.0 bytes), written and compressed once each (in an executor when large), and
delivers each through the ``RemoteClient`` under the retry policy (``retry.py``): recoverable
failures are retried with backoff, a 413 splits the request in two (down to one series; no piece
as large as a series refused alone is sent again in that batch), any other refusal drops it,
counted; retries and refusals are logged as ``Episode`` says. A batch is acknowledged to its
queue once settled; a spooled one only once the receiver answered, whatever error the sending
met. Once ``stopping`` is set (``handover``) a shard stops at a safe point: before its batch's
first request or at a retry of it, never with a request on the wire.

With ``protobuf_message: io.prometheus.write.v2.Request`` each request goes as 2.0
(``encoder_v2``), negotiated as the 2.0 spec asks: a 415, a 400 that names the content type,
or a 2xx without ``X-Prometheus-Remote-Write-Samples-Written`` (a 1.x receiver that decoded an
empty message and stored nothing) sends the same request again as 1.0 and keeps the endpoint on
1.0 for ``REPROBE_S``, logged once and counted. Blocks are neutral in every queue, so a
fallback needs nothing but the blocks, spooled ones included.

A receiver that refuses native histograms (``histogram_refusal``) has the request sent again
without its histogram series, and the endpoint's histograms dropped from then on: its float
series lose nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from hfsampler import selfmetrics as sm
from hfsampler.errors import (
    NonRecoverableSendError,
    ReceiverDownError,
    RecoverableSendError,
    RequestTooLargeError,
)
from hfsampler.remote_write.blocks import Block, Sizer, halve, merge, piece_sizes, split
from hfsampler.remote_write.client import RemoteClient
from hfsampler.remote_write.config import MIN_MAX_REQUEST_BYTES, EndpointConfig
from hfsampler.remote_write.encoder import RequestEncoderV1, compress, write_request
from hfsampler.remote_write.encoder_v2 import RequestEncoderV2
from hfsampler.remote_write.episode import Episode
from hfsampler.remote_write.histogram_refusal import HistogramRefusal, refusal
from hfsampler.remote_write.queue import Batch, ShardQueue
from hfsampler.remote_write.retry import Backoff
from hfsampler.remote_write.security import TLSSendError
from hfsampler.remote_write.wire import Wire, join, to_block
from hfsampler.selfmetrics import SelfMetrics

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


@dataclass(slots=True)
class _Request:
    """One HTTP request: its samples, the bytes of its 1.0 encoding, and its bodies. A spooled
    request sent as stored (``wire``) is made a block only when a 413 cuts it or a 2.0 body
    is made of it."""

    _block: Block | None
    size: int  # its 1.0 WriteRequest's bytes: what max_request_bytes and a 413 measure
    body_v2: bytes = b""  # the same as a 2.0 request, compressed; b"" for a 1.0 endpoint
    raw_v2_len: int = 0
    _body: bytes | None = None
    wire: Wire | None = None

    @property
    def samples(self) -> int:
        return self.wire.samples if self.wire is not None else self.block.samples

    @property
    def block(self) -> Block:
        if self._block is None:
            assert self.wire is not None
            self._block = to_block(self.wire)
        return self._block

    def decode(self) -> Block:
        return self.block

    @property
    def has_histograms(self) -> bool:
        """Whether the request holds native histograms; a spooled request as stored never does
        (``SpoolFiles.payload`` keeps a block with histograms packed), so it is not decoded."""
        return self.wire is None and self.block.hist is not None

    @classmethod
    def of_wire(cls, wire: Wire) -> _Request:
        """Spooled 1.0 bytes as they are: the body is the wire's own (``join``'s)."""
        body = wire.body if isinstance(wire.body, bytes) else bytes(wire.body)
        return cls(None, wire.raw_len, _body=body, wire=wire)

    @classmethod
    def of(
        cls,
        block: Block,
        v1: RequestEncoderV1,
        v2: RequestEncoderV2 | None = None,
        size: int | None = None,
    ) -> _Request:
        """A request for ``block`` (``size``: its 1.0 bytes, when known).

        For a 2.0 endpoint only the 2.0 body is made now; the 1.0 one when a fallback asks
        for it."""
        if v2 is None:
            raw = v1.encode(block)
            return cls(block, len(raw), _body=compress(raw))
        raw_v2 = v2.encode(block)[0]
        size = sum(piece_sizes(block)) if size is None else size
        return cls(block, size, compress(raw_v2), len(raw_v2))

    def become(self, other: _Request) -> None:
        """Take ``other``'s block and bodies: a refusal left part of this request to send (the
        caller's references, such as a 413's split, then see that part)."""
        self._block, self.size, self._body = other.block, other.size, other._body
        self.wire = None
        self.body_v2, self.raw_v2_len = other.body_v2, other.raw_v2_len

    def encode_v2(self, v2: RequestEncoderV2) -> None:
        """Make the 2.0 body now (a request built while the endpoint was on 1.0)."""
        raw_v2 = v2.encode(self.block)[0]
        self.body_v2, self.raw_v2_len = compress(raw_v2), len(raw_v2)

    @property
    def body(self) -> bytes:
        """The 1.0 body, compressed."""
        if self._body is None:
            self._body = compress(write_request(self.block))
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


class Delivery:
    """Sends what an endpoint's shard queues hold: one ``run_shard`` task per queue."""

    def __init__(
        self,
        config: EndpointConfig,
        metrics: SelfMetrics,
        queues: Sequence[ShardQueue],
        v2: RequestEncoderV2 | None,
        drop: Callable[[int, str], None],
    ) -> None:
        self.config = config
        self.executor_threshold = EXECUTOR_THRESHOLD_SAMPLES
        self._metrics = metrics
        self._labels = {"remote_name": config.remote_name, "url": config.display_url}
        self._queues = queues
        self._drop = drop
        self.inflight: list[_Flight | None] = [None] * len(queues)
        # Lowered after a 413, so that later batches go in pieces the receiver takes at once.
        self._request_limit = config.queue.max_request_bytes
        self._client = RemoteClient(config, metrics, len(queues))
        self._negotiation = _Negotiation(v2 is not None)
        self._outage = Episode("retries")
        self._refusals = Episode("refusals")
        self._v1 = RequestEncoderV1()
        self._sizes = Sizer()
        self._v2 = v2
        # once the receiver refused native histograms none is sent to it again (intake stops
        # queueing them; queued ones are dropped before sending), nor any it no longer asks for
        self.histograms = HistogramRefusal(config, drop)
        # handover: shards stop before their next request; a request on the wire is awaited
        self.stopping = False
        self.posting = [False] * len(queues)

    def queued(self) -> int:
        """Samples waiting in every shard's queue (not counting batches in flight)."""
        return sum(len(q) for q in self._queues)

    def disk_bytes(self) -> int:
        """Bytes of spooled segments (0 without a queue_dir)."""
        return sum(q.disk_bytes for q in self._queues)

    def open(self) -> None:
        self._client.open()

    async def close(self) -> None:
        await self._client.close()

    def unsettled(self) -> int:
        """Samples of the batches in flight not yet delivered or dropped, from memory queues
        only (a spooled batch stays on disk until acknowledged); forgets the batches."""
        left = sum(
            flight.unsettled
            for q, flight in zip(self._queues, self.inflight, strict=True)
            if flight is not None and not q.persistent
        )
        self.inflight = [None] * len(self._queues)
        return left

    async def run_shard(self, index: int) -> None:
        """Send shard ``index``'s batches until its queue is flushed and empty."""
        queue = self._queues[index]
        qc = self.config.queue
        while not self.stopping:
            batch = await queue.get_batch(qc.max_samples_per_send, qc.batch_send_deadline_s)
            self._metrics.set(sm.RW_QUEUE_SAMPLES, self.queued(), self._labels)
            self._metrics.set(sm.RW_QUEUE_DISK_BYTES, self.disk_bytes(), self._labels)
            if not batch.blocks:
                return
            flight = self.inflight[index] = _Flight(batch, index)
            try:
                while not await self._sent(flight, keep=queue.persistent):
                    flight = self.inflight[index] = _Flight(batch, index)
            except _HandedOver:
                return  # the flight stays for hand_over
            queue.ack(batch)
            self.inflight[index] = None

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
        done: Future[_T] = _CPU.submit(work)
        return await asyncio.wrap_future(done)

    async def _send_batch(self, flight: _Flight) -> None:
        batch = flight.batch
        parts = batch.blocks
        if self.histograms.dropping:  # a spooled request (a Wire) holds none
            parts = [
                self._without_histograms(p, flight) if isinstance(p, Block) else p for p in parts
            ]
        wires = [p for p in parts if isinstance(p, Wire)]
        if self._v2 is None and len(wires) == len(parts):
            # spooled requests as stored: joining them copies their bytes, no more
            large = sum(len(w.body) for w in wires) > EXECUTOR_THRESHOLD_BYTES or any(
                w.raw_len > self._request_limit for w in wires
            )
        else:
            # several blocks are merged first; a 2.0 request is made whole: never on the loop
            large = len(batch) > self.executor_threshold or len(parts) > 1 or self._v2 is not None
        requests = await self._off_loop(partial(self._requests, parts), large)
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

    def _requests(self, parts: list[Block | Wire]) -> list[_Request]:
        """The batch's blocks as requests of at most ``max_request_bytes`` uncompressed (as
        1.0), each series' samples in one ``TimeSeries``; spooled requests (``Wire``) as they
        are, joined (``_joined``)."""
        v2 = self._v2 if self._negotiation.v2 else None
        if v2 is None and any(isinstance(p, Wire) for p in parts):
            return self._joined(parts)
        block = merge([p if isinstance(p, Block) else to_block(p) for p in parts])
        if v2 is None:
            request = _Request.of(block, self._v1)  # written once: usually it fits
            if request.size <= self._request_limit:
                return [request]
            return [_Request.of(c, self._v1) for c in split(block, self._request_limit)]
        sizes = self._sizes(block)
        if sum(sizes) <= self._request_limit:
            return [_Request.of(block, self._v1, v2, sum(sizes))]
        return [_Request.of(c, self._v1, v2) for c in split(block, self._request_limit, sizes)]

    def _joined(self, parts: list[Block | Wire]) -> list[_Request]:
        """Spooled requests joined as they are (``wire.join``: no decoding, no compressing)
        into requests of at most the size limit, in order; a block among them (a record read
        from memory) is written and compressed first; a record larger than the limit alone is
        cut at series as a block is."""
        out: list[_Request] = []
        group: list[Wire] = []
        size = 0
        for part in parts:
            wire = part if isinstance(part, Wire) else Wire.of(part, self._v1)
            if group and size + wire.raw_len > self._request_limit:
                out.append(_Request.of_wire(join(group)))
                group, size = [], 0
            if wire.raw_len > self._request_limit:
                out += [
                    _Request.of(c, self._v1) for c in split(to_block(wire), self._request_limit)
                ]
                continue
            group.append(wire)
            size += wire.raw_len
        if group:
            out.append(_Request.of_wire(join(group)))
        return out

    async def _send_request(self, request: _Request, flight: _Flight) -> None:
        """Send until delivered. A 413 lowers the request size for good and the rest of the
        request goes in pieces under it; a single series still refused is dropped, counted."""
        pending = [request]
        while pending:
            piece = pending.pop(0)
            if not flight.refused_alone or piece.size < flight.refused_alone:
                try:
                    await self._deliver(piece, flight)
                    continue
                except RequestTooLargeError:
                    self._lower_request_limit(piece.size)
            if piece.wire is not None:  # spooled bytes: decoded to be cut, off the loop
                await self._off_loop(piece.decode, True)
            chunks = split(piece.block, self._request_limit)
            if len(chunks) == 1:
                halves = halve(piece.block)
                if halves is None:
                    self._too_large(piece, flight)
                    continue
                chunks = list(halves)
            large = piece.size > EXECUTOR_THRESHOLD_BYTES or self._v2 is not None
            pending = await self._off_loop(partial(self._cut, chunks, pending), large)

    def _cut(self, chunks: list[Block], rest: list[_Request]) -> list[_Request]:
        """Requests for ``chunks``, then ``rest`` cut again for the (lowered) size limit."""
        v2 = self._v2 if self._negotiation.v2 else None
        out = [_Request.of(c, self._v1, v2) for c in chunks]
        for piece in rest:
            if piece.size <= self._request_limit:
                out.append(piece)
            else:
                pieces = split(piece.block, self._request_limit)
                out += [_Request.of(c, self._v1, v2) for c in pieces]
        return out

    def _too_large(self, piece: _Request, flight: _Flight) -> None:
        flight.refused_alone = min(flight.refused_alone or piece.size, piece.size)
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
            if self.stopping and not flight.settled:
                raise _HandedOver  # before a request of a batch not begun, or a retry of one
            v2 = self._v2 is not None and self._negotiation.v2
            if self.histograms.dropping and request.has_histograms:
                # refused while this request waited (another shard's, or a piece of this one)
                if not await self._floats_of(request, flight, None, v2):
                    return
                continue
            if v2 and not request.body_v2 and self._v2 is not None:
                await self._off_loop(partial(request.encode_v2, self._v2), True)
            if v2 and not request.samples:
                return  # only 1.0 metadata entries: 2.0 carries metadata on every series
            body = request.body_v2 if v2 else request.body
            try:
                written = await self._post(flight.shard, body, request.samples, v2)
            except RecoverableSendError as err:
                if request.has_histograms and (why := refusal(request.block, err)) is not None:
                    self.histograms.refuse(why)
                    if await self._floats_of(request, flight, None, v2):
                        continue
                    return
                delay = backoff.next_delay(
                    err.retry_after_s,
                    slowest=isinstance(err, TLSSendError),
                    down=isinstance(err, ReceiverDownError),
                )
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
                if request.has_histograms and (why := refusal(request.block, err)) is not None:
                    self.histograms.refuse(why)
                    if await self._floats_of(request, flight, err.written, v2):
                        continue
                    return
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
            self._metrics.inc(sm.RW_BYTES, request.raw_v2_len if v2 else request.size, self._labels)
            self._metrics.inc(sm.RW_COMPRESSED_BYTES, len(body), self._labels)
            flight.settled += request.samples
            return

    async def _post(self, shard: int, body: bytes, samples: int, v2: bool) -> int | None:
        """One attempt; while it is on the wire a hand-over waits for its answer."""
        self.posting[shard] = True
        try:
            return await self._client.post(body, samples, v2)
        finally:
            self.posting[shard] = False

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

    def _without_histograms(self, block: Block, flight: _Flight) -> Block:
        """``block`` without its histogram series, dropped, counted and settled."""
        floats, dropped = self.histograms.strip(block)
        flight.settled += dropped
        return floats

    async def _floats_of(
        self, request: _Request, flight: _Flight, written: int | None, v2: bool
    ) -> bool:
        """The receiver refused native histograms: the request's are dropped, and the request
        becomes its float series alone, to send again (True); False when nothing is left to
        send (a 2.0 receiver said it wrote them, or there are none)."""
        floats = self._without_histograms(request.block, flight)
        if v2 and written is not None and written >= floats.samples > 0:
            # a partial write: the receiver stored the floats already
            self._metrics.inc(sm.RW_SAMPLES, floats.samples, self._labels)
            flight.settled += floats.samples
            return False
        if not floats.samples and not floats.families:
            return False
        v2_encoder = self._v2 if self._negotiation.v2 else None
        again = await self._off_loop(partial(_Request.of, floats, self._v1, v2_encoder), True)
        request.become(again)
        return True

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

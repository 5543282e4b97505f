"""Intake: one ``RemoteWriter`` per endpoint, from snapshots to blocks in its shard queues.

``push`` relabels a snapshot's series (``write_relabel_configs``, once per series), assigns each to
its shard (by a checksum of its labels, so per-series order is kept, across its ids too) and queues
one ``Block`` per shard (in pieces of at most ``max_samples_per_send`` samples): each series' labels
are encoded once and kept by the ``Encoder``, a window adds only its values. The first block that
has a family carries its 1.0 metadata (once per family); 2.0 takes each series' metadata from the
families known here when it sends. With a ``queue_dir`` each shard's queue is a ``SpoolQueue``,
without one a ``MemoryQueue``, each holding the samples ``sizing`` allows for the plan's windows;
``delivery`` sends what they hold. Samples a full memory queue drops are counted and said once per
episode (``Episode``), as retries and refusals are. A snapshot's native histograms (its
``histograms``) go only to an endpoint with ``send_native_histograms``, each one's message body
written once (``histwrite.histogram_body``) beside the float samples of its shard's block;
elsewhere neither they nor their families' metadata are queued, so such an endpoint gets what it
got before histograms existed. Once the receiver refused them (``delivery``), they are dropped
and counted (``histograms_refused``). When a reload replaces the writer, ``hand_over``
stops it at safe points (``handover``) and the next one's ``take_over`` queues its backlog ahead of
anything newer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from hfsampler import selfmetrics as sm
from hfsampler.histograms import NativeHistogram
from hfsampler.remote_write.blocks import Block, Labels
from hfsampler.remote_write.config import PROTOBUF_V2, EndpointConfig
from hfsampler.remote_write.delivery import Delivery
from hfsampler.remote_write.encoder import Encoder
from hfsampler.remote_write.encoder_v2 import RequestEncoderV2
from hfsampler.remote_write.episode import REMINDER_S, Episode
from hfsampler.remote_write.handover import hand_over
from hfsampler.remote_write.histogram_refusal import REASON
from hfsampler.remote_write.histwrite import histogram_body
from hfsampler.remote_write.queue import MemoryQueue, ShardQueue
from hfsampler.remote_write.relabel import Relabeller
from hfsampler.remote_write.sizing import QueueBound, queue_bound
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Family, Series, Snapshot, is_stale

log = logging.getLogger(__name__)


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


class RemoteWriter:
    """Pushes snapshots to one Remote-Write endpoint."""

    def __init__(
        self,
        config: EndpointConfig,
        metrics: SelfMetrics,
        queue_dir: Path | None = None,
        families: Mapping[str, Family] | None = None,
        window_samples: int = 0,
    ) -> None:
        """``families``: the metric families known before the first snapshot (the service's
        model), so that a spool replayed at start goes out as 2.0 with its metadata.
        ``window_samples``: the samples a window brings by the plan (0: not known, each shard
        holds ``capacity`` samples), which the queues are sized from (``sizing``)."""
        self.config = config
        self._metrics = metrics
        self._labels = {"remote_name": config.remote_name, "url": config.display_url}
        self._encoder = Encoder()
        self._n_shards = config.queue.min_shards
        # by Series.id while the series lives: its encoder labels and its shard, chosen by its
        # labels (a series that ends and returns, or a relabelled one after a reload, has a new
        # id but the same labels, so its samples stay in order on one shard)
        self._placed: dict[int, tuple[Labels, int]] = {}
        self.bound: QueueBound = queue_bound(config.queue, window_samples, self._n_shards)
        # a memory queue full while the receiver is slow or away: said once, counted always
        self._full = Episode("pushes that dropped samples")
        self._full_samples = 0  # dropped since the queue's room was last said (or ever)
        self._full_first = 0.0  # when the first of those was dropped (monotonic)
        self._full_said_at: float | None = None  # when a full queue was last said at warning
        self._full_loud = False  # the episode going on was said (so is its end)
        self._queues: list[ShardQueue]
        if queue_dir is None:
            self._queues = [MemoryQueue(self.bound.samples) for _ in range(self._n_shards)]
        else:
            base = spool_dir(queue_dir, config)
            self._queues = [
                SpoolQueue(
                    base / f"shard-{i}",
                    self.bound.samples,
                    max(config.queue.max_disk_bytes // self._n_shards, 1 << 16),
                    self._drop,
                    on_disk_bytes=lambda _: self._metrics.set(
                        sm.RW_QUEUE_DISK_BYTES, self.disk_bytes(), self._labels
                    ),
                    # a 1.0 endpoint's records are its requests, sent as stored when drained
                    wire=config.protobuf_message != PROTOBUF_V2,
                    drain_samples=config.queue.drain_samples,
                )
                for i in range(self._n_shards)
            ]
        self._relabeller = Relabeller(config.relabel) if config.relabel else None
        self._families: dict[str, Family] = dict(families or {})
        # a family renamed by write_relabel_configs keeps its metadata under its new name
        self._renamed: dict[str, Family] = {}
        self._v2 = (
            RequestEncoderV2(lambda: ChainMap(self._renamed, self._families), _start_ms)
            if config.protobuf_message == PROTOBUF_V2
            else None
        )
        self.delivery = Delivery(config, metrics, self._queues, self._v2, self._drop)
        self._tasks: list[asyncio.Task[None]] = []
        # the families whose 1.0 metadata went out: each once, in the first push that has it
        # (a replay meets its families batch by batch)
        self._metadata_sent: set[str] | None = set() if config.send_metadata else None
        self._started = False
        self._closed = False

    @property
    def n_shards(self) -> int:
        return self._n_shards

    def queued(self) -> int:
        """Samples waiting in every shard's queue (not counting batches in flight)."""
        return self.delivery.queued()

    def disk_bytes(self) -> int:
        """Bytes of spooled segments (0 without a queue_dir)."""
        return self.delivery.disk_bytes()

    async def start(self) -> None:
        """Open the HTTP session and start one task per shard."""
        if self._started:
            return
        self._started = True
        self.delivery.open()
        self._tasks = [
            asyncio.create_task(
                self.delivery.run_shard(i), name=f"rw-{self.config.remote_name}-{i}"
            )
            for i in range(self._n_shards)
        ]

    def push(self, snapshot: Snapshot) -> None:
        """Queue a snapshot's samples; never blocks. Full queues drop their oldest samples."""
        if self._closed:
            sent = len(snapshot.histograms) if self.config.send_native_histograms else 0
            self._drop(len(snapshot) + sent, "shutdown")
            return
        histograms = snapshot.histograms
        all_families = snapshot.families
        if not self.config.send_native_histograms:
            histograms = ()
            all_families = _float_families(all_families)
        elif histograms and self.delivery.histograms.refused:
            self._drop(len(histograms), REASON)
            histograms = ()
        if self._v2 is not None and len(all_families) != len(self._families):
            self._families.update(all_families)
        families = self._new_families(all_families)
        n = self._n_shards
        shard_labels: list[list[Labels]] = [[] for _ in range(n)]
        shard_values: list[list[float]] = [[] for _ in range(n)]
        ended: list[int] = []
        placed = self._placed
        place = placed.get
        relabeller = self._relabeller
        for series, value in zip(snapshot.series, snapshot.values, strict=True):
            out: Series | None = series
            stale = value != value and is_stale(value)  # NaN first: the cheap test
            if relabeller is not None:
                out = relabeller.series(series)
                if stale:
                    relabeller.forget(series)  # it ends here: the cache must not keep it
            if out is not None:
                if out.name != series.name and out.name not in self._renamed:
                    self._learn_rename(series.name, out.name)
                if (where := place(out.id)) is None:
                    where = placed[out.id] = self._place(out)
                encoded, k = where
                shard_labels[k].append(encoded)
                shard_values[k].append(value)
                if stale:
                    ended.append(out.id)
        shard_bodies = self._place_histograms(histograms, shard_labels, shard_values, ended)
        # a series that got its stale marker is over (a pod left, a GPU was lost): without this
        # the encoder's cache would grow with every pod that ever ran on the node
        self._encoder.forget(ended)
        for sid in ended:
            placed.pop(sid, None)
        step = self.config.queue.max_samples_per_send
        ts = snapshot.timestamp_ms
        dropped = 0
        for k, (queue, labels, values) in enumerate(
            zip(self._queues, shard_labels, shard_values, strict=True)
        ):
            bodies = shard_bodies[k] if shard_bodies is not None else None
            for i in range(0, len(labels), step):
                hist = None if bodies is None or not any(bodies[i : i + step]) else bodies
                block = Block.of(
                    labels[i : i + step],
                    ts,
                    values[i : i + step],
                    families,
                    hist=None if hist is None else hist[i : i + step],
                )
                families = []  # once, in the first block
                dropped += queue.put(block)
        self._queue_full(dropped)
        self._metrics.set(sm.RW_QUEUE_SAMPLES, self.queued(), self._labels)

    def _place_histograms(
        self,
        histograms: Sequence[tuple[Series, NativeHistogram]],
        shard_labels: list[list[Labels]],
        shard_values: list[list[float]],
        ended: list[int],
    ) -> list[list[bytes]] | None:
        """Add the histogram series to their shards (after the floats, relabelled as they are);
        per shard, each sample's histogram body (b"" for a float), None without histograms.
        A series whose histogram is a stale marker (its sum the staleness NaN, as Prometheus's
        TSDB marks a histogram series) is added to ``ended``."""
        if not histograms:
            return None
        bodies: list[list[bytes]] = [[b""] * len(labels) for labels in shard_labels]
        relabeller = self._relabeller
        for series, h in histograms:
            out = series if relabeller is None else relabeller.series(series)
            stale = h.sum != h.sum and is_stale(h.sum)
            if stale and relabeller is not None:
                relabeller.forget(series)
            if out is None:
                continue
            if stale:
                ended.append(out.id)
            if out.name != series.name and out.name not in self._renamed:
                self._learn_rename(series.name, out.name)
            if (where := self._placed.get(out.id)) is None:
                where = self._placed[out.id] = self._place(out)
            encoded, k = where
            shard_labels[k].append(encoded)
            shard_values[k].append(float(h.count))
            bodies[k].append(histogram_body(h))
        return bodies

    def _place(self, series: Series) -> tuple[Labels, int]:
        """``series``' encoded labels and its shard (a checksum of its labels)."""
        labels = self._encoder.labels(series)
        n = self._n_shards
        return labels, zlib.crc32(labels.v1) % n if n > 1 else 0

    def _queue_full(self, dropped: int) -> None:
        """Count what a put dropped (``queue_full``) and say it once per episode: a queue
        that stays full during an outage drops at every window, and a line each would bury the
        one that says why. The episode ends at the first put that drops nothing. A receiver a
        little slower than the windows makes short episodes one after another (3.5 windows a
        request: 17 warnings and 16 'room again' lines in 60 windows): one that starts within
        ``REMINDER_S`` of the last one said is the same trouble, and it and its end go to debug
        (its drops counted, and added to the next end said)."""
        name, url = self.config.remote_name, self.config.display_url
        now = time.monotonic()
        if not dropped:
            if (ended := self._full.ended()) is not None:
                log.log(
                    logging.INFO if self._full_loud else logging.DEBUG,
                    "remote write %s (%s): the queue has room again; %d samples dropped over "
                    "%.1f s",
                    name,
                    url,
                    self._full_samples,
                    max(now - self._full_first, ended[1]),
                )
                if self._full_loud:
                    self._full_samples = 0
            return
        self._drop(dropped, "queue_full")
        if not self._full_samples:
            self._full_first = now
        self._full_samples += dropped
        starting = self._full.since is None
        note = self._full.happened("queue_full")
        if starting:
            said = self._full_said_at
            self._full_loud = said is None or now - said >= REMINDER_S
            if not self._full_loud:
                note = None
        if note is not None:
            self._full_loud = True  # a reminder: its end is said too
            self._full_said_at = now
        log.log(
            logging.DEBUG if note is None else logging.WARNING,
            "remote write %s (%s): the memory queue is full (%s), the receiver slow or away: "
            "dropped the oldest %d samples; set queue_dir to keep an outage on disk, or raise "
            "queue_config.capacity%s",
            name,
            url,
            self.bound.describe(),
            dropped,
            note or "",
        )

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

    def push_block(self, shard: int, block: Block, families: Mapping[str, Family]) -> None:
        """Queue a block built elsewhere (``replay --raw``, from a recording's arrays) on one
        shard; the caller keeps each series on one shard (``replay``: ``series.id % n_shards``),
        as ``push`` does, so its samples stay in order. Never relabelled: a writer with
        ``write_relabel_configs`` refuses (the block's labels are encoded already)."""
        if self._relabeller is not None:
            raise ValueError("push_block bypasses write_relabel_configs")
        if self._closed:
            self._drop(block.samples, "shutdown")
            return
        if self._v2 is not None and len(families) != len(self._families):
            self._families.update(families)
        if fresh := self._new_families(families):
            block = replace(block, families=tuple(sorted(fresh, key=lambda f: f.name)))
        self._queue_full(self._queues[shard].put(block))
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
        for q in self._queues:
            left += await q.close()
        left += self.delivery.unsettled()
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
        await self.delivery.close()
        self._tasks = []

    async def hand_over(self, deadline_s: float) -> list[list[Block]]:
        """Stop for the endpoint's next writer (a reload changed its configuration): what is
        not delivered yet, per shard and oldest first, for ``take_over``; nothing is dropped
        (but what a full disk kept a spool from writing, counted as at ``close``).

        No request on the wire is abandoned (its answer decides whether it was delivered, and
        ``remote_timeout`` bounds the wait), so nothing goes to the receiver twice or beside the
        next writer's newer samples. A shard stops before its batch's first request or at a
        retry of it; a batch partly delivered (split by a 413) is finished first, for
        ``deadline_s`` at most, then handed over whole, said in a warning (``handover``). With
        a ``queue_dir`` what is left stays spooled, unacknowledged, and the lists are empty."""
        self._closed = True
        left, lost = await hand_over(self.delivery, self._tasks, self._queues, deadline_s)
        if lost:
            self._drop(lost, "reload")
        self._metrics.set(sm.RW_QUEUE_SAMPLES, 0, self._labels)
        await self.delivery.close()
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
        self._queue_full(dropped)
        self._metrics.set(sm.RW_QUEUE_SAMPLES, self.queued(), self._labels)

    def _drop(self, count: int, reason: str) -> None:
        self._metrics.inc(sm.RW_DROPPED, count, {**self._labels, "reason": reason})


def _float_families(families: Mapping[str, Family]) -> Mapping[str, Family]:
    """``families`` without the native-histogram ones (the same mapping when it has none)."""
    if all(f.type != "histogram" for f in families.values()):
        return families
    return {name: f for name, f in families.items() if f.type != "histogram"}


def _start_ms(family: Family) -> int:
    """When a counter family started counting, when known: hfsampler's own, at process start.

    The driver's counters (energy, ECC, violation time) count from a driver load or a reset
    that NVML does not report: unknown (0)."""
    return sm.PROCESS_START_MS if family.name.startswith("hfsampler_") else 0

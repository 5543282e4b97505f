"""`hfsampler replay`: push a recording to a Remote-Write receiver after the fact.

The window series go through the same ``MetricModel`` and ``RemoteWriter`` (encoder, queue, sender,
retries) as a live ``hfsampler run``, with the recording's own timestamps, its devices' labels, and
its job labels (``--label`` at record time, Slurm and Kubernetes identifiers) as external labels.
``--raw`` pushes every distinct millisecond sample instead, as ``NAME_raw`` series, as blocks made
straight from the recording's raw chunk arrays (``RawBatches``) a batch of about
``RAW_BATCH_SAMPLES`` samples at a time, each series on one of ``RAW_SHARDS`` shards. A replay gives
up after ``--timeout`` (default 2 minutes, pushing and flushing together) with a summary of what was
not sent, exit 1; Ctrl-C flushes for at most 5 s more, then exits 130. The queue is drained as it
fills rather than let overflow: a replay has no live data to favour over old.

Receivers differ on old samples: Prometheus refuses samples older than its head block (about the
last 1-3 hours) unless ``storage.tsdb.out_of_order_time_window`` is set; VictoriaMetrics accepts
backfill within its retention.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hfsampler import selfmetrics as sm
from hfsampler.export.metrics import MetricModel, gpu_labels, host_labels
from hfsampler.fields import Kind
from hfsampler.profiling.recording import Recording
from hfsampler.remote_write.blocks import Block, Labels
from hfsampler.remote_write.config import EndpointConfig, endpoint_from_url
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Family, SeriesRegistry, Snapshot, with_external_labels

RAW_SUFFIX = "_raw"
# How long a replay may take, pushing and flushing together, before it gives up (--timeout).
TIMEOUT_S = 120.0
# After Ctrl-C: how long what is queued may still be sent.
INTERRUPT_FLUSH_S = 5.0
# --raw: samples encoded at once (a few MB of requests), and the shards sending them
RAW_BATCH_SAMPLES = 100_000
RAW_SHARDS = 4


def replay_labels(rec: Recording, extra: dict[str, str]) -> dict[str, str]:
    """External labels of a replay: the recording's labels and job identifiers, then ``extra``."""
    return {**rec.header.get("labels", {}), **rec.header.get("job", {}), **extra}


async def _backpressure(writer: RemoteWriter, stop: asyncio.Event, deadline: float) -> None:
    """Wait while the queue is over half full, so nothing is dropped for lack of room; not past
    the deadline, nor once stopped."""
    limit = writer.config.queue.capacity // 2
    loop = asyncio.get_running_loop()
    while writer.queued() > limit and not stop.is_set() and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


EXIT_DAMAGED = 65  # sysexits' EX_DATAERR: the recording had damaged parts, skipped


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay did: samples accepted and dropped (refused, or not sent in time), and
    whether it stopped early (``gave_up`` at the deadline, ``interrupted`` by Ctrl-C)."""

    sent: int
    dropped: int
    pushed: int  # samples of the recording handed to the writer
    gave_up: bool = False
    interrupted: bool = False
    stopped_at_ms: int | None = None  # the recording's time where pushing stopped early
    damaged: str | None = None  # the recording's damage (``Recording.problem``), if any

    @property
    def exit_code(self) -> int:
        """130 interrupted; 1 nothing replayed, or samples refused or not sent in time;
        ``EXIT_DAMAGED`` all that was readable sent, but damaged parts were skipped; else 0."""
        if self.interrupted:
            return 130
        if self.gave_up or self.dropped or not self.sent:
            return 1
        return EXIT_DAMAGED if self.damaged else 0

    def summary(self, path: str, timeout_s: float) -> str:
        text = f"replayed {self.sent} samples from {path}"
        if self.damaged:
            text += f" (the recording is {self.damaged})"
        if self.dropped:
            text += f"; {self.dropped} refused or not sent (see the log)"
        if self.stopped_at_ms is not None:
            why = "interrupted" if self.interrupted else f"gave up after {timeout_s:g} s"
            text += (
                f"; {why}: the recording from {self.stopped_at_ms} ms (epoch) on was not replayed"
            )
        elif self.interrupted:
            text += "; interrupted"
        elif self.gave_up:
            text += f"; gave up after {timeout_s:g} s"
        return text


def window_snapshots(rec: Recording, labels: dict[str, str]) -> list[Snapshot]:
    """One snapshot per window end, every group's statistics in it, as `hfsampler run` builds."""
    model = MetricModel(
        rec.devices,
        {g.name: g.fields for g in rec.groups},
        SelfMetrics(),
        labels,
        hostname=rec.header.get("host"),
        stale_after_windows=1 << 30,  # a replay ends series by ending, not with markers
    )
    by_end: dict[int, dict[str, Any]] = {}
    for gi, group in enumerate(rec.groups):
        w = rec.windows(gi)
        for k in range(len(w.t1_ns)):
            by_end.setdefault(int(w.t1_ns[k]), {})[group.name] = w.stats(k, group.fields)
    # a MIG slot empty when the recording began has no labels of its own: its rows stay out
    # (the header keeps the layout at the start; an instance created later is not replayed)
    up = np.array([d.is_gpu or d.mig is not None for d in rec.devices], dtype=np.bool_)
    return [model.snapshot(by_end[t1], up, t1) for t1 in sorted(by_end)]


def raw_snapshots(rec: Recording, labels: dict[str, str]) -> Any:
    """Per millisecond with data, a snapshot of every raw sample taken in it (the last wins).

    The first way ``--raw`` pushed, a ``Snapshot`` per millisecond; kept as the reference that
    ``RawBatches`` is tested against and ``benchmarks/replay.py`` measures it beside."""
    registry = SeriesRegistry()
    host = host_labels(rec.header.get("host") or "localhost")
    base = [with_external_labels(gpu_labels(d, host), labels) for d in rec.devices]
    held = np.array([d.is_gpu or d.mig is not None for d in rec.devices], dtype=np.bool_)
    for chunk in rec.raw_chunks():
        fields = rec.groups[chunk.group].fields
        series = []
        for c in range(len(chunk.gpu)):
            f = fields[chunk.field[c]]
            registry.family(f.name + RAW_SUFFIX, f"{f.help} Every distinct sample.",
                            "counter" if f.kind is Kind.COUNTER else "gauge", f.unit)  # fmt: skip
            own = dict(f.labels)  # a rail's or zone's own label
            series.append(registry.series(f.name + RAW_SUFFIX, {**base[chunk.gpu[c]], **own}))
        counts = np.diff(chunk.offsets)
        cell = np.repeat(np.arange(len(counts)), counts)
        ms = chunk.ts_us // 1000
        order = np.lexsort((cell, ms))  # by ms, then cell; a cell's samples stay in time order
        ms, cell, values = ms[order], cell[order], chunk.values[order]
        keep = held[chunk.gpu[cell]]  # an empty MIG slot's cells stay out, as in windows
        ms, cell, values = ms[keep], cell[keep], values[keep]
        # two samples of one series in one millisecond: Remote-Write keeps one, keep the last
        last = np.ones(len(ms), dtype=np.bool_)
        last[:-1] = (ms[1:] != ms[:-1]) | (cell[1:] != cell[:-1])
        ms, cell, values = ms[last], cell[last], values[last]
        bounds = np.nonzero(np.diff(ms))[0] + 1
        for idx in np.split(np.arange(len(ms)), bounds):
            if len(idx):
                yield Snapshot(int(ms[idx[0]]), [series[c] for c in cell[idx]],
                               values[idx].tolist(), registry.families)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RawBatch:
    """One batch of ``--raw``: per shard, a block of its series' samples."""

    blocks: tuple[tuple[int, Block], ...]  # (shard, block)
    first_ms: int  # the batch's earliest sample

    @property
    def samples(self) -> int:
        return sum(b.samples for _, b in self.blocks)


@dataclass(frozen=True, slots=True)
class _RawSeries:
    labels: Labels
    shard: int


class RawBatches:
    """A recording's raw samples as Remote-Write blocks, batch by batch, from the chunk arrays.

    Each series (group, GPU, field) keeps one sample per millisecond, the last, as a sample of
    ``NAME_raw`` at that millisecond, like ``raw_snapshots``. A series' last millisecond in a
    batch waits for the next (the next chunk may have a later sample in it), so a batch's
    samples are final and each series' timestamps strictly increase across batches.
    """

    def __init__(self, rec: Recording, labels: Mapping[str, str], n_shards: int,
                 batch_samples: int = RAW_BATCH_SAMPLES) -> None:  # fmt: skip
        self.rec = rec
        self.registry = SeriesRegistry()
        self.n_shards = n_shards
        self.batch_samples = batch_samples
        host = host_labels(rec.header.get("host") or "localhost")
        self._base = [with_external_labels(gpu_labels(d, host), labels) for d in rec.devices]
        # a MIG slot empty at the start has no labels of its own: left out, as in windows
        self._held = np.array([d.is_gpu or d.mig is not None for d in rec.devices], np.bool_)
        self._sid: dict[tuple[int, int, int], int] = {}
        self._series: list[_RawSeries] = []
        empty = np.empty(0, np.int64)
        self._carry: tuple[Any, Any, Any] = (empty, empty, np.empty(0))

    @property
    def families(self) -> Mapping[str, Family]:
        return self.registry.families

    def _series_id(self, group: int, gpu: int, field: int) -> int:
        key = (group, gpu, field)
        sid = self._sid.get(key)
        if sid is None:
            f = self.rec.groups[group].fields[field]
            name = f.name + RAW_SUFFIX
            kind = "counter" if f.kind is Kind.COUNTER else "gauge"
            self.registry.family(name, f"{f.help} Every distinct sample.", kind, f.unit)
            series = self.registry.series(name, {**self._base[gpu], **dict(f.labels)})
            sid = self._sid[key] = len(self._series)
            labels = Labels.of(series.all_labels())
            self._series.append(_RawSeries(labels, series.id % self.n_shards))
        return sid

    def __iter__(self) -> Iterator[RawBatch]:
        parts: list[tuple[Any, Any, Any]] = []
        pending = 0
        for chunk in self.rec.raw_chunks():
            held = self._held[chunk.gpu]
            cells = [self._series_id(chunk.group, int(g), int(f)) if ok else -1
                     for g, f, ok in zip(chunk.gpu, chunk.field, held, strict=True)]  # fmt: skip
            sid = np.repeat(np.array(cells, np.int64), np.diff(chunk.offsets))
            keep = sid >= 0
            parts.append((sid[keep], chunk.ts_us[keep] // 1000, chunk.values[keep]))
            pending += int(keep.sum())
            if pending >= self.batch_samples:
                batch = self._batch(parts, final=False)
                parts, pending = [], 0
                if batch is not None:
                    yield batch
        batch = self._batch(parts, final=True)
        if batch is not None:
            yield batch

    def _batch(self, parts: list[tuple[Any, Any, Any]], final: bool) -> RawBatch | None:
        sid, ms, val = (np.concatenate([c[k] for c in [self._carry, *parts]]) for k in range(3))
        order = np.argsort(sid, kind="stable")  # a series' samples stay in file (time) order
        sid, ms, val = sid[order], ms[order], val[order]
        same = sid[1:] == sid[:-1]
        if (same & (ms[1:] < ms[:-1])).any():  # a driver clock that stepped back: by time
            order = np.lexsort((ms, sid))
            sid, ms, val = sid[order], ms[order], val[order]
            same = sid[1:] == sid[:-1]
        # one sample per series and millisecond, the last (Remote-Write would keep one anyway)
        keep = np.ones(len(sid), dtype=np.bool_)
        keep[:-1] = ~same | (ms[1:] != ms[:-1])
        sid, ms, val = sid[keep], ms[keep], val[keep]
        if not final:
            last = np.ones(len(sid), dtype=np.bool_)
            last[:-1] = sid[1:] != sid[:-1]
            self._carry = (sid[last], ms[last], val[last])
            sid, ms, val = sid[~last], ms[~last], val[~last]
        if not len(sid):
            return None
        starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
        firsts = sid[starts].tolist()
        shard_of = np.array([self._series[i].shard for i in firsts], np.int64)
        per_sample = np.repeat(shard_of, np.diff(np.r_[starts, len(sid)]))
        blocks = []
        for k in range(self.n_shards):
            mine = np.flatnonzero(shard_of == k)
            if not len(mine):
                continue
            take = per_sample == k  # the shard's series, each still in one run, in sid order
            counts = np.diff(np.r_[starts, len(sid)])[mine]
            labels = tuple(self._series[firsts[i]].labels for i in mine.tolist())
            blocks.append((k, Block(labels, np.cumsum(counts), ms[take], val[take])))
        return RawBatch(tuple(blocks), int(ms.min()))


def raw_endpoint(url: str) -> EndpointConfig:
    """``--raw``'s endpoint: queues that hold a few batches, requests of a shard's batch."""
    config = endpoint_from_url(url)
    queue = replace(config.queue, capacity=8 * RAW_BATCH_SAMPLES, min_shards=RAW_SHARDS,
                    max_shards=max(RAW_SHARDS, config.queue.max_shards),
                    max_samples_per_send=RAW_BATCH_SAMPLES)  # fmt: skip
    return replace(config, queue=queue)


async def replay(
    rec: Recording,
    url: str,
    raw: bool,
    extra: dict[str, str],
    timeout_s: float = TIMEOUT_S,
    stop: asyncio.Event | None = None,
) -> ReplayResult:
    """Push the recording within ``timeout_s``; ``stop`` (set by Ctrl-C) ends it early, after
    flushing for at most ``INTERRUPT_FLUSH_S``."""
    metrics = SelfMetrics()
    writer = RemoteWriter(raw_endpoint(url) if raw else endpoint_from_url(url), metrics)
    labels = replay_labels(rec, extra)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stop = stop if stop is not None else asyncio.Event()
    pushed = 0
    stopped_at: int | None = None
    await writer.start()
    try:
        if raw:
            batches = RawBatches(rec, labels, writer.n_shards)
            for batch in batches:
                if stop.is_set() or loop.time() >= deadline:
                    stopped_at = batch.first_ms
                    break
                for shard, block in batch.blocks:
                    writer.push_block(shard, block, batches.families)
                pushed += batch.samples
                await _backpressure(writer, stop, deadline)
        else:
            for snap in window_snapshots(rec, labels):
                if stop.is_set() or loop.time() >= deadline:
                    stopped_at = snap.timestamp_ms
                    break
                writer.push(snap)
                pushed += len(snap)
                await _backpressure(writer, stop, deadline)
    finally:
        left = INTERRUPT_FLUSH_S if stop.is_set() else max(0.0, deadline - loop.time())
        await writer.close(left, stop, INTERRUPT_FLUSH_S)
    gave_up = (
        not stop.is_set()
        and loop.time() >= deadline
        and (stopped_at is not None or metrics.total(sm.RW_SAMPLES) < pushed)
    )
    return ReplayResult(
        int(metrics.total(sm.RW_SAMPLES)),
        int(metrics.total(sm.RW_DROPPED)),
        pushed,
        gave_up=gave_up,
        interrupted=stop.is_set(),
        stopped_at_ms=stopped_at,
        damaged=rec.problem if rec.damaged_parts else None,
    )

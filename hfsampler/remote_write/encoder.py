"""Encoder: turns samples into ``Block``s, and a block into Remote-Write 1.0 ``WriteRequest`` bytes.

Each series' ``Labels`` (its 1.0 label bytes, its strings for 2.0 and the spool) are made once
and kept by ``Series.id``; per window only the samples go into arrays (``Block.of``). Queues
hold blocks; at send time a request's block is written here as 1.0 (``write_request``: each
series' cached label bytes, then its samples written all at once by ``arrays.sample_bytes``)
or by ``encoder_v2`` as 2.0, and compressed once (``compress``). A histogram series' samples are
``TimeSeries.histograms`` entries (``histwrite``) instead of ``samples``.

An ``Encoder`` is used from one thread (the event loop's, where ``push`` runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import snappy

from hfsampler.remote_write.arrays import SampleBytes, Template, sample_bytes, uniform_rows
from hfsampler.remote_write.blocks import Block, Labels
from hfsampler.remote_write.histwrite import TAG_V1_TIMESERIES_HISTOGRAMS, entries
from hfsampler.remote_write.protowrite import (
    SMALL_LIMIT,
    SMALL_VARINTS,
    TAG_WRITE_REQUEST_TIMESERIES,
    encode_metadata,
    metadata_entry,
    varint,
)
from hfsampler.series import Family, Series, Snapshot, is_stale

# A TimeSeries entry's tag and length prefix, for the lengths most entries have.
_SERIES_HEADS = [TAG_WRITE_REQUEST_TIMESERIES + v for v in SMALL_VARINTS]
MAX_TEMPLATES = 32  # request series sets: a few per shard
_ID = attrgetter("id")


class QueuedSample(NamedTuple):
    """One sample waiting to be sent: which series, its value, its timestamp in ms."""

    series: Series
    value: float
    timestamp_ms: int


class Encoder:
    """Keeps each series' ``Labels`` and builds blocks of samples.

    Not thread-safe: one thread encodes with a given encoder.
    """

    def __init__(self) -> None:
        self._labels: dict[int, Labels] = {}
        self._distinct: dict[tuple[Labels, ...], None] = {}  # series sets with each series once

    @property
    def cached_series(self) -> int:
        """How many series' labels are cached."""
        return len(self._labels)

    def labels(self, series: Series) -> Labels:
        """The cached labels of ``series`` (encoded on first use)."""
        cached = self._labels.get(series.id)
        if cached is None:
            cached = self._labels[series.id] = Labels.of(series.all_labels())
        return cached

    def label_bytes(self, series: Series) -> bytes:
        """The cached 1.0 label bytes of ``series``."""
        return self.labels(series).v1

    def forget(self, series_ids: Iterable[int]) -> None:
        """Drop the labels of series that will never be sent again (their stale marker went)."""
        for sid in series_ids:
            self._labels.pop(sid, None)

    def block(self, samples: Sequence[QueuedSample], families: Iterable[Family] = ()) -> Block:
        """A block of ``samples`` (each series' samples in queued order) and ``families``."""
        if not samples:
            return Block.of([], 0, [], families)
        series, values, stamps = zip(*samples, strict=True)
        labels = list(map(self._labels.get, map(_ID, series)))
        if None in labels:
            labels = list(map(self.labels, series))
        # one timestamp for all: a window's (the usual case)
        ts: int | tuple[int, ...] = stamps[0] if stamps.count(stamps[0]) == len(stamps) else stamps
        vals = np.array(values, dtype=np.float64)
        key = tuple(labels)
        distinct = key in self._distinct  # the same series as an earlier window: no need to look
        block = Block.of(key, ts, vals, families, distinct=distinct)  # type: ignore[arg-type]
        if not distinct and len(block.series) == len(key):
            if len(self._distinct) >= MAX_TEMPLATES:
                self._distinct.clear()
            self._distinct[key] = None  # type: ignore[index]
        if np.isnan(vals).any():
            # a series that got its stale marker is over (a pod left, a GPU was lost): without
            # this the cache would grow with every pod that ever ran on the node
            self.forget(s.id for s, v in zip(series, values, strict=True) if is_stale(v))
        return block

    def encode_samples(self, samples: Sequence[QueuedSample], metadata: bytes = b"") -> bytes:
        """One ``WriteRequest``: a ``TimeSeries`` per series, its samples in queued order, then
        ``metadata`` (already-encoded entries, ``encode_metadata``)."""
        return write_request(self.block(samples)) + metadata

    def encode(
        self, snapshots: Iterable[Snapshot], *, families: Iterable[Family] | None = None
    ) -> bytes:
        """One ``WriteRequest`` holding every sample of ``snapshots``, plus optional metadata."""
        samples = [
            QueuedSample(series, value, snap.timestamp_ms)
            for snap in snapshots
            for series, value in snap.items()
        ]
        meta = encode_metadata(families) if families is not None else b""
        return self.encode_samples(samples, meta)


class RequestEncoderV1:
    """Writes blocks as 1.0 requests (``write_request``); a window of the same series as an
    earlier one (or windows merged, as many samples each) from that one's ``Template``. Used
    from several threads at once: the cache only ever gains whole entries (or is cleared)."""

    def __init__(self) -> None:
        self._templates: dict[tuple[tuple[Labels, ...], int, int], Template] = {}

    def encode(self, block: Block) -> bytes:
        n = len(block.series)
        if block.hist is not None:
            split = block.floats_then_histograms()
            if split is None or not split[0].series:
                return write_request(block)
            # the float series from their template, then the histogram series
            floats, histograms = split
            return (
                self.encode(floats)
                + _write_histograms(histograms, _NO_SAMPLES)
                + b"".join(map(metadata_entry, block.families))
            )
        if not n or block.samples % n:
            return write_request(block)
        per_series = block.samples // n  # several windows merged (a backlog): as many each
        if per_series > 1 and not np.array_equal(block.ends, np.arange(1, n + 1) * per_series):
            return write_request(block)
        rows = uniform_rows(block.timestamps_ms, block.values)
        if rows is None:
            return write_request(block)
        key = (block.series, rows.width, per_series)
        template = self._templates.get(key)
        if template is None:
            width = rows.width
            body = width * per_series
            parts = [_series_head(len(s.v1) + body) + s.v1 for s in block.series]
            template = Template.of([*parts, b""], width, per_series)
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.clear()
            self._templates[key] = template
        return template.fill(rows) + b"".join(map(metadata_entry, block.families))


_NO_SAMPLES = SampleBytes(b"", np.zeros(0, np.int64))


def write_request(block: Block) -> bytes:
    """The block as 1.0 ``WriteRequest`` bytes: a ``TimeSeries`` per series, in the block's
    order, then a metadata entry per family."""
    return _write(block, sample_bytes(block.timestamps_ms, block.values))


def _write(block: Block, encoded: SampleBytes) -> bytes:
    out: list[bytes] = []
    if block.hist is not None:
        return _write_histograms(block, encoded)
    if block.series:
        data = encoded.data
        heads = _SERIES_HEADS
        lo = 0
        for labels, hi in zip(block.series, encoded.ends[block.ends - 1].tolist(), strict=True):
            v1 = labels.v1
            body = len(v1) + hi - lo
            head = heads[body] if body < SMALL_LIMIT else _series_head(body)
            out += (head, v1, data[lo:hi])
            lo = hi
    out += map(metadata_entry, block.families)
    return b"".join(out)


def _write_histograms(block: Block, encoded: SampleBytes) -> bytes:
    """``_write`` for a block with histogram series (not the steady path: no templates)."""
    assert block.hist is not None
    out: list[bytes] = []
    lo = 0
    for labels, hi in zip(block.series, block.ends.tolist(), strict=True):
        if block.hist[hi - 1] == b"":
            samples = encoded.span(lo, hi)
        else:
            stamps = block.timestamps_ms[lo:hi].tolist()
            samples = entries(TAG_V1_TIMESERIES_HISTOGRAMS, block.hist[lo:hi], stamps)
        out += (_series_head(len(labels.v1) + len(samples)), labels.v1, samples)
        lo = hi
    out += map(metadata_entry, block.families)
    return b"".join(out)


def _series_head(body_len: int) -> bytes:
    if body_len < SMALL_LIMIT:
        return _SERIES_HEADS[body_len]
    return TAG_WRITE_REQUEST_TIMESERIES + varint(body_len)


def compress(raw: bytes) -> bytes:
    """Snappy block format, as Remote-Write 1.0 requires (not the framed/stream format)."""
    data: bytes = snappy.compress(raw)
    return data

"""Encoder for Remote-Write 2.0: one ``io.prometheus.write.v2.Request`` from a request's block.

The same block a 1.0 endpoint gets is written here as 2.0 at send time: a symbol table for the
whole request (each string once, ``symbols[0]`` empty), each series' label references, its
metadata (type, help, unit, from the catalogue's families as they are at send time, so a spool
replayed before the first window gets them once they are known) and, for counters whose start
is known, ``start_timestamp`` on every sample at or after it. Samples are written all at once
(``arrays.sample_bytes``: a 2.0 ``Sample`` has the 1.0 one's fields and tags); a histogram series'
as ``TimeSeries.histograms`` entries (``histwrite``), its metadata type HISTOGRAM.

What a series needs in every request (its strings, metadata and start) is kept by its labels;
a request's symbol table and each series' references are kept by the request's series (the
same tuple of ``Labels`` comes back window after window, each shard's series in their order),
so a steady window costs what 1.0 costs: a length prefix and slices per series.

Shards build requests in executor threads at once: that is safe, since each request's symbol
table is its own and the caches only ever gain whole entries (or are cleared).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from hfsampler.remote_write.arrays import Template, sample_bytes, uniform_rows
from hfsampler.remote_write.blocks import Block, Labels
from hfsampler.remote_write.histwrite import TAG_V2_TIMESERIES_HISTOGRAMS, entries
from hfsampler.remote_write.protowrite import METRIC_TYPES, SMALL_LIMIT, SMALL_VARINTS, varint
from hfsampler.series import Family

# 2.0 tags: (field << 3) | wire type
_TAG_SYMBOLS = b"\x22"  # Request.symbols = 4
_TAG_TIMESERIES = b"\x2a"  # Request.timeseries = 5
_TAG_LABELS_REFS = b"\x0a"  # TimeSeries.labels_refs = 1 (packed)
_TAG_METADATA = b"\x2a"  # TimeSeries.metadata = 5
_TAG_META_TYPE = b"\x08"  # Metadata.type = 1
_TAG_META_HELP = b"\x18"  # Metadata.help_ref = 3
_TAG_META_UNIT = b"\x20"  # Metadata.unit_ref = 4
_TAG_START_TS = b"\x18"  # Sample.start_timestamp = 3

CONTENT_TYPE = "application/x-protobuf;proto=io.prometheus.write.v2.Request"
VERSION = "2.0.0"
# A family hfsampler does not know (a relabelled name): the spec's "unspecified".
_UNKNOWN = Family("", "", "unknown")
# Cache entries kept at most: a series that ends is not told to this encoder, so churn is bounded
# by clearing, as for the 1.0 encoder's labels.
MAX_CACHED_SERIES = 1 << 17
MAX_CACHED_TABLES = 32  # request series sets: a few per shard
_HEADS = [_TAG_TIMESERIES + v for v in SMALL_VARINTS]


@dataclass(frozen=True, slots=True)
class _Series:
    """What a series needs in every request: its strings, its metadata and its start."""

    strings: tuple[str, ...]  # name, value, name, value, ... in byte order of name
    meta_type: bytes  # the Metadata.type field, b"" when unknown
    help: str
    unit: str
    start_tail: bytes  # the Sample.start_timestamp field, b"" when unknown
    start_ms: int
    known: bool  # its family was known: the answer holds for later requests


@dataclass(frozen=True, slots=True)
class _Table:
    """A request's symbol table and, per series, what comes before and after its samples; the
    templates of requests of one sample per series, by the samples' width."""

    symbols: bytes
    refs: tuple[bytes, ...]  # the labels_refs field
    metas: tuple[bytes, ...]  # the metadata field
    starts: tuple[_Series | None, ...]  # the series whose samples take a start timestamp
    any_start: bool
    # -1 when every family was known; else how many families there were (once there are more,
    # one may be a family unknown here: the table is made again)
    families_seen: int
    # by (width, how many of the first series: all, or the floats before histogram series)
    templates: dict[tuple[int, int], Template] = field(default_factory=dict)


def _ref(ref: int) -> bytes:
    return SMALL_VARINTS[ref] if ref < SMALL_LIMIT else varint(ref)


class RequestEncoderV2:
    """Writes blocks as 2.0 ``Request`` bytes.

    ``families`` gives the current metric families by name (the catalogue's, as the metric
    model registered them); ``start_ms`` the start of a counter family, 0 when unknown.
    """

    def __init__(
        self,
        families: Callable[[], Mapping[str, Family]],
        start_ms: Callable[[Family], int] = lambda family: 0,
    ) -> None:
        self._families = families
        self._start_ms = start_ms
        self._series: dict[bytes, _Series] = {}
        self._tables: dict[tuple[Labels, ...], _Table] = {}

    def encode(self, block: Block) -> tuple[bytes, int]:
        """The 2.0 request for ``block`` and the number of samples in it.

        The block's families (1.0 metadata entries) are left out: 2.0 carries metadata on
        every series."""
        table = self._tables.get(block.series)
        if table is None or (
            table.families_seen >= 0 and len(self._families()) != table.families_seen
        ):
            table = self._table(block.series)
        # a start timestamp makes a sample's bytes its own: no template for those
        floats, histograms = block, None
        if block.hist is not None and (split := block.floats_then_histograms()) is not None:
            floats, histograms = split  # the floats from a template, the histograms after
        k = len(floats.series)
        if k and floats.samples == k and not table.any_start and floats.hist is None:
            rows = uniform_rows(floats.timestamps_ms, floats.values)
            if rows is not None:
                template = table.templates.get((rows.width, k))
                if template is None:
                    template = self._template(table, rows.width, k)
                    table.templates[rows.width, k] = template
                request = template.fill(rows)
                if histograms is not None:
                    request += self._histogram_series(table, histograms, k)
                return request, block.samples
        encoded = sample_bytes(block.timestamps_ms, block.values)
        data = encoded.data
        byte_ends = encoded.ends[block.ends - 1].tolist()
        out: list[bytes] = [table.symbols]
        heads = _HEADS
        lo = 0
        for i, hi in enumerate(byte_ends):
            refs, meta, start = table.refs[i], table.metas[i], table.starts[i]
            a, b = int(block.ends[i - 1]) if i else 0, int(block.ends[i])
            if block.hist is not None and block.hist[b - 1] != b"":
                stamps = block.timestamps_ms[a:b].tolist()
                samples = entries(TAG_V2_TIMESERIES_HISTOGRAMS, block.hist[a:b], stamps)
            elif start is None:
                samples = data[lo:hi]
            else:
                samples = _with_start(data, encoded.ends, a, b, start, block)
            body = len(refs) + len(samples) + len(meta)
            out += (
                heads[body] if body < SMALL_LIMIT else _TAG_TIMESERIES + varint(body),
                refs,
                samples,
                meta,
            )
            lo = hi
        return b"".join(out), block.samples

    def _table(self, series: tuple[Labels, ...]) -> _Table:
        families = self._families()
        symbols: dict[str, int] = {"": 0}
        refs_out: list[bytes] = []
        metas: list[bytes] = []
        starts: list[_Series | None] = []
        known = True
        for labels in series:
            info = self._series.get(labels.v1)
            if info is None:
                info = self._learn(labels, families)
            known = known and info.known
            refs = []
            for text in info.strings:
                ref = symbols.get(text)
                if ref is None:
                    ref = symbols[text] = len(symbols)
                refs.append(_ref(ref))
            packed = b"".join(refs)
            refs_out.append(_TAG_LABELS_REFS + varint(len(packed)) + packed)
            meta = info.meta_type
            for tag, text in ((_TAG_META_HELP, info.help), (_TAG_META_UNIT, info.unit)):
                if text:
                    ref = symbols.get(text)
                    if ref is None:
                        ref = symbols[text] = len(symbols)
                    meta += tag + varint(ref)
            metas.append(_TAG_METADATA + varint(len(meta)) + meta)
            starts.append(info if info.start_tail else None)
        table = _Table(
            b"".join(_TAG_SYMBOLS + varint(len(d)) + d for d in map(str.encode, symbols)),
            tuple(refs_out),
            tuple(metas),
            tuple(starts),
            any(starts),
            -1 if known else len(families),
        )
        if len(self._tables) >= MAX_CACHED_TABLES:
            self._tables.clear()
        self._tables[series] = table
        return table

    @staticmethod
    def _histogram_series(table: _Table, block: Block, first: int) -> bytes:
        """The ``TimeSeries`` of ``block``'s series (histogram ones), which are ``table``'s from
        ``first`` on."""
        assert block.hist is not None
        out: list[bytes] = []
        lo = 0
        for i, hi in enumerate(block.ends.tolist()):
            refs, meta = table.refs[first + i], table.metas[first + i]
            stamps = block.timestamps_ms[lo:hi].tolist()
            samples = entries(TAG_V2_TIMESERIES_HISTOGRAMS, block.hist[lo:hi], stamps)
            body = len(refs) + len(samples) + len(meta)
            head = _HEADS[body] if body < SMALL_LIMIT else _TAG_TIMESERIES + varint(body)
            out += (head, refs, samples, meta)
            lo = hi
        return b"".join(out)

    @staticmethod
    def _template(table: _Table, width: int, count: int) -> Template:
        """The request of ``table``'s first ``count`` series with one sample each, ``width``
        bytes wide (the request's whole symbol table before them)."""
        parts = [table.symbols]
        for refs, meta in zip(table.refs[:count], table.metas[:count], strict=True):
            body = len(refs) + width + len(meta)
            head = _HEADS[body] if body < SMALL_LIMIT else _TAG_TIMESERIES + varint(body)
            parts[-1] += head + refs
            parts.append(meta)
        return Template.of(parts, width)

    def _learn(self, labels: Labels, families: Mapping[str, Family]) -> _Series:
        family = families.get(labels.name, _UNKNOWN)
        start = self._start_ms(family) if family.type == "counter" else 0
        metric_type = METRIC_TYPES.get(family.type, 0)
        info = _Series(
            labels.strings,
            _TAG_META_TYPE + varint(metric_type) if metric_type else b"",
            family.help,
            family.unit,
            _TAG_START_TS + varint(start) if start else b"",
            start,
            family is not _UNKNOWN,
        )
        if family is _UNKNOWN:
            return info  # not cached: its family may be known by the next request
        if len(self._series) >= MAX_CACHED_SERIES:
            self._series.clear()
        self._series[labels.v1] = info
        return info


def _with_start(
    data: bytes, ends: npt.NDArray[np.int64], a: int, b: int, info: _Series, block: Block
) -> bytes:
    """Samples ``a`` to ``b`` with the start timestamp on each one at or after the start (a
    sample spooled by an earlier process, before it, gets none)."""
    parts = []
    tail = info.start_tail
    for k in range(a, b):
        lo = int(ends[k - 1]) if k else 0
        sample = data[lo : int(ends[k])]
        if int(block.timestamps_ms[k]) >= info.start_ms:
            body = sample[2:] + tail
            sample = b"\x12" + SMALL_VARINTS[len(body)] + body
        parts.append(sample)
    return b"".join(parts)

"""Encoder: turns windows into per-shard ``Block``s of serialized Remote-Write 1.0 bytes.

It writes the protobuf wire format directly instead of building message objects: each series'
``Label`` bytes are encoded once and kept by ``Series.id``; per window only the samples (a double
and a varint timestamp) and each ``TimeSeries`` length prefix are written. A ``Block`` is one
shard's part of a window: its bytes are ``WriteRequest`` fields, so blocks concatenate into one
request. Queues hold blocks, memory and disk alike; the sender concatenates and compresses them.
The generated modules in ``prompb/`` are the reference the tests hold this encoder to; it never
imports them, so the hot path does not depend on the protobuf runtime.

An ``Encoder`` keeps a cache and is used from one thread: each writer has its own, on its own
encoding thread (``BlockEncoder``), so encoding never runs on the event loop.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import snappy

from hfsampler.series import Family, Series, Snapshot, is_stale

# Tags are (field_number << 3) | wire_type; wire type 2 is length-delimited, 1 is 64-bit, 0 varint.
_TAG_WRITE_REQUEST_TIMESERIES = b"\x0a"  # WriteRequest.timeseries = 1
_TAG_WRITE_REQUEST_METADATA = b"\x1a"  # WriteRequest.metadata = 3
_TAG_TIMESERIES_LABELS = b"\x0a"  # TimeSeries.labels = 1
_TAG_TIMESERIES_SAMPLES = 0x12  # TimeSeries.samples = 2
_TAG_LABEL_NAME = b"\x0a"  # Label.name = 1
_TAG_LABEL_VALUE = b"\x12"  # Label.value = 2
_TAG_SAMPLE_VALUE = 0x09  # Sample.value = 1 (fixed64 double)
_TAG_SAMPLE_TIMESTAMP = b"\x10"  # Sample.timestamp = 2 (varint int64)
_TAG_METADATA_TYPE = b"\x08"  # MetricMetadata.type = 1
_TAG_METADATA_NAME = b"\x12"  # MetricMetadata.metric_family_name = 2
_TAG_METADATA_HELP = b"\x22"  # MetricMetadata.help = 4
_TAG_METADATA_UNIT = b"\x2a"  # MetricMetadata.unit = 5

# MetricMetadata.MetricType values from prompb/types.proto.
METRIC_TYPES: Mapping[str, int] = {
    "unknown": 0,
    "counter": 1,
    "gauge": 2,
    "histogram": 3,
    "gaugehistogram": 4,
    "summary": 5,
    "info": 6,
    "stateset": 7,
}

_T = TypeVar("_T")
_pack_double = struct.Struct("<d").pack
_UINT64 = 1 << 64


class QueuedSample(NamedTuple):
    """One sample waiting to be sent: which series, its value, its timestamp in ms."""

    series: Series
    value: float
    timestamp_ms: int


def varint(value: int) -> bytes:
    """Protobuf base-128 varint; negative int64 values take ten bytes (two's complement)."""
    if value < 0:
        value += _UINT64
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Length prefixes of most TimeSeries fit here; a table lookup beats computing the varint.
_SMALL_LIMIT = 1 << 14
_SMALL_VARINTS = [varint(i) for i in range(_SMALL_LIMIT)]


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


def encode_labels(series: Series) -> bytes:
    """The repeated ``TimeSeries.labels`` entries for a series, in the registry's byte order."""
    parts = []
    for name, value in series.all_labels():
        label = _field(_TAG_LABEL_NAME, name.encode()) + _field(_TAG_LABEL_VALUE, value.encode())
        parts.append(_field(_TAG_TIMESERIES_LABELS, label))
    return b"".join(parts)


def encode_metadata(families: Iterable[Family]) -> bytes:
    """The repeated ``WriteRequest.metadata`` entries for metric families (sorted by name)."""
    parts = []
    for fam in sorted(families, key=lambda f: f.name):
        # proto3 leaves default values off the wire; doing the same keeps the bytes canonical.
        body = b""
        mtype = METRIC_TYPES.get(fam.type, 0)
        if mtype:
            body += _TAG_METADATA_TYPE + varint(mtype)
        if fam.name:
            body += _field(_TAG_METADATA_NAME, fam.name.encode())
        if fam.help:
            body += _field(_TAG_METADATA_HELP, fam.help.encode())
        if fam.unit:
            body += _field(_TAG_METADATA_UNIT, fam.unit.encode())
        parts.append(_field(_TAG_WRITE_REQUEST_METADATA, body))
    return b"".join(parts)


class Encoder:
    """Serializes samples into ``WriteRequest`` bytes, caching each series' label bytes.

    Not thread-safe: one thread encodes with a given encoder (``BlockEncoder`` owns one).
    """

    def __init__(self) -> None:
        self._labels: dict[int, bytes] = {}
        # Sample framing depends only on the timestamp; a window shares one timestamp.
        self._ts_frames: dict[int, tuple[bytes, bytes]] = {}

    @property
    def cached_series(self) -> int:
        """How many series' label bytes are cached."""
        return len(self._labels)

    def label_bytes(self, series: Series) -> bytes:
        """The cached label bytes for ``series`` (encoded on first use)."""
        cached = self._labels.get(series.id)
        if cached is None:
            cached = encode_labels(series)
            self._labels[series.id] = cached
        return cached

    def forget(self, series_ids: Iterable[int]) -> None:
        """Drop cached label bytes for series that will never be sent again."""
        for sid in series_ids:
            self._labels.pop(sid, None)

    def _frame(self, timestamp_ms: int) -> tuple[bytes, bytes]:
        frame = self._ts_frames.get(timestamp_ms)
        if frame is None:
            ts = _TAG_SAMPLE_TIMESTAMP + varint(timestamp_ms)
            sample_len = 1 + 8 + len(ts)
            head = bytes((_TAG_TIMESERIES_SAMPLES, sample_len, _TAG_SAMPLE_VALUE))
            frame = (head, ts)
            if len(self._ts_frames) > 64:
                # Timestamps move forward; old frames are never needed again.
                self._ts_frames.clear()
            self._ts_frames[timestamp_ms] = frame
        return frame

    def encode_samples(self, samples: Sequence[QueuedSample], metadata: bytes = b"") -> bytes:
        """One ``WriteRequest``: a ``TimeSeries`` per series, its samples in queued order.

        ``metadata`` is already-encoded ``WriteRequest.metadata`` entries (``encode_metadata``).
        """
        # Group by series so labels go out once per request; dicts keep first-seen order. Each
        # bucket is [series, sample bytes...].
        grouped: dict[int, list[Any]] = {}
        get_bucket = grouped.get
        pack = _pack_double
        last_ts: int | None = None
        head = tail = b""
        ended: list[int] = []
        for series, value, ts in samples:
            if value != value and is_stale(value):  # NaN first: the cheap test on the hot path
                ended.append(series.id)
            if ts != last_ts:
                head, tail = self._frame(ts)
                last_ts = ts
            # Pack the float as-is: the stale marker's NaN payload must survive bit for bit.
            sample = head + pack(value) + tail
            bucket = get_bucket(series.id)
            if bucket is None:
                grouped[series.id] = [series, sample]
            else:
                bucket.append(sample)
        out: list[bytes] = []
        append = out.append
        label_of = self._labels.get
        small = _SMALL_VARINTS
        for sid, bucket in grouped.items():
            labels = label_of(sid) or self.label_bytes(bucket[0])
            if len(bucket) == 2:
                sample = bucket[1]
                body_len = len(labels) + len(sample)
                prefix = small[body_len] if body_len < _SMALL_LIMIT else varint(body_len)
                append(_TAG_WRITE_REQUEST_TIMESERIES + prefix + labels + sample)
                continue
            body = b"".join(bucket[1:])
            body_len = len(labels) + len(body)
            prefix = small[body_len] if body_len < _SMALL_LIMIT else varint(body_len)
            append(_TAG_WRITE_REQUEST_TIMESERIES + prefix + labels + body)
        if metadata:
            append(metadata)
        # a series that got its stale marker is over (a pod left, a GPU was lost): without this
        # the cache would grow with every pod that ever ran on the node
        self.forget(ended)
        return b"".join(out)

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


@dataclass(frozen=True, slots=True)
class Block:
    """One shard's encoded part of a window (or of several, read back from disk).

    ``encoded`` resolves to ``WriteRequest`` bytes (``TimeSeries`` and metadata entries);
    ``series_ids`` are the series in it, empty for a block read back from disk.
    """

    samples: int
    encoded: Future[bytes]
    series_ids: tuple[int, ...] = ()

    @classmethod
    def ready(cls, data: bytes, samples: int, series_ids: tuple[int, ...] = ()) -> Block:
        """A block whose bytes are already there (read from disk, built in a test)."""
        done: Future[bytes] = Future()
        done.set_result(data)
        return cls(samples, done, series_ids)

    async def data(self) -> bytes:
        """The block's bytes, waiting for the encoding thread if it is not done yet."""
        return await wait_done(self.encoded)


async def wait_done(future: Future[_T]) -> _T:
    """A thread's result, awaited on the running loop."""
    return await asyncio.wrap_future(future)


class BlockEncoder:
    """Encodes blocks in order on one thread of its own, with one ``Encoder``."""

    def __init__(self, name: str = "rw-encode") -> None:
        self.encoder = Encoder()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)

    def block(
        self, samples: list[QueuedSample], metadata: Callable[[], bytes] | None = None
    ) -> Block:
        """A block for ``samples`` (and metadata entries first, when given); returns at once."""
        ids = tuple(dict.fromkeys(s.series.id for s in samples))

        def encode() -> bytes:
            head = metadata() if metadata is not None else b""
            return head + self.encoder.encode_samples(samples)

        return Block(len(samples), self._thread.submit(encode), ids)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=False)


def compress(raw: bytes) -> bytes:
    """Snappy block format, as Remote-Write 1.0 requires (not the framed/stream format)."""
    data: bytes = snappy.compress(raw)
    return data

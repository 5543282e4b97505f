"""Histogram writing: a ``NativeHistogram`` as a Remote-Write ``Histogram`` message, by hand.

1.0's ``prometheus.Histogram`` (prompb/types.proto, carried in ``TimeSeries.histograms = 4``) and
2.0's ``io.prometheus.write.v2.Histogram`` (``TimeSeries.histograms = 3``) share fields 1 to 16
and their numbers; 2.0 adds ``start_timestamp = 17``. Integer histograms only: counts go in the
``*_int`` oneof members and ``*_deltas``, never the float ones. As protowrite.py does, the bytes
are what the protobuf library writes for the same message (tests hold them to it).

A queued histogram sample is its message ``histogram_body`` (every field but the timestamps, which
come last in number order): blocks keep it, and at send time ``entries`` adds each sample's
timestamp and frames it for either protocol; ``entry_sizes`` is the same in bytes, for sizing.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from hfsampler.histograms import NativeHistogram
from hfsampler.remote_write.protowrite import (
    SMALL_LIMIT,
    SMALL_VARINTS,
    field,
    varint,
    varint_len,
    zigzag,
)

# Tags: (field_number << 3) | wire_type (0 varint, 1 64-bit, 2 length-delimited).
TAG_V1_TIMESERIES_HISTOGRAMS = b"\x22"  # prometheus.TimeSeries.histograms = 4
TAG_V2_TIMESERIES_HISTOGRAMS = b"\x1a"  # io.prometheus.write.v2.TimeSeries.histograms = 3
_TAG_COUNT_INT = b"\x08"  # count_int = 1 (oneof count)
_TAG_SUM = b"\x19"  # sum = 3, double
_TAG_SCHEMA = b"\x20"  # schema = 4, sint32
_TAG_ZERO_THRESHOLD = b"\x29"  # zero_threshold = 5, double
_TAG_ZERO_COUNT_INT = b"\x30"  # zero_count_int = 6 (oneof zero_count)
_TAG_NEGATIVE_SPANS = b"\x42"  # negative_spans = 8
_TAG_NEGATIVE_DELTAS = b"\x4a"  # negative_deltas = 9, packed sint64
_TAG_POSITIVE_SPANS = b"\x5a"  # positive_spans = 11
_TAG_POSITIVE_DELTAS = b"\x62"  # positive_deltas = 12, packed sint64
_TAG_RESET_HINT = b"\x70"  # reset_hint = 14
_TAG_TIMESTAMP = b"\x78"  # timestamp = 15, int64
_TAG_START_TIMESTAMP = b"\x88\x01"  # start_timestamp = 17 (2.0 only), int64
_TAG_SPAN_OFFSET = b"\x08"  # BucketSpan.offset = 1, sint32
_TAG_SPAN_LENGTH = b"\x10"  # BucketSpan.length = 2, uint32
_DOUBLE = struct.Struct("<d")


def _double(tag: bytes, value: float) -> bytes:
    raw = _DOUBLE.pack(value)
    # proto3 leaves a default off the wire; the library tests the bits, so -0.0 is written.
    return b"" if raw == b"\x00" * 8 else tag + raw


def _spans(tag: bytes, spans: tuple[tuple[int, int], ...]) -> bytes:
    out = []
    for offset, length in spans:
        body = (_TAG_SPAN_OFFSET + varint(zigzag(offset)) if offset else b"") + (
            _TAG_SPAN_LENGTH + varint(length) if length else b""
        )
        out.append(field(tag, body))
    return b"".join(out)


def _deltas(tag: bytes, deltas: tuple[int, ...]) -> bytes:
    if not deltas:
        return b""
    small = SMALL_VARINTS  # a bucket's delta is mostly a few hundred at most: a table look-up
    encoded = [small[z] if (z := zigzag(d)) < SMALL_LIMIT else varint(z) for d in deltas]
    return field(tag, b"".join(encoded))


def histogram_message(h: NativeHistogram, timestamp_ms: int, start_timestamp_ms: int = 0) -> bytes:
    """The ``Histogram`` message's body, fields in number order; ``start_timestamp_ms`` (2.0
    only; 0 for unknown, as the spec says) is left off when 0."""
    parts = [
        _TAG_COUNT_INT + varint(h.count),  # a oneof member is written even when 0
        _double(_TAG_SUM, h.sum),
        _TAG_SCHEMA + varint(zigzag(h.schema)) if h.schema else b"",
        _double(_TAG_ZERO_THRESHOLD, h.zero_threshold),
        _TAG_ZERO_COUNT_INT + varint(h.zero_count),
        _spans(_TAG_NEGATIVE_SPANS, h.negative_spans),
        _deltas(_TAG_NEGATIVE_DELTAS, h.negative_deltas),
        _spans(_TAG_POSITIVE_SPANS, h.positive_spans),
        _deltas(_TAG_POSITIVE_DELTAS, h.positive_deltas),
        _TAG_RESET_HINT + varint(h.reset_hint) if h.reset_hint else b"",
        _TAG_TIMESTAMP + varint(timestamp_ms) if timestamp_ms else b"",
        _TAG_START_TIMESTAMP + varint(start_timestamp_ms) if start_timestamp_ms else b"",
    ]
    return b"".join(parts)


def histogram_entry_v1(h: NativeHistogram, timestamp_ms: int) -> bytes:
    """One 1.0 ``TimeSeries.histograms`` entry, tag and length included."""
    return field(TAG_V1_TIMESERIES_HISTOGRAMS, histogram_message(h, timestamp_ms))


def histogram_entry_v2(h: NativeHistogram, timestamp_ms: int, start_timestamp_ms: int = 0) -> bytes:
    """One 2.0 ``TimeSeries.histograms`` entry, tag and length included."""
    return field(
        TAG_V2_TIMESERIES_HISTOGRAMS, histogram_message(h, timestamp_ms, start_timestamp_ms)
    )


def histogram_body(h: NativeHistogram) -> bytes:
    """The message without its timestamps: what a block keeps of a histogram sample."""
    return histogram_message(h, 0)


def entries(tag: bytes, bodies: Iterable[bytes], timestamps_ms: Iterable[int]) -> bytes:
    """The ``TimeSeries.histograms`` entries (``tag``: 1.0's or 2.0's) of one series' samples."""
    out = []
    for body, ts in zip(bodies, timestamps_ms, strict=True):
        message = body + _TAG_TIMESTAMP + varint(ts) if ts else body
        out.append(field(tag, message))
    return b"".join(out)


def entry_size(body: bytes, timestamp_ms: int) -> int:
    """``entry_sizes`` of one sample, without numpy: for the few of a window's histograms."""
    stamp = varint_len(timestamp_ms % (1 << 64))
    if not body:
        return 12 + stamp
    message = len(body) + (1 + stamp if timestamp_ms else 0)
    return 1 + varint_len(message) + message


def entry_sizes(
    timestamps_ms: npt.NDArray[np.int64], bodies: npt.NDArray[np.object_]
) -> npt.NDArray[np.int64]:
    """Each sample's bytes in a 1.0 ``TimeSeries``: a ``Sample`` for a float (empty body), a
    ``histograms`` entry for a histogram."""
    u = timestamps_ms.view(np.uint64)
    vlen = np.ones(len(u), dtype=np.int64)
    for k in range(1, 10):
        vlen += u >= np.uint64(1 << (7 * k))
    lengths = np.fromiter(map(len, bodies), np.int64, len(bodies))
    message = lengths + np.where(timestamps_ms != 0, 1 + vlen, 0)
    head = np.ones(len(u), dtype=np.int64)
    for k in range(1, 5):
        head += message >= (1 << (7 * k))
    float_sample = 12 + vlen  # tag, length, value's tag and 8 bytes, timestamp's tag and varint
    return np.where(lengths == 0, float_sample, 1 + head + message)

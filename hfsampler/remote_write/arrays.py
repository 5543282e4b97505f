"""Arrays: every ``Sample`` message of a request written at once, vectorised with numpy.

A block keeps its samples as arrays; both serializers (``encoder.write_request`` for 1.0,
``encoder_v2`` for 2.0, whose ``Sample`` has the same fields) turn them into bytes here, as rows
of a byte matrix (tag, length, tag, the double's 8 bytes, tag, the timestamp's varint), and then
give each series its cached label bytes (or references) plus a slice of those rows. A steady
window (one sample per series, one timestamp) is never made into rows: its request's ``Template``
holds every constant byte, and only the values' bytes and the one timestamp varint go in
(``uniform_rows``, ``Template.fill``). The bytes are what the protobuf library writes for the
same samples (tests hold it to that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.remote_write.protowrite import varint

_SAMPLES_TAG = 0x12  # TimeSeries.samples = 2
_VALUE_TAG = 0x09  # Sample.value = 1, fixed64
_TIMESTAMP_TAG = 0x10  # Sample.timestamp = 2, varint
_FIXED = 12  # a row's bytes before the varint: 2 of framing, 1 + 8 of value, 1 of tag
_MAX_VARINT = 10


@dataclass(frozen=True, slots=True)
class SampleBytes:
    """The ``TimeSeries.samples`` entries of a batch, back to back; sample ``i`` of the batch
    is ``data[ends[i - 1]:ends[i]]``."""

    data: bytes
    ends: npt.NDArray[np.int64]
    rows: npt.NDArray[np.uint8] | None = None  # one row per sample, when all are as wide

    def span(self, a: int, b: int) -> bytes:
        """Samples ``a`` to ``b`` (exclusive), as bytes."""
        lo = int(self.ends[a - 1]) if a > 0 else 0
        return self.data[lo : int(self.ends[b - 1])] if b > a else b""


def sample_bytes(ts_ms: npt.ArrayLike, values: npt.ArrayLike) -> SampleBytes:
    """Every sample of the batch encoded, in the order given (int64 ms; float64, bit for bit)."""
    u = np.ascontiguousarray(ts_ms, dtype=np.int64).view(np.uint64)  # a negative: 10 bytes
    n = len(u)
    if n and u[0] == u[-1] and bool((u == u[0]).all()):  # a window: one timestamp, written once
        tail = np.frombuffer(bytes((_TIMESTAMP_TAG,)) + varint(int(u[0])), dtype=np.uint8)
        rows = np.empty((n, _FIXED - 1 + len(tail)), dtype=np.uint8)
        rows[:, 0] = _SAMPLES_TAG
        rows[:, 1] = rows.shape[1] - 2
        rows[:, 2] = _VALUE_TAG
        rows[:, 3:11] = np.ascontiguousarray(values, dtype="<f8").view(np.uint8).reshape(n, 8)
        rows[:, 11:] = tail
        ends = np.arange(1, n + 1, dtype=np.int64) * rows.shape[1]
        return SampleBytes(rows.tobytes(), ends, rows)
    vlen = np.ones(n, dtype=np.int64)
    for k in range(1, _MAX_VARINT):
        vlen += u >= np.uint64(1 << (7 * k))
    widest = int(vlen.max()) if n else 1
    rows = np.empty((n, _FIXED + widest), dtype=np.uint8)
    rows[:, 0] = _SAMPLES_TAG
    rows[:, 1] = _FIXED - 2 + vlen
    rows[:, 2] = _VALUE_TAG
    rows[:, 3:11] = np.ascontiguousarray(values, dtype="<f8").view(np.uint8).reshape(n, 8)
    rows[:, 11] = _TIMESTAMP_TAG
    for k in range(widest):
        byte = ((u >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        rows[:, _FIXED + k] = byte | np.where(vlen > k + 1, 0x80, 0).astype(np.uint8)
    width = _FIXED + vlen
    if n and int(vlen.min()) == widest:  # the usual case: every timestamp as wide
        return SampleBytes(rows.tobytes(), np.cumsum(width), rows)
    data = rows[np.arange(rows.shape[1]) < width[:, None]].tobytes()
    return SampleBytes(data, np.cumsum(width))


@dataclass(frozen=True, slots=True)
class Rows:
    """The samples of a batch whose ``Sample`` entries are all as wide, as a ``Template`` takes
    them: ``width`` bytes each, of which only the value's 8 and the timestamp's varint vary."""

    width: int
    values: npt.NDArray[np.uint8]  # (samples, 8): each value's bytes, little-endian
    stamps: npt.NDArray[np.uint8]  # the timestamp varint's bytes: (width - 12,) for all, a window,
    # or (samples, width - 12), one row each


def uniform_rows(ts_ms: npt.NDArray[np.int64], values: npt.NDArray[np.float64]) -> Rows | None:
    """The batch as ``Rows`` when every sample's entry is as wide, else None. A window (one
    timestamp for all, the usual case) costs a view of its values and one varint: no row of
    bytes is made for it."""
    u = np.ascontiguousarray(ts_ms, dtype=np.int64).view(np.uint64)
    n = len(u)
    if not n:
        return None
    vals = np.ascontiguousarray(values, dtype="<f8").view(np.uint8).reshape(n, 8)
    first = int(u[0])
    if first == u[-1] and bool((u == first).all()):
        stamp = np.frombuffer(varint(first), dtype=np.uint8)
        return Rows(_FIXED + len(stamp), vals, stamp)
    rows = sample_bytes(u.view(np.int64), values).rows
    if rows is None:
        return None
    return Rows(rows.shape[1], rows[:, 3:11], rows[:, _FIXED:])


@dataclass(frozen=True, slots=True)
class Template:
    """A request of one sample per series with each sample's value and timestamp left out: a
    steady window (the same series, in the same order, as the last one) is written by putting
    its values and timestamp in, all at once, instead of series by series."""

    buf: npt.NDArray[np.uint8]  # the request, each sample's constant bytes (tags, length) in
    values: npt.NDArray[np.intp]  # where each sample's value bytes go, one row per series
    stamps: npt.NDArray[np.intp]  # where each sample's timestamp varint goes, one row per series

    @classmethod
    def of(cls, parts: list[bytes], width: int, per_series: int = 1) -> Template:
        """The request ``parts[0] + samples of series 0 + parts[1] + ... + samples of series
        n-1 + parts[n]`` for ``per_series`` ``Sample`` entries of ``width`` bytes each (more
        than one: windows of the same series merged, a backlog's)."""
        row = bytes((_SAMPLES_TAG, width - 2, _VALUE_TAG)) + bytes(8) + bytes((_TIMESTAMP_TAG,))
        entries = (row + bytes(width - _FIXED)) * per_series
        buf = np.frombuffer(entries.join(parts), dtype=np.uint8).copy()
        n = len(parts) - 1
        lengths = np.fromiter((len(p) for p in parts[:-1]), np.intp, n)
        starts = np.cumsum(lengths) + width * per_series * np.arange(n)
        # [series, entry, byte] -> [series, its entries' bytes]
        at = (starts[:, None] + width * np.arange(per_series))[:, :, None]
        return cls(
            buf,
            (at + np.arange(3, 11)).reshape(n, -1),
            (at + np.arange(_FIXED, width)).reshape(n, -1),
        )

    def fill(self, rows: Rows) -> bytes:
        """The request with ``rows`` put in: as many samples per series as the template's,
        series by series, each as wide as the template's."""
        buf = self.buf.copy()
        n, stamp_bytes = self.stamps.shape
        buf[self.values] = rows.values.reshape(n, -1)
        stamps = rows.stamps
        if stamps.ndim == 1:  # one timestamp for all: the same bytes in every entry
            stamps = np.tile(stamps, stamp_bytes // len(stamps))
        else:
            stamps = stamps.reshape(n, -1)
        buf[self.stamps] = stamps
        return buf.tobytes()

"""Array encoder: ``WriteRequest`` bytes from columns of samples, vectorised with numpy.

``Encoder`` writes a sample at a time, which suits a window (a few hundred series, one sample
each); a recording's raw samples (``replay --raw``) are millions of samples of a few hundred
series, already in arrays. Here every ``Sample`` message of a batch is built at once as rows of
a byte matrix (tag, length, tag, the double's 8 bytes, tag, the timestamp's varint), and each
series' ``TimeSeries`` is its cached label bytes plus a slice of those rows. The bytes are the
same as ``Encoder.encode_samples`` writes for the same samples (tests hold it to that), so the
queues, the sender and the receivers see no difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.remote_write.encoder import varint

_TIMESERIES = b"\x0a"  # WriteRequest.timeseries = 1
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

    def span(self, a: int, b: int) -> bytes:
        """Samples ``a`` to ``b`` (exclusive), as bytes."""
        lo = int(self.ends[a - 1]) if a > 0 else 0
        return self.data[lo : int(self.ends[b - 1])] if b > a else b""


def sample_bytes(ts_ms: npt.ArrayLike, values: npt.ArrayLike) -> SampleBytes:
    """Every sample of the batch encoded, in the order given (int64 ms; float64, bit for bit)."""
    u = np.ascontiguousarray(ts_ms, dtype=np.int64).view(np.uint64)  # a negative: 10 bytes
    n = len(u)
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
        data = rows.tobytes()
    else:
        data = rows[np.arange(rows.shape[1]) < width[:, None]].tobytes()
    return SampleBytes(data, np.cumsum(width))


def timeseries(label_bytes: bytes, samples: SampleBytes, a: int, b: int) -> bytes:
    """One ``WriteRequest.timeseries`` entry: the series' labels and samples ``a`` to ``b``."""
    body = samples.span(a, b)
    return _TIMESERIES + varint(len(label_bytes) + len(body)) + label_bytes + body

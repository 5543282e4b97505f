"""Window statistics: vectorised reductions of one window's ring rows per GPU and field.

Only distinct samples count (the sampler has already turned repeats into NaN). Gauges get min,
max, mean, p99 and last; counters and states keep their last value; bitmasks are OR-ed over the
window so that a reason active for 2 ms still shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.fields import Field, Kind
from hfsampler.ring import Ring, RingRows

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

P99 = 0.99


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One group's statistics over ``[t0_ns, t1_ns)``: arrays indexed ``[gpu, field]``."""

    t0_ns: int
    t1_ns: int
    fields: tuple[Field, ...]
    min: FloatArray
    max: FloatArray
    mean: FloatArray
    p99: FloatArray
    last: FloatArray  # bitmask fields: the OR over the window
    count: IntArray  # distinct samples
    ticks: int
    lateness_p99_ns: int
    lateness_max_ns: int


def reduce(rows: RingRows, fields: Sequence[Field], t0_ns: int, t1_ns: int) -> WindowStats:
    """Reduce ``rows`` (already limited to the window) to its statistics."""
    values = rows.values
    n = values.shape[0]
    valid = ~np.isnan(values)
    count = valid.sum(axis=0)
    nan = np.full(values.shape[1:], np.nan)
    if n == 0:
        empty = nan.copy()
        return WindowStats(
            t0_ns, t1_ns, tuple(fields), empty, empty, empty, empty, empty,
            count.astype(np.int64), 0, 0, 0,
        )  # fmt: skip
    # NaN sorts last, so the distinct samples of each cell are the first `count` rows
    ordered = np.sort(values, axis=0)
    has = count > 0
    last_row = np.maximum(count - 1, 0)
    mn = np.where(has, ordered[0], np.nan)
    mx = np.where(has, np.take_along_axis(ordered, last_row[None], axis=0)[0], np.nan)
    # p99 by linear interpolation between closest ranks, as numpy's default quantile
    pos = (count - 1).clip(min=0) * P99
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, last_row)
    lo_v = np.take_along_axis(ordered, lo[None], axis=0)[0]
    hi_v = np.take_along_axis(ordered, hi[None], axis=0)[0]
    p99 = np.where(has, lo_v + (hi_v - lo_v) * (pos - lo), np.nan)
    total = np.where(valid, values, 0.0).sum(axis=0)
    mean = np.divide(total, count, out=np.full(count.shape, np.nan), where=has)
    # last distinct sample per cell: the highest row index that is valid
    last_idx = n - 1 - np.argmax(valid[::-1], axis=0)
    last = np.where(has, np.take_along_axis(values, last_idx[None], axis=0)[0], np.nan)
    for j, f in enumerate(fields):
        if f.kind is Kind.BITMASK:
            bits = np.where(valid[:, :, j], values[:, :, j], 0.0).astype(np.int64)
            last[:, j] = np.where(has[:, j], np.bitwise_or.reduce(bits, axis=0), np.nan)
    late = rows.lateness_ns
    return WindowStats(
        t0_ns,
        t1_ns,
        tuple(fields),
        mn,
        mx,
        mean,
        p99,
        last,
        count.astype(np.int64),
        n,
        int(np.percentile(late, 99)) if n else 0,
        int(late.max()) if n else 0,
    )


class WindowReader:
    """Follows one ring and hands out each window's rows; rows past the window end wait."""

    def __init__(self, ring: Ring) -> None:
        self._ring = ring
        self._seq = ring.write_seq
        self._pending = RingRows.empty(ring.gpus, ring.fields)
        self.lost_rows = 0

    def take(self, t1_ns: int) -> RingRows:
        """Every row with a read time before ``t1_ns`` not handed out yet."""
        self._seq, fresh, lost = self._ring.read_since(self._seq)
        self.lost_rows += lost
        rows = RingRows.concat([self._pending, fresh]) if len(self._pending) else fresh
        inside = rows.time_ns < t1_ns
        self._pending = rows.select(~inside)
        return rows.select(inside)

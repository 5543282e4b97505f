"""Windows: where each one ends, and what its ring rows reduce to per GPU and field.

``STATS`` is the one list of window statistics. The metric model, the catalogue's exported names,
the recording and the report all iterate it, so a new statistic is one entry here. Only distinct
samples count (the sampler has already turned repeats into NaN). Gauges export min, max, mean and
p99; counters and states export their last value; bitmasks are OR-ed over the window so that a
reason active for 2 ms still shows. Every statistic is computed and recorded for every field.

The sampler's own health over a window (ticks, lateness) is ``TickStats``, apart from the data.
``WindowClock`` says where windows end, for ``run``, ``record`` and the benchmarks alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.fields import Field, Kind
from hfsampler.sampling.ring import Ring, RingRows

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

WINDOW_GRACE_S = 0.01  # the sampler's last row of a window is committed by then


# -- the statistics ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Samples:
    """One window's distinct samples, in the forms every statistic reduces from."""

    fields: tuple[Field, ...]
    values: FloatArray  # [row, gpu, field], NaN where the row holds no distinct sample
    ordered: FloatArray  # values sorted by row: NaN sorts last, so a cell's samples come first
    valid: BoolArray  # [row, gpu, field]
    count: IntArray  # [gpu, field] distinct samples

    @property
    def has(self) -> BoolArray:
        return self.count > 0

    def ranked(self, rank: IntArray) -> FloatArray:
        """Per cell, its distinct sample of that rank (0: the smallest)."""
        out: FloatArray = np.take_along_axis(self.ordered, rank[None], axis=0)[0]
        return out

    def quantile(self, q: float) -> FloatArray:
        """Linear interpolation between closest ranks, as numpy's default quantile."""
        top = np.maximum(self.count - 1, 0)
        pos = top * q
        lo = np.floor(pos).astype(np.int64)
        lo_v, hi_v = self.ranked(lo), self.ranked(np.minimum(lo + 1, top))
        return np.where(self.has, lo_v + (hi_v - lo_v) * (pos - lo), np.nan)


def _min(s: Samples) -> FloatArray:
    return np.where(s.has, s.ordered[0], np.nan)


def _max(s: Samples) -> FloatArray:
    return np.where(s.has, s.ranked(np.maximum(s.count - 1, 0)), np.nan)


def _mean(s: Samples) -> FloatArray:
    total = np.where(s.valid, s.values, 0.0).sum(axis=0)
    mean: FloatArray = np.divide(total, s.count, out=np.full(s.count.shape, np.nan), where=s.has)
    return mean


def _quantile(q: float) -> Callable[[Samples], FloatArray]:
    return lambda s: s.quantile(q)


def _last(s: Samples) -> FloatArray:
    """The last distinct sample per cell; for bitmask fields the OR of every sample instead."""
    last_row = s.values.shape[0] - 1 - np.argmax(s.valid[::-1], axis=0)
    last = np.where(s.has, np.take_along_axis(s.values, last_row[None], axis=0)[0], np.nan)
    for j, f in enumerate(s.fields):
        if f.kind is Kind.BITMASK:
            bits = np.where(s.valid[:, :, j], s.values[:, :, j], 0.0).astype(np.int64)
            last[:, j] = np.where(s.has[:, j], np.bitwise_or.reduce(bits, axis=0), np.nan)
    return last


@dataclass(frozen=True, slots=True, eq=False)
class Stat:
    """One window statistic: its name, its series, how it reduces, which fields export it."""

    name: str  # its key in WindowStats and in recordings
    suffix: str  # its series is the field's name plus this ("": the field's own name)
    reduce: Callable[[Samples], FloatArray]
    # per field kind that exports it, how its series' HELP ends; other kinds only record it
    help: Mapping[Kind, str]

    def exports(self, kind: Kind) -> bool:
        return kind in self.help


_LAST = "last value in the window"
MIN = Stat("min", "_min", _min, {Kind.GAUGE: "minimum over the window"})
MAX = Stat("max", "_max", _max, {Kind.GAUGE: "maximum over the window"})
MEAN = Stat("mean", "", _mean, {Kind.GAUGE: "mean over the window"})
P99 = Stat("p99", "_p99", _quantile(0.99), {Kind.GAUGE: "99th percentile over the window"})
# counters, states and bitmasks: one value under the field's name, never averaged
LAST = Stat(
    "last", "", _last, {Kind.COUNTER: _LAST, Kind.STATE: _LAST, Kind.BITMASK: "OR over the window"}
)
STATS: tuple[Stat, ...] = (MIN, MAX, MEAN, P99, LAST)


def suffixes(kind: Kind) -> tuple[str, ...]:
    """The series suffixes a field of ``kind`` exports: its own name ("") first, then siblings."""
    return tuple(sorted((s.suffix for s in STATS if s.exports(kind)), key=bool))


def exported_names(field: Field) -> tuple[str, ...]:
    """Every series name a field exports: its own name first, then its window siblings."""
    return tuple(field.name + s for s in suffixes(field.kind))


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One group's statistics over ``[t0_ns, t1_ns)``: per statistic, an array ``[gpu, field]``."""

    t0_ns: int
    t1_ns: int
    fields: tuple[Field, ...]
    values: Mapping[str, FloatArray]  # by Stat.name; a recording has the statistics it names
    count: IntArray  # distinct samples

    def __getitem__(self, stat: Stat) -> FloatArray:
        return self.values[stat.name]


def reduce(
    rows: RingRows,
    fields: Sequence[Field],
    t0_ns: int,
    t1_ns: int,
    *,
    only: Sequence[int] | None = None,
) -> WindowStats:
    """Reduce ``rows`` (already limited to the window) to every statistic in ``STATS``.

    ``only``: the GPU rows that can have samples (a MIG GPU's instance slots have none in most
    groups); the others are not looked at and get NaN and a count of 0.
    """
    gpus = rows.values.shape[1]
    if only is not None and len(only) < gpus:
        at = np.asarray(only, dtype=np.intp)
        part = reduce(
            RingRows(rows.time_ns, rows.lateness_ns, rows.values[:, at], rows.driver_ts_us[:, at]),
            fields,
            t0_ns,
            t1_ns,
        )
        full = {}
        for name, v in part.values.items():
            out = np.full((gpus, v.shape[1]), np.nan)
            out[at] = v
            full[name] = out
        count = np.zeros((gpus, part.count.shape[1]), dtype=np.int64)
        count[at] = part.count
        return WindowStats(t0_ns, t1_ns, part.fields, full, count)
    values = rows.values
    valid = ~np.isnan(values)
    count = valid.sum(axis=0).astype(np.int64)
    if values.shape[0] == 0:
        empty = np.full(values.shape[1:], np.nan)
        return WindowStats(t0_ns, t1_ns, tuple(fields), {s.name: empty for s in STATS}, count)
    samples = Samples(tuple(fields), values, np.sort(values, axis=0), valid, count)
    stats = {s.name: s.reduce(samples) for s in STATS}
    return WindowStats(t0_ns, t1_ns, samples.fields, stats, count)


@dataclass(frozen=True, slots=True)
class TickStats:
    """The sampler's health over one window: how many ticks, how late they started."""

    ticks: int
    lateness_p99_ns: int
    lateness_max_ns: int

    @classmethod
    def of(cls, rows: RingRows) -> TickStats:
        late = rows.lateness_ns
        if not len(late):
            return cls(0, 0, 0)
        return cls(len(late), int(np.percentile(late, 99)), int(late.max()))


# -- where windows end ---------------------------------------------------------------------------


class WindowClock:
    """Windows end on wall-clock multiples of the window length and are read a grace later.

    The first window runs from the start to the next multiple; each later one starts where the
    one before ended. A caller that stalled may ``catch_up``: the window in progress then covers
    every window it missed (``run`` does, to stay current; ``record`` writes each one instead).
    """

    __slots__ = ("_clock_ns", "grace_ns", "t0_ns", "t1_ns", "window_ns")

    def __init__(
        self,
        window_s: float,
        grace_s: float = WINDOW_GRACE_S,
        clock_ns: Callable[[], int] = time.time_ns,
        start_ns: int | None = None,
    ) -> None:
        self.window_ns = int(window_s * 1e9)
        self.grace_ns = int(grace_s * 1e9)
        self._clock_ns = clock_ns
        self.t0_ns = clock_ns() if start_ns is None else start_ns
        self.t1_ns = self.t0_ns - self.t0_ns % self.window_ns + self.window_ns

    @property
    def due_ns(self) -> int:
        """When the window in progress can be read: its end and the grace."""
        return self.t1_ns + self.grace_ns

    def wait_s(self) -> float:
        """Seconds until the window in progress is due (0 if it already is)."""
        return max(0.0, (self.due_ns - self._clock_ns()) / 1e9)

    def advance(self) -> None:
        """The window in progress was read: the next one starts where it ended."""
        self.t0_ns, self.t1_ns = self.t1_ns, self.t1_ns + self.window_ns

    def catch_up(self) -> int:
        """After a stall of more than a window, stretch the window in progress to the current one.

        Returns how many window ends it skipped.
        """
        now = self._clock_ns()
        if now <= self.t1_ns + self.window_ns:
            return 0
        skipped = (now - self.t1_ns) // self.window_ns
        self.t1_ns += skipped * self.window_ns
        return skipped


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
        k = int(np.count_nonzero(inside))
        if inside[:k].all():
            # the window's rows come first (always, but after a step back of the wall clock):
            # slices are views, where a mask copied a second of the ring again (12 MB at 64 GPUs)
            self._pending = rows.select(slice(k, None))
            return rows.select(slice(None, k))
        self._pending = rows.select(~inside)
        return rows.select(inside)

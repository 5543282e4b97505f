"""Bounded reducers of time-ordered samples: what a report keeps while it streams a recording.

Each keeps state of a size fixed up front (by the number of plot buckets, phase edges or
histogram bins), never by the number of samples, and takes samples a chunk at a time in time
order: a per-bucket envelope for plots, a held signal's integrals read at fixed times (phase and
step edges), per-segment maxima between those times, a fixed-bin histogram for percentiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

PLOT_BUCKETS = 2000  # per plot: about one per pixel of a wide figure
HISTOGRAM_BIN_W = 0.5  # power percentiles are read to this resolution
HISTOGRAM_BINS = 4096  # 0 .. 2048 W; above that counts in the top bin


@dataclass(frozen=True, slots=True)
class Buckets:
    """``n`` equal time buckets from ``t0_us`` over ``span_us``: a plot's x resolution."""

    t0_us: int
    span_us: float
    n: int = PLOT_BUCKETS

    @property
    def width_us(self) -> float:
        return max(self.span_us, 1.0) / self.n

    def index(self, t_us: IntArray) -> IntArray:
        b: IntArray = ((t_us - self.t0_us) / self.width_us).astype(np.int64)
        return b.clip(0, self.n - 1)

    def seconds(self, b: IntArray) -> FloatArray:
        """A bucket's start, in seconds from ``t0_us``."""
        return np.asarray(b * self.width_us / 1e6, np.float64)


@dataclass(slots=True)
class Envelope:
    """Per bucket, the lowest and highest raw sample of one series: what a plot draws."""

    buckets: Buckets
    lo: FloatArray = field(init=False)
    hi: FloatArray = field(init=False)

    def __post_init__(self) -> None:
        self.lo = np.full(self.buckets.n, np.inf)
        self.hi = np.full(self.buckets.n, -np.inf)

    def add(self, t_us: IntArray, values: FloatArray) -> None:
        """Samples in time order (the bucket indices only grow)."""
        if not len(values):
            return
        b = self.buckets.index(t_us)
        starts = np.flatnonzero(np.diff(b, prepend=-1))
        at = b[starts]
        self.lo[at] = np.minimum(self.lo[at], np.minimum.reduceat(values, starts))
        self.hi[at] = np.maximum(self.hi[at], np.maximum.reduceat(values, starts))

    def points(self) -> tuple[FloatArray, FloatArray]:
        """(seconds from start, value): min then max per bucket with data."""
        have = np.nonzero(np.isfinite(self.lo))[0]
        t = self.buckets.seconds(have) + self.buckets.width_us / 2e6
        return np.repeat(t, 2), np.column_stack([self.lo[have], self.hi[have]]).ravel()


@dataclass(slots=True)
class WindowSeries:
    """One window statistic of every GPU, reduced to buckets: min, max and mean per bucket."""

    buckets: Buckets
    gpus: int
    lo: FloatArray = field(init=False)
    hi: FloatArray = field(init=False)
    total: FloatArray = field(init=False)
    n: IntArray = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.gpus, self.buckets.n)
        self.lo, self.hi = np.full(shape, np.inf), np.full(shape, -np.inf)
        self.total, self.n = np.zeros(shape), np.zeros(shape, np.int64)

    def add(self, t0_ns: int, values: FloatArray) -> None:
        """One window's value per GPU (NaN: none), placed at the window's start."""
        b = int(self.buckets.index(np.array([t0_ns // 1000]))[0])
        ok = np.isfinite(values)
        v = np.where(ok, values, 0.0)
        self.lo[:, b] = np.fmin(self.lo[:, b], np.where(ok, values, np.inf))
        self.hi[:, b] = np.fmax(self.hi[:, b], np.where(ok, values, -np.inf))
        self.total[:, b] += v
        self.n[:, b] += ok

    def series(self, gpu: int, how: str) -> tuple[FloatArray, FloatArray]:
        """(seconds from start, value) per bucket with data; ``how``: min, max or mean."""
        have = np.nonzero(self.n[gpu])[0]
        t = self.buckets.seconds(have)
        if how == "min":
            return t, self.lo[gpu, have]
        if how == "max":
            return t, self.hi[gpu, have]
        return t, self.total[gpu, have] / self.n[gpu, have]


@dataclass(frozen=True, slots=True)
class Intervals:
    """A held signal's intervals in one chunk: ``[start_us, start_us + held_us)`` at ``value``,
    followed by ``following`` (the next sample's value, for the trapezoid)."""

    start_us: IntArray
    value: FloatArray
    following: FloatArray
    held_us: FloatArray


@dataclass(slots=True)
class Held:
    """A signal where each sample holds until the next: the intervals of each chunk, in turn.

    Where the wall clock steps back (NTP, a VM restored), the interval that would go negative
    holds for zero, and the steps are counted: integrals never run backwards."""

    last_t: int | None = None
    last_v: float = np.nan
    last_gap: int = 0  # the interval before the newest sample: the stream's period, about
    steps_back: int = 0
    stepped_back_us: int = 0  # how far, all steps together

    def intervals(self, t: IntArray, v: FloatArray) -> Intervals:
        """Every sample before the newest, which holds on into the next chunk."""
        if self.last_t is not None:
            t = np.concatenate([[self.last_t], t])
            v = np.concatenate([[self.last_v], v])
        if len(t):
            self.last_t, self.last_v = int(t[-1]), float(v[-1])
        held = t[1:] - t[:-1]
        if len(held) and held[-1] > 0:
            self.last_gap = int(held[-1])
        back = held < 0
        if back.any():
            self.steps_back += int(back.sum())
            self.stepped_back_us -= int(held[back].sum())
            held = np.where(back, 0, held)
        return Intervals(t[:-1], v[:-1], v[1:], held.astype(np.float64))

    def tail(self, end_us: int) -> Intervals:
        """The newest sample held on to ``end_us`` (the recording's end), but for no longer than
        the interval before it: a driver value holds for its refresh period, and a stream that
        stopped long before the end is not stretched over the rest."""
        if self.last_t is None or not np.isfinite(self.last_v):
            return Intervals(np.empty(0, np.int64), np.empty(0), np.empty(0), np.empty(0))
        held = max(0, min(end_us - self.last_t, self.last_gap))
        one = np.array([self.last_v])
        return Intervals(np.array([self.last_t], np.int64), one, one, np.array([float(held)]))


@dataclass(slots=True)
class Readout:
    """Running integrals of ``k`` quantities of one stream over time, read at fixed times
    ``at_us`` (one stream each: it reads a time once the stream has passed it).

    The value at a time between two samples is interpolated linearly within the interval it
    falls in, which is exact for a held signal and, for the trapezoid energy, off by less than one
    interval's curvature.
    """

    at_us: IntArray
    k: int
    values: FloatArray = field(init=False)
    total: FloatArray = field(init=False)
    _next: int = 0
    _latest_us: float = -np.inf  # the latest time added: a clock stepped back reads on from it

    def __post_init__(self) -> None:
        self.values = np.zeros((self.k, len(self.at_us)))
        self.total = np.zeros(self.k)

    def add(self, start_us: IntArray, held_us: FloatArray, q: FloatArray) -> None:
        """Intervals ``[start, start + held)`` in time order, each with ``q[:, i]`` of every
        quantity."""
        if not len(start_us):
            return
        times = np.append(start_us, start_us[-1] + held_us[-1]).astype(np.float64)
        times = np.maximum.accumulate(np.maximum(times, self._latest_us))  # as np.interp needs
        self._latest_us = float(times[-1])
        hi = int(np.searchsorted(self.at_us, times[-1], side="right"))
        if hi > self._next:
            want = self.at_us[self._next : hi].astype(np.float64)
            for j in range(self.k):
                c = np.concatenate([[0.0], np.cumsum(q[j])]) + self.total[j]
                self.values[j, self._next : hi] = np.interp(want, times, c)
            self._next = hi
        self.total += q.sum(axis=1)

    def finish(self) -> None:
        """Times after the last sample read the final totals."""
        self.values[:, self._next :] = self.total[:, None]
        self._next = len(self.at_us)

    def between(self, a: int, b: int) -> FloatArray:
        """Each quantity's integral from ``at_us[a]`` to ``at_us[b]``."""
        out: FloatArray = self.values[:, b] - self.values[:, a]
        return out


@dataclass(slots=True)
class SegmentMax:
    """The largest sample in each segment between fixed times ``at_us`` (segment ``s`` is
    ``[at_us[s - 1], at_us[s])``; 0 is before the first, ``len(at_us)`` after the last)."""

    at_us: IntArray
    top: FloatArray = field(init=False)

    def __post_init__(self) -> None:
        self.top = np.full(len(self.at_us) + 1, -np.inf)

    def add(self, t_us: IntArray, values: FloatArray) -> None:
        if not len(values):
            return
        seg = np.searchsorted(self.at_us, t_us, side="right")
        if seg[0] == seg[-1]:
            self.top[seg[0]] = max(self.top[seg[0]], float(values.max()))
            return
        starts = np.flatnonzero(np.diff(seg, prepend=-1))
        at = seg[starts]
        self.top[at] = np.maximum(self.top[at], np.maximum.reduceat(values, starts))

    def between(self, a: int, b: int) -> float:
        """The largest sample from ``at_us[a]`` to ``at_us[b]`` (NaN if none)."""
        top = float(self.top[a + 1 : b + 1].max()) if b > a else -np.inf
        return top if np.isfinite(top) else np.nan


def histogram_bins(values: FloatArray) -> IntArray:
    """Each value's bin in a power histogram (``HISTOGRAM_BIN_W`` wide, clamped at both ends)."""
    b: IntArray = (values / HISTOGRAM_BIN_W).astype(np.int64).clip(0, HISTOGRAM_BINS - 1)
    return b


def histogram_count(bins: IntArray) -> IntArray:
    out: IntArray = np.bincount(bins, minlength=HISTOGRAM_BINS)
    return out


def histogram_quantile(counts: IntArray, q: float) -> float:
    """The ``q`` quantile of the binned samples, interpolated within its bin (NaN if none):
    within ``HISTOGRAM_BIN_W`` of numpy's exact percentile."""
    n = int(counts.sum())
    if not n:
        return np.nan
    rank = q * (n - 1)  # numpy's linear method: position among the sorted samples
    cum = np.cumsum(counts)
    k = int(np.searchsorted(cum, rank, side="right"))
    before = cum[k - 1] if k else 0
    inside = (rank - before + 0.5) / counts[k]
    return (k + min(max(float(inside), 0.0), 1.0)) * HISTOGRAM_BIN_W

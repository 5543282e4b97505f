"""Native histograms: Prometheus's exponential buckets, and a cumulative accumulator of samples.

A leaf, like ``series.py``: the sampling stage counts each window's distinct samples into a
``HistogramAccumulator`` per GPU (``add_window``: all GPUs of a window in one pass), Remote-Write
encodes its ``NativeHistogram`` snapshots and /metrics will expose them, so the arithmetic sits
below all three stages.

Conventions are Prometheus's (model/histogram/generic.go, client_golang's histogram.go): with
``schema`` s the growth factor is ``2^(2^-s)``; positive bucket ``i`` holds ``(base^(i-1),
base^i]`` and negative bucket ``i`` its mirror ``[-base^i, -base^(i-1))``; values with
``|v| <= zero_threshold`` go to the zero bucket; ``+Inf`` goes to the bucket above the one holding
``MaxFloat64``. NaN is not an observation here: in a window NaN means "no distinct sample".
Bounds inside an octave are the correctly rounded ``2^(j/2^s)``; Prometheus's literal table is a
few ulps off at some entries, which moves only values within ~1e-15 of a boundary.

The error: a bucket's values lie within a factor ``base`` of each other, so any estimate inside
the bucket that holds the true value (what ``histogram_quantile`` returns) is off by at most
``base - 1`` (schema 3: 9.05%), and the bucket's centre ``2·l·u/(l+u)`` by at most
``(base-1)/(base+1)`` (schema 3: 4.33%), the "relative accuracy" that picks the schema.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SCHEMA_MIN = -4  # Prometheus's ExponentialSchemaMin
SCHEMA_MAX = 8  # ExponentialSchemaMax
# client_golang's DefNativeHistogramZeroThreshold (2^-128): only values that are zero for any
# physical purpose go to the zero bucket, and every schema has a bucket boundary there.
DEFAULT_ZERO_THRESHOLD = 2.0**-128
DEFAULT_RELATIVE_ERROR = 0.05  # gives schema 3
# A gap of up to this many empty buckets is filled with zero counts rather than opening a new span:
# an empty bucket costs one delta byte, a new span two varints (client_golang does the same).
MAX_FILLED_GAP = 2
_MAX_FLOAT = float(np.finfo(np.float64).max)


class ResetHint(enum.IntEnum):
    """``Histogram.ResetHint`` in both Remote-Write protocols (same numbers)."""

    UNKNOWN = 0
    YES = 1  # a counter reset happened before this sample: the first snapshot after a (re)start
    NO = 2  # counts only grew since the previous snapshot
    GAUGE = 3


def growth(schema: int) -> float:
    """The ratio of a bucket's upper bound to its lower bound."""
    return float(2.0 ** (2.0**-schema))


def bucket_error(schema: int) -> float:
    """The largest relative distance from a bucket's values to its centre, ``(base-1)/(base+1)``."""
    base = growth(schema)
    return (base - 1) / (base + 1)


def quantile_error_bound(schema: int) -> float:
    """How far ``histogram_quantile`` can be, relatively, from the exact quantile: ``base - 1``
    (its estimate and the true quantile lie in one bucket)."""
    return growth(schema) - 1


def schema_for_error(relative_error: float) -> int:
    """The coarsest schema whose ``bucket_error`` is at most ``relative_error``; ``SCHEMA_MAX``
    when none is (and ``SCHEMA_MIN`` for errors above even its)."""
    if not relative_error > 0:
        raise ValueError(f"relative error must be above 0, got {relative_error}")
    for schema in range(SCHEMA_MIN, SCHEMA_MAX + 1):
        if bucket_error(schema) <= relative_error:
            return schema
    return SCHEMA_MAX


def _check_schema(schema: int) -> None:
    if not SCHEMA_MIN <= schema <= SCHEMA_MAX:
        raise ValueError(f"schema must be in [{SCHEMA_MIN}, {SCHEMA_MAX}], got {schema}")


def _frac_bounds(schema: int) -> FloatArray:
    # The bucket boundaries inside [0.5, 1), as math.Frexp's fraction: 2^(j/2^s) / 2. Python's
    # pow agrees bit for bit with Prometheus's table (tests hold it to generic.go's).
    n = 1 << schema
    return np.array([math.ldexp(2.0 ** (j / n), -1) for j in range(n)])


_BOUNDS = {s: _frac_bounds(s) for s in range(1, SCHEMA_MAX + 1)}


def bucket_indices(magnitudes: FloatArray, schema: int) -> IntArray:
    """The bucket index of each value, for values above 0 (``+Inf`` included), as client_golang
    computes it: frexp's fraction looked up among the schema's bounds, or, for schemas up to 0,
    the exponent grouped ``2^-schema`` at a time (rounding down, as its shift does)."""
    _check_schema(schema)
    v = np.asarray(magnitudes, dtype=np.float64)
    inf = np.isinf(v)
    if inf.any():
        v = np.where(inf, _MAX_FLOAT, v)
    frac, exp = np.frexp(v)
    exp = exp.astype(np.int64)
    if schema > 0:
        bounds = _BOUNDS[schema]
        # sort.SearchFloat64s: the first bound >= frac, so a value on a boundary goes below it.
        keys = np.searchsorted(bounds, frac, side="left").astype(np.int64) + (exp - 1) * len(bounds)
    else:
        keys = exp - (frac == 0.5)
        keys = (keys + ((1 << -schema) - 1)) >> -schema
    out: IntArray = keys + inf.astype(np.int64)
    return out


def bucket_bound(index: int, schema: int) -> float:
    """The upper bound of positive bucket ``index`` (Prometheus's getBoundExponential)."""
    _check_schema(schema)
    if schema < 0:
        frac, exp = 1.0, index << -schema
        if exp == 1024:
            return _MAX_FLOAT
    else:
        frac = 0.5 if schema == 0 else float(_BOUNDS[schema][index & ((1 << schema) - 1)])
        exp = (index >> schema) + 1
        if frac == 0.5 and exp == 1025:
            return _MAX_FLOAT
    try:
        return math.ldexp(frac, exp)
    except OverflowError:  # the +Inf bucket's top, as Go's Ldexp gives it
        return math.inf


@dataclass(frozen=True, slots=True)
class NativeHistogram:
    """One integer native histogram, as Remote-Write carries it: spans of consecutive buckets
    (the first's offset is its start index, each later one's the empty buckets before it) and
    each bucket's count as the difference from the previous bucket's (the first's from 0)."""

    schema: int
    zero_threshold: float
    zero_count: int
    count: int
    sum: float
    positive_spans: tuple[tuple[int, int], ...]  # (offset, length)
    positive_deltas: tuple[int, ...]
    negative_spans: tuple[tuple[int, int], ...]
    negative_deltas: tuple[int, ...]
    reset_hint: ResetHint


def spans_and_deltas(
    indices: IntArray, counts: IntArray
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Spans and deltas for buckets ``indices`` (ascending, distinct) holding ``counts``; gaps of
    up to ``MAX_FILLED_GAP`` empty buckets are filled with zeros rather than split."""
    # A GPU's histogram holds a few dozen buckets: a plain loop beats numpy's per-call overhead.
    spans: list[list[int]] = []
    deltas: list[int] = []
    previous_index = previous_count = 0
    for index, count in zip(indices.tolist(), counts.tolist(), strict=True):
        gap = index - previous_index - 1
        if not spans or gap > MAX_FILLED_GAP:
            spans.append([index if not spans else gap, 1])
        else:
            if gap:  # the empty buckets between, as zero counts
                deltas.append(-previous_count)
                deltas.extend([0] * (gap - 1))
                previous_count = 0
            spans[-1][1] += gap + 1
        deltas.append(count - previous_count)
        previous_index, previous_count = index, count
    return tuple((offset, length) for offset, length in spans), tuple(deltas)


class _Side:
    """One sign's buckets, sparse: ascending indices and their counts."""

    __slots__ = ("counts", "indices")

    def __init__(self) -> None:
        self.indices: IntArray = np.empty(0, dtype=np.int64)
        self.counts: IntArray = np.empty(0, dtype=np.int64)

    def merge(self, new: IntArray, added: IntArray) -> None:
        """Add ``added`` to buckets ``new`` (ascending, distinct)."""
        at = np.searchsorted(self.indices, new)
        known = at < len(self.indices)
        known[known] = self.indices[at[known]] == new[known]
        if known.all():  # the steady case: every bucket seen before
            self.counts[at] += added
            return
        merged = np.union1d(self.indices, new)
        counts = np.zeros(len(merged), dtype=np.int64)
        counts[np.searchsorted(merged, self.indices)] = self.counts
        counts[np.searchsorted(merged, new)] += added
        self.indices, self.counts = merged, counts


class HistogramAccumulator:
    """A cumulative native histogram of one series' samples (a GPU's or MIG instance's field):
    it only grows, so counters reset only when the process restarts, and the first snapshot says
    so (``ResetHint.YES``); every later one says ``NO``."""

    __slots__ = (
        "_count",
        "_negative",
        "_positive",
        "_snapshots",
        "_sum",
        "_zero_count",
        "schema",
        "zero_threshold",
    )

    def __init__(self, schema: int = 3, zero_threshold: float = DEFAULT_ZERO_THRESHOLD) -> None:
        _check_schema(schema)
        if not zero_threshold >= 0 or math.isinf(zero_threshold):
            raise ValueError(f"zero threshold must be finite and at least 0, got {zero_threshold}")
        self.schema = schema
        self.zero_threshold = zero_threshold
        self._positive = _Side()
        self._negative = _Side()
        self._zero_count = 0
        self._count = 0
        self._sum = 0.0
        self._snapshots = 0

    def add(self, values: FloatArray) -> None:
        """Count a window's samples (any shape; NaN, meaning no distinct sample, is skipped)."""
        add_window([self], np.asarray(values, dtype=np.float64).reshape(-1, 1))

    def snapshot(self) -> NativeHistogram:
        """The histogram as it stands, spans and deltas computed; the first is marked a reset."""
        hint = ResetHint.YES if self._snapshots == 0 else ResetHint.NO
        self._snapshots += 1
        pos_spans, pos_deltas = spans_and_deltas(self._positive.indices, self._positive.counts)
        neg_spans, neg_deltas = spans_and_deltas(self._negative.indices, self._negative.counts)
        return NativeHistogram(
            schema=self.schema,
            zero_threshold=self.zero_threshold,
            zero_count=self._zero_count,
            count=self._count,
            sum=self._sum,
            positive_spans=pos_spans,
            positive_deltas=pos_deltas,
            negative_spans=neg_spans,
            negative_deltas=neg_deltas,
            reset_hint=hint,
        )


def _count_keys(
    columns: IntArray, keys: IntArray, n_columns: int
) -> tuple[IntArray, IntArray, IntArray]:
    """Distinct (column, key) pairs, ascending, and how many times each occurs."""
    lo = int(keys.min())
    width = int(keys.max()) - lo + 1
    combined = columns * width + (keys - lo)
    if width * n_columns <= 4 * len(keys) + 1024 * n_columns:
        # A window's keys span a few dozen buckets: counting over that range beats sorting.
        per_pair = np.bincount(combined, minlength=width * n_columns)
        pairs = np.flatnonzero(per_pair)
        added = per_pair[pairs]
    else:  # values across many octaves at a fine schema: a dense count would be large
        pairs, added = np.unique(combined, return_counts=True)
    return pairs // width, pairs % width + lo, added


def add_window(accumulators: Sequence[HistogramAccumulator], values: FloatArray) -> None:
    """Count one window of many series at once: ``values[row, series]`` into
    ``accumulators[series]`` (NaN, no distinct sample, skipped); bucket keys are computed for
    every series in one pass, so the accumulators must share their schema and zero threshold."""
    v = np.ascontiguousarray(values, dtype=np.float64)
    if v.ndim != 2 or v.shape[1] != len(accumulators):
        raise ValueError(f"values {v.shape} do not match {len(accumulators)} accumulators")
    if not accumulators:
        return
    schema, zero = accumulators[0].schema, accumulators[0].zero_threshold
    if any(a.schema != schema or a.zero_threshold != zero for a in accumulators):
        raise ValueError("accumulators counted together must share schema and zero threshold")
    present = ~np.isnan(v)
    counts = present.sum(axis=0)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing to +-Inf is the answer
        sums = np.where(present, v, 0.0).sum(axis=0)
    positive = v > zero  # NaN compares false either way
    negative = v < -zero
    zeros = counts - positive.sum(axis=0) - negative.sum(axis=0)
    for j, acc in enumerate(accumulators):
        if counts[j]:
            acc._count += int(counts[j])
            acc._sum += float(sums[j])
            acc._zero_count += int(zeros[j])
    for mask, sign, side in ((positive, 1.0, "_positive"), (negative, -1.0, "_negative")):
        if not mask.any():  # power, clocks and temperatures are never negative: no empty pass
            continue
        where = np.flatnonzero(mask)  # row-major, as v[mask] is
        columns = where % len(accumulators)
        keys = bucket_indices(sign * v.ravel()[where], schema)
        cols, new, added = _count_keys(columns, keys, len(accumulators))
        bounds = np.searchsorted(cols, np.arange(len(accumulators) + 1))
        for j in np.flatnonzero(np.diff(bounds)).tolist():
            a, b = int(bounds[j]), int(bounds[j + 1])
            target: _Side = getattr(accumulators[j], side)
            target.merge(new[a:b], added[a:b])

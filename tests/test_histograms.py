"""Native-histogram arithmetic and the accumulator, against Prometheus's conventions and a
brute-force model; ``histogram_quantile`` as PromQL computes it against exact quantiles."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from histograms_check import histogram_problems, histogram_quantile
from hypothesis import given, settings
from hypothesis import strategies as st

from hfsampler.histograms import (
    DEFAULT_RELATIVE_ERROR,
    DEFAULT_ZERO_THRESHOLD,
    SCHEMA_MAX,
    SCHEMA_MIN,
    HistogramAccumulator,
    ResetHint,
    add_window,
    bucket_bound,
    bucket_error,
    bucket_indices,
    growth,
    quantile_error_bound,
    schema_for_error,
    spans_and_deltas,
)
from hfsampler.remote_write.histwrite import histogram_message
from hfsampler.remote_write.prompb import writev2_pb2

# Prometheus model/histogram/generic.go, exponentialBounds for schema 3 (bounds in [0.5, 1)).
PROMETHEUS_SCHEMA_3 = [
    0.5,
    0.5452538663326288,
    0.5946035575013605,
    0.6484197773255048,
    0.7071067811865475,
    0.7711054127039704,
    0.8408964152537144,
    0.9170040432046711,
]
SCHEMAS = st.integers(SCHEMA_MIN, SCHEMA_MAX)
# Normal floats: below 2^-1022 Prometheus's bucket bounds are themselves rounded to subnormals.
FINITE_POSITIVE = st.floats(min_value=2.0**-1021, max_value=1.7976931348623157e308)


def test_default_error_picks_schema_3_and_bounds_follow() -> None:
    assert schema_for_error(DEFAULT_RELATIVE_ERROR) == 3
    assert growth(3) == pytest.approx(2 ** (1 / 8))
    assert bucket_error(3) == pytest.approx(0.04329, abs=1e-5)
    assert quantile_error_bound(3) == pytest.approx(0.09051, abs=1e-5)
    assert schema_for_error(0.01) == 6  # (2^(1/64)-1)/(2^(1/64)+1) = 0.54%; schema 5: 1.08%
    assert schema_for_error(0.5) == 0
    assert schema_for_error(1e-9) == SCHEMA_MAX
    with pytest.raises(ValueError, match="relative error must be above 0"):
        schema_for_error(0)


def test_bounds_are_prometheus_table_within_ulps() -> None:
    # Prometheus's literal table is a few ulps below the correctly rounded 2^(j/8)/2 at some
    # entries (0.7071067811865475 against 0.7071067811865476): only a value within 1e-15 of a
    # boundary can land in a different bucket, and powers of two (exact in both) never do.
    got = np.array([bucket_bound(j - 8, 3) for j in range(8)])  # 2^(j/8)/2 tops bucket j-8
    ref = np.array(PROMETHEUS_SCHEMA_3)
    assert np.all(np.abs(got - ref) <= 4 * np.spacing(ref))
    assert [bucket_bound(8 * k, 3) for k in (-3, 0, 1, 10)] == [2.0**-3, 1.0, 2.0, 1024.0]
    assert bucket_bound(1024 * 8, 3) == np.finfo(np.float64).max  # the last before +Inf's
    assert bucket_bound(256, -2) == np.finfo(np.float64).max


def test_boundaries_belong_to_the_bucket_below() -> None:
    # Prometheus: positive bucket i covers (base^(i-1), base^i], so a boundary is its bucket's top.
    for schema in range(SCHEMA_MIN, SCHEMA_MAX + 1):
        for index in (-50, -1, 0, 1, 7, 8, 9, 100):
            upper = bucket_bound(index, schema)
            if not 2.0**-1021 < upper < np.finfo(np.float64).max:
                continue  # beyond the normal floats at this schema
            got = bucket_indices(np.array([upper, np.nextafter(upper, np.inf)]), schema)
            assert got.tolist() == [index, index + 1], (schema, index)


@given(SCHEMAS, st.lists(FINITE_POSITIVE, min_size=1, max_size=50))
def test_index_puts_value_in_its_bucket(schema: int, values: list[float]) -> None:
    keys = bucket_indices(np.array(values), schema)
    for v, k in zip(values, keys.tolist(), strict=True):
        assert bucket_bound(k - 1, schema) < v <= bucket_bound(k, schema)


def test_infinity_goes_above_max_float() -> None:
    mx = np.finfo(np.float64).max
    for schema in (SCHEMA_MIN, 0, 3, SCHEMA_MAX):
        k_max, k_inf = bucket_indices(np.array([mx, np.inf]), schema).tolist()
        assert k_inf == k_max + 1
        assert bucket_bound(k_max, schema) == mx
        assert bucket_bound(k_inf, schema) == math.inf


def test_negative_schema_rounds_down_for_small_values() -> None:
    # Schema -1 (base 4): 0.2 is in (4^-2, 4^-1] = (0.0625, 0.25], bucket -1; truncating division
    # (as one old client_golang did) would say 0.
    assert bucket_indices(np.array([0.2, 0.0625, 0.07]), -1).tolist() == [-1, -2, -1]


def model(values: list[float], schema: int, zero: float) -> tuple[Counter[int], Counter[int], int]:
    pos: Counter[int] = Counter()
    neg: Counter[int] = Counter()
    zeros = 0
    for v in values:
        if v > zero:
            pos[int(bucket_indices(np.array([v]), schema)[0])] += 1
        elif v < -zero:
            neg[int(bucket_indices(np.array([-v]), schema)[0])] += 1
        else:
            zeros += 1
    return pos, neg, zeros


def expand(spans: tuple[tuple[int, int], ...], deltas: tuple[int, ...]) -> dict[int, int]:
    out, index, i, count = {}, 0, 0, 0
    for offset, length in spans:
        index += offset
        for _ in range(length):
            count += deltas[i]
            if count:
                out[index] = count
            index += 1
            i += 1
    return out


VALUES = st.one_of(st.floats(min_value=-1e6, max_value=1e6), st.just(math.nan))


@settings(max_examples=200)
@given(SCHEMAS, st.lists(st.lists(VALUES, max_size=40), max_size=6), st.sampled_from([0.0, 1e-3]))
def test_accumulator_matches_model(schema: int, windows: list[list[float]], zero: float) -> None:
    acc = HistogramAccumulator(schema, zero)
    seen: list[float] = []
    for window in windows:
        acc.add(np.array(window, dtype=np.float64))
        seen += [v for v in window if not math.isnan(v)]
    h = acc.snapshot()
    pos, neg, zeros = model(seen, schema, zero)
    assert expand(h.positive_spans, h.positive_deltas) == dict(pos)
    assert expand(h.negative_spans, h.negative_deltas) == dict(neg)
    assert h.zero_count == zeros
    assert h.count == len(seen)
    assert h.sum == pytest.approx(math.fsum(seen), rel=1e-9, abs=1e-6)
    assert h.reset_hint is ResetHint.YES
    message = writev2_pb2.Histogram.FromString(histogram_message(h, 1))
    assert histogram_problems(message) == []


def test_reset_hint_yes_once_then_no_and_counts_only_grow() -> None:
    acc = HistogramAccumulator()
    acc.add(np.array([300.0, 310.0]))
    first = acc.snapshot()
    acc.add(np.array([305.0, np.nan, 1000.0]))
    second = acc.snapshot()
    assert (first.reset_hint, second.reset_hint) == (ResetHint.YES, ResetHint.NO)
    assert (first.count, second.count) == (2, 4)
    a = expand(first.positive_spans, first.positive_deltas)
    b = expand(second.positive_spans, second.positive_deltas)
    assert all(b[k] >= v for k, v in a.items())
    assert acc.snapshot().reset_hint is ResetHint.NO


def test_zero_bucket_and_defaults() -> None:
    acc = HistogramAccumulator()
    assert (acc.schema, acc.zero_threshold) == (3, DEFAULT_ZERO_THRESHOLD)
    acc.add(np.array([0.0, -0.0, 2.0**-130, -(2.0**-129), 2.0**-127, np.nan]))
    h = acc.snapshot()
    assert (h.zero_count, h.count) == (4, 5)
    assert sum(h.positive_deltas[:1]) == 1
    assert h.negative_spans == ()
    with pytest.raises(ValueError, match="schema must be in"):
        HistogramAccumulator(9)
    with pytest.raises(ValueError, match="zero threshold must be"):
        HistogramAccumulator(3, -1.0)


def test_infinities_are_counted_and_sum_follows() -> None:
    acc = HistogramAccumulator()
    acc.add(np.array([1.0, np.inf]))
    h = acc.snapshot()
    assert h.count == 2
    assert h.sum == math.inf
    assert histogram_problems(writev2_pb2.Histogram.FromString(histogram_message(h, 1))) == []


def test_spans_fill_small_gaps_and_split_large_ones() -> None:
    idx = np.array([-3, -2, 0, 5, 6, 20], dtype=np.int64)
    cnt = np.array([1, 4, 2, 3, 3, 7], dtype=np.int64)
    spans, deltas = spans_and_deltas(idx, cnt)
    # -3..0 in one span (a gap of one filled), 5..6 after a gap of 4, 20 after a gap of 13.
    assert spans == ((-3, 4), (4, 2), (13, 1))
    assert deltas == (1, 3, -4, 2, 1, 0, 4)
    assert spans_and_deltas(np.empty(0, np.int64), np.empty(0, np.int64)) == ((), ())


def power_like(rng: np.random.Generator, n: int, idle_w: float, busy_w: float) -> np.ndarray:
    """A GPU's power in watts at 1 ms: idle and busy phases, spikes, read in milliwatts."""
    busy = rng.random(n) < 0.6
    base = np.where(busy, rng.normal(busy_w, busy_w * 0.08, n), rng.normal(idle_w, 5.0, n))
    spikes = rng.random(n) < 0.01
    base = np.where(spikes, base * rng.uniform(1.1, 1.4, n), base)
    return np.round(np.clip(base, 1.0, None) * 1000) / 1000


QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99, 0.999)


def assert_quantiles_within_bound(values: np.ndarray, schema: int) -> float:
    """Every quantile within the bound; returns the worst relative error seen."""
    acc = HistogramAccumulator(schema)
    for window in np.array_split(values, 7):
        acc.add(window)
    message = writev2_pb2.Histogram.FromString(histogram_message(acc.snapshot(), 1))
    ordered = np.sort(values)
    n = len(ordered)
    bound = quantile_error_bound(schema)
    worst = 0.0
    for q in QUANTILES:
        got = histogram_quantile(q, message)
        # The estimate lies in the bucket of the sample ranked ceil(qn) (forward iteration) or
        # floor(qn)+1 (reverse, from 0.5 up): within a factor ``growth`` of one of the two.
        lo = ordered[max(math.ceil(q * n) - 1, 0)]
        hi = ordered[min(math.floor(q * n), n - 1)]
        assert lo / (1 + bound) <= got <= hi * (1 + bound), (q, got, lo, hi)
        exact = float(np.quantile(values, q, method="inverted_cdf"))
        worst = max(worst, abs(got / exact - 1))
    return worst


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(50, 20_000),
    st.floats(20, 120),
    st.floats(150, 1000),
    st.sampled_from([0, 2, 3, 5]),
)
def test_quantiles_agree_with_exact_within_schema_error(
    seed: int, n: int, idle_w: float, busy_w: float, schema: int
) -> None:
    values = power_like(np.random.default_rng(seed), n, idle_w, busy_w)
    assert_quantiles_within_bound(values, schema)


def test_quantiles_of_a_million_samples_at_default_schema() -> None:
    values = power_like(np.random.default_rng(26), 1_000_000, 70.0, 600.0)
    worst = assert_quantiles_within_bound(values, 3)
    # With a million samples each bucket is full and interpolation does far better than the
    # bound: typically under 1% against the exact quantile.
    assert worst < bucket_error(3)


def test_window_across_many_octaves_counts_sparsely() -> None:
    # 1e-300 to 1e300 at schema 8 is ~510,000 buckets apart: counted by unique, not densely.
    acc = HistogramAccumulator(8, 0.0)
    values = [1e-300, 1e300, 3.0, 1e300, -1e-300]
    acc.add(np.array(values))
    acc.add(np.array([1e-300, 5.0]))
    h = acc.snapshot()
    pos, neg, _ = model([*values, 1e-300, 5.0], 8, 0.0)
    assert expand(h.positive_spans, h.positive_deltas) == dict(pos)
    assert expand(h.negative_spans, h.negative_deltas) == dict(neg)
    assert len(h.positive_spans) == 4


@settings(max_examples=100)
@given(
    SCHEMAS,
    st.integers(1, 5),
    st.lists(st.lists(VALUES, min_size=5, max_size=5), max_size=30),
)
def test_window_of_many_series_equals_each_alone(
    schema: int, n: int, rows: list[list[float]]
) -> None:
    window = np.array([row[:n] for row in rows], dtype=np.float64).reshape(-1, n)
    together = [HistogramAccumulator(schema, 1e-3) for _ in range(n)]
    add_window(together, window)
    add_window(together, window[::-1])
    for j, acc in enumerate(together):
        alone = HistogramAccumulator(schema, 1e-3)
        alone.add(window[:, j])
        alone.add(window[::-1, j])
        got, want = acc.snapshot(), alone.snapshot()
        # numpy sums a column of a 2-D array in another order than a 1-D one: the last bit varies.
        assert got.sum == pytest.approx(want.sum, rel=1e-12, abs=1e-9)
        assert replace(got, sum=0.0) == replace(want, sum=0.0)


def test_window_shape_and_schemas_must_match() -> None:
    with pytest.raises(ValueError, match="do not match"):
        add_window([HistogramAccumulator()], np.zeros((3, 2)))
    with pytest.raises(ValueError, match="share schema"):
        add_window([HistogramAccumulator(3), HistogramAccumulator(4)], np.zeros((3, 2)))

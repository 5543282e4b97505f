"""Hand-written Histogram messages, held to what the protobuf library writes and reads, in the
1.0 (prompb/types.proto, field numbers from Prometheus's file) and 2.0 (writev2.proto) forms."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from histograms_check import (
    V1Histogram,
    V1TimeSeriesHistograms,
    fill_message,
    histogram_problems,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hfsampler.histograms import (
    SCHEMA_MAX,
    SCHEMA_MIN,
    HistogramAccumulator,
    ResetHint,
)
from hfsampler.remote_write.histwrite import (
    histogram_entry_v1,
    histogram_entry_v2,
    histogram_message,
)
from hfsampler.remote_write.prompb import writev2_pb2
from hfsampler.remote_write.protowrite import zigzag

VALUES = st.floats(allow_nan=False, allow_infinity=True, min_value=None, max_value=None)


@settings(max_examples=200)
@given(
    st.integers(SCHEMA_MIN, SCHEMA_MAX),
    st.lists(VALUES, max_size=60),
    st.sampled_from([0.0, 2.0**-128, 0.5]),
    st.integers(0, 2**62),
    st.integers(0, 2),
)
def test_bytes_are_the_librarys(
    schema: int, values: list[float], zero: float, ts: int, snapshots: int
) -> None:
    acc = HistogramAccumulator(schema, zero)
    acc.add(np.array(values, dtype=np.float64))
    for _ in range(snapshots):
        acc.snapshot()
    h = acc.snapshot()
    ours = histogram_message(h, ts)
    for cls in (writev2_pb2.Histogram, V1Histogram):
        expected = fill_message(cls(), h, ts)
        assert ours == expected.SerializeToString(deterministic=True)
        parsed = cls.FromString(ours)
        assert parsed == expected
        assert histogram_problems(parsed) == []


def test_start_timestamp_is_2_0_only_and_entries_wrap() -> None:
    acc = HistogramAccumulator()
    acc.add(np.array([250.0, 251.5, 600.0, 0.0, -3.0]))
    h = acc.snapshot()
    v2 = writev2_pb2.TimeSeries.FromString(
        histogram_entry_v2(h, 1_700_000_000_000, 1_699_999_999_000)
    )
    (got,) = v2.histograms
    assert got.start_timestamp == 1_699_999_999_000
    assert got.timestamp == 1_700_000_000_000
    assert got.reset_hint == writev2_pb2.Histogram.RESET_HINT_YES
    assert (got.count_int, got.zero_count_int, got.schema) == (5, 1, 3)
    assert got.WhichOneof("count") == "count_int"
    v1 = V1TimeSeriesHistograms.FromString(histogram_entry_v1(h, 1_700_000_000_000))
    (one,) = v1.histograms
    assert one.timestamp == 1_700_000_000_000
    assert one.reset_hint == ResetHint.YES
    assert one.SerializeToString(deterministic=True) == histogram_message(h, 1_700_000_000_000)


def test_empty_histogram_still_says_its_counts() -> None:
    h = HistogramAccumulator().snapshot()
    msg = writev2_pb2.Histogram.FromString(histogram_message(h, 5))
    # Oneof members are present even at 0, so a receiver reads an integer histogram.
    assert msg.WhichOneof("count") == "count_int"
    assert msg.WhichOneof("zero_count") == "zero_count_int"
    assert histogram_problems(msg) == []


def test_zigzag() -> None:
    assert [zigzag(v) for v in (0, -1, 1, -2, 2, -(2**63), 2**63 - 1)] == [
        0,
        1,
        2,
        3,
        4,
        2**64 - 1,
        2**64 - 2,
    ]


def test_validation_catches_what_prometheus_refuses() -> None:
    def base() -> Any:
        m = writev2_pb2.Histogram(count_int=3, zero_count_int=0, schema=3, sum=6.0)
        m.positive_spans.add(offset=0, length=2)
        m.positive_deltas.extend([1, 1])
        return m

    assert histogram_problems(base()) == []
    bad = base()
    bad.count_int = 4
    assert any("but count 4" in p for p in histogram_problems(bad))
    nan_sum = base()
    nan_sum.count_int, nan_sum.sum = 4, math.nan  # NaN observations: count may exceed buckets
    assert histogram_problems(nan_sum) == []
    neg = base()
    neg.positive_deltas[1] = -2
    assert any("observation count of -1" in p for p in histogram_problems(neg))
    spans = base()
    spans.positive_spans.add(offset=-1, length=1)
    problems = histogram_problems(spans)
    assert any("offset -1" in p for p in problems)
    assert any("spans need 3" in p for p in problems)
    schema = base()
    schema.schema = 9
    assert any("invalid schema" in p for p in histogram_problems(schema))
    floats = base()
    floats.count_float = 3.0
    assert any("float histogram" in p for p in histogram_problems(floats))

"""Native histograms as Prometheus reads them: its validation, its ``histogram_quantile``, and the
message the library fills from a ``NativeHistogram`` (``fill_message``), the reference for the
hand-written bytes.

``histogram_problems`` follows model/histogram's ``Histogram.Validate`` (schema range, spans'
offsets and lengths against the buckets, non-negative counts, count against zero count plus
buckets); ``histogram_quantile`` follows promql/quantile.go's ``HistogramQuantile`` (forward
iteration below 0.5, reverse from 0.5 up, exponential interpolation inside a bucket). Both take a
decoded message (either protocol's ``Histogram``; the conformance receiver can parse its stored
bytes with ``writev2_pb2.Histogram.FromString``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from hfsampler.histograms import SCHEMA_MAX, SCHEMA_MIN, NativeHistogram, bucket_bound
from hfsampler.remote_write.prompb import types_pb2


class _Span(Protocol):
    offset: int
    length: int


def _check_spans(side: str, spans: Sequence[_Span], buckets: int) -> list[str]:
    problems = []
    for n, span in enumerate(spans):
        if n > 0 and span.offset < 0:
            problems.append(f"{side}: span number {n + 1} with offset {span.offset}")
    need = sum(s.length for s in spans)
    if need != buckets:
        problems.append(f"{side}: spans need {need} buckets, have {buckets} buckets")
    return problems


def _absolute(side: str, deltas: Sequence[int], problems: list[str]) -> list[int]:
    counts, last = [], 0
    for i, d in enumerate(deltas):
        last += d
        if last < 0:
            problems.append(f"{side}: bucket number {i + 1} has observation count of {last}")
        counts.append(last)
    return counts


def histogram_problems(h: Any) -> list[str]:
    """What Prometheus's validation refuses in an integer histogram message; [] when valid."""
    problems: list[str] = []
    if h.WhichOneof("count") == "count_float" or h.WhichOneof("zero_count") == "zero_count_float":
        problems.append("float histogram: hfsampler sends integer counts only")
    if len(h.positive_counts) or len(h.negative_counts):
        problems.append("float bucket counts in an integer histogram")
    if not SCHEMA_MIN <= h.schema <= SCHEMA_MAX:
        problems.append(f"histogram has an invalid schema {h.schema}")
    if len(h.custom_values):
        problems.append("histogram with exponential schema must not have custom bounds")
    if not h.zero_threshold >= 0:
        problems.append(f"zero threshold {h.zero_threshold} is not at least 0")
    problems += _check_spans("negative side", h.negative_spans, len(h.negative_deltas))
    problems += _check_spans("positive side", h.positive_spans, len(h.positive_deltas))
    buckets = sum(_absolute("negative side", h.negative_deltas, problems))
    buckets += sum(_absolute("positive side", h.positive_deltas, problems))
    in_buckets = buckets + h.zero_count_int
    if math.isnan(h.sum):
        if in_buckets > h.count_int:
            problems.append(f"{in_buckets} observations found in buckets, but count {h.count_int}")
    elif in_buckets != h.count_int:
        problems.append(f"{in_buckets} observations found in buckets, but count {h.count_int}")
    return problems


def buckets(h: Any) -> Iterator[tuple[float, float, int]]:
    """Every bucket, zero bucket included, as (lower, upper, count), from the lowest up."""

    def side(spans: Sequence[_Span], deltas: Sequence[int]) -> list[tuple[int, int]]:
        out, index, i, count = [], 0, 0, 0
        for span in spans:
            index += span.offset  # the first span's from 0, each later one's from the last end
            for _ in range(span.length):
                count += deltas[i]
                out.append((index, count))
                index += 1
                i += 1
        return out

    s = h.schema
    for index, count in reversed(side(h.negative_spans, h.negative_deltas)):
        yield -bucket_bound(index, s), -bucket_bound(index - 1, s), count
    if h.zero_count_int:
        yield -h.zero_threshold, h.zero_threshold, h.zero_count_int
    for index, count in side(h.positive_spans, h.positive_deltas):
        yield bucket_bound(index - 1, s), bucket_bound(index, s), count


def histogram_quantile(q: float, h: Any) -> float:
    """PromQL's ``histogram_quantile(q, h)`` for a native histogram with exponential buckets."""
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    count_total = float(h.count_int)
    if count_total == 0 or math.isnan(q):
        return math.nan
    all_buckets = list(buckets(h))
    forward = math.isnan(h.sum) or q < 0.5
    rank = q * count_total if forward else (1 - q) * count_total
    order = all_buckets if forward else list(reversed(all_buckets))
    count = 0.0
    lower = upper = bucket_count = 0.0
    for bucket in order:
        if bucket[2] == 0:
            continue
        lower, upper, bucket_count = bucket[0], bucket[1], float(bucket[2])
        count += bucket_count
        if count >= rank:
            break
    if lower < 0 < upper:
        if not h.negative_spans and h.positive_spans:
            lower = 0.0
        elif not h.positive_spans and h.negative_spans:
            upper = 0.0
    count = min(count, count_total)
    if count < rank:
        return upper
    rank = rank - (count - bucket_count) if forward else count - rank
    fraction = rank / bucket_count
    if lower <= 0 <= upper:
        return lower + (upper - lower) * fraction
    log_lower, log_upper = math.log2(abs(lower)), math.log2(abs(upper))
    if lower > 0:
        return float(2 ** (log_lower + (log_upper - log_lower) * fraction))
    return float(-(2 ** (log_upper + (log_lower - log_upper) * (1 - fraction))))


def fill_message(msg: Any, h: NativeHistogram, timestamp_ms: int) -> Any:
    """``msg`` (either protocol's ``Histogram``) filled from ``h`` by the protobuf library: the
    reference the hand-written bytes are held to."""
    msg.count_int = h.count
    msg.sum = h.sum
    msg.schema = h.schema
    msg.zero_threshold = h.zero_threshold
    msg.zero_count_int = h.zero_count
    for offset, length in h.negative_spans:
        msg.negative_spans.add(offset=offset, length=length)
    msg.negative_deltas.extend(h.negative_deltas)
    for offset, length in h.positive_spans:
        msg.positive_spans.add(offset=offset, length=length)
    msg.positive_deltas.extend(h.positive_deltas)
    msg.reset_hint = int(h.reset_hint)
    msg.timestamp = timestamp_ms
    return msg


# 1.0's messages (prompb/types.proto, TimeSeries.histograms = 4).
V1Histogram = types_pb2.Histogram
V1TimeSeriesHistograms = types_pb2.TimeSeries

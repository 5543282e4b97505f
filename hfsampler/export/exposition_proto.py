"""Prometheus's protobuf exposition format: a snapshot as delimited ``MetricFamily`` messages.

The format /metrics serves to a scraper that asks for it (``Accept:
application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited``,
what Prometheus 3 and 2.40+ with native histograms on send first): each family a varint length
and a ``MetricFamily`` (io.prometheus.client's metrics.proto, proto/hfsampler/export/exposition_pb),
its float series as gauges or counters and its native-histogram series as ``Histogram``s with
exponential buckets, the one format a scrape carries native histograms in. The families, HELP,
labels and values are the text page's (``exposition``): stale markers and ``instance`` left out.

The bytes are written by hand as ``remote_write.protowrite`` writes Remote-Write's; the generated
``exposition_pb.metrics_pb2`` is the reference the tests hold them to. Fields go in number order
and repeated scalars unpacked, as client_golang writes this proto2 file, so a parse and a
re-serialization give the same bytes. A series' label bytes are kept across windows by
``Series.id``, so a render writes only values.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Mapping

from hfsampler.histograms import NativeHistogram
from hfsampler.remote_write.protowrite import field, varint, zigzag
from hfsampler.series import Family, Series, Snapshot, is_stale

CONTENT_TYPE = (
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
)
# MetricType in metrics.proto; a family of another type is UNTYPED, as in the text format
METRIC_TYPES: Mapping[str, int] = {"counter": 0, "gauge": 1, "untyped": 3, "histogram": 4}
_UNTYPED = 3
_VALUE_TAG = {0: b"\x1a", 1: b"\x12", 3: b"\x2a"}  # Metric.counter = 3, gauge = 2, untyped = 5

# Tags: (field_number << 3) | wire_type (0 varint, 1 64-bit, 2 length-delimited).
_TAG_FAMILY_NAME = b"\x0a"  # MetricFamily.name = 1
_TAG_FAMILY_HELP = b"\x12"  # MetricFamily.help = 2
_TAG_FAMILY_TYPE = b"\x18"  # MetricFamily.type = 3
_TAG_FAMILY_METRIC = b"\x22"  # MetricFamily.metric = 4
_TAG_METRIC_LABEL = b"\x0a"  # Metric.label = 1
_TAG_METRIC_HISTOGRAM = b"\x3a"  # Metric.histogram = 7
_TAG_LABEL_NAME = b"\x0a"  # LabelPair.name = 1
_TAG_LABEL_VALUE = b"\x12"  # LabelPair.value = 2
_TAG_VALUE = b"\x09"  # Gauge/Counter/Untyped.value = 1, double
_TAG_SAMPLE_COUNT = b"\x08"  # Histogram.sample_count = 1
_TAG_SAMPLE_SUM = b"\x11"  # Histogram.sample_sum = 2, double
_TAG_SCHEMA = b"\x28"  # Histogram.schema = 5, sint32
_TAG_ZERO_THRESHOLD = b"\x31"  # Histogram.zero_threshold = 6, double
_TAG_ZERO_COUNT = b"\x38"  # Histogram.zero_count = 7
_TAG_NEGATIVE_SPAN = b"\x4a"  # Histogram.negative_span = 9
_TAG_NEGATIVE_DELTA = b"\x50"  # Histogram.negative_delta = 10, sint64, unpacked (proto2)
_TAG_POSITIVE_SPAN = b"\x62"  # Histogram.positive_span = 12
_TAG_POSITIVE_DELTA = b"\x68"  # Histogram.positive_delta = 13, sint64, unpacked (proto2)
_TAG_SPAN_OFFSET = b"\x08"  # BucketSpan.offset = 1, sint32
_TAG_SPAN_LENGTH = b"\x10"  # BucketSpan.length = 2, uint32
_DOUBLE = struct.Struct("<d")


def _double(tag: bytes, value: float) -> bytes:
    return tag + _DOUBLE.pack(value)


def label_bytes(s: Series, dropped: frozenset[str]) -> bytes:
    """A series' ``Metric.label`` entries, without the labels in ``dropped``."""
    return b"".join(
        field(
            _TAG_METRIC_LABEL,
            field(_TAG_LABEL_NAME, k.encode()) + field(_TAG_LABEL_VALUE, v.encode()),
        )
        for k, v in s.labels
        if k not in dropped
    )


def _spans(tag: bytes, spans: tuple[tuple[int, int], ...]) -> bytes:
    return b"".join(
        field(tag, _TAG_SPAN_OFFSET + varint(zigzag(o)) + _TAG_SPAN_LENGTH + varint(n))
        for o, n in spans
    )


def _deltas(tag: bytes, deltas: tuple[int, ...]) -> bytes:
    return b"".join(tag + varint(zigzag(d)) for d in deltas)


def histogram_message(h: NativeHistogram) -> bytes:
    """A ``Histogram`` message's body: a native histogram, integer counts, no classic buckets.
    The zero threshold is never 0 here (``histograms.DEFAULT_ZERO_THRESHOLD``), which is what
    tells Prometheus's parser a histogram without buckets yet is a native one."""
    return b"".join(
        (
            _TAG_SAMPLE_COUNT + varint(h.count),
            _double(_TAG_SAMPLE_SUM, h.sum),
            _TAG_SCHEMA + varint(zigzag(h.schema)),
            _double(_TAG_ZERO_THRESHOLD, h.zero_threshold),
            _TAG_ZERO_COUNT + varint(h.zero_count),
            _spans(_TAG_NEGATIVE_SPAN, h.negative_spans),
            _deltas(_TAG_NEGATIVE_DELTA, h.negative_deltas),
            _spans(_TAG_POSITIVE_SPAN, h.positive_spans),
            _deltas(_TAG_POSITIVE_DELTA, h.positive_deltas),
        )
    )


def _family_head(family: Family | None, name: str) -> tuple[bytes, int]:
    kind = METRIC_TYPES.get(family.type, _UNTYPED) if family is not None else _UNTYPED
    head = field(_TAG_FAMILY_NAME, name.encode())
    if family is not None and family.help:
        head += field(_TAG_FAMILY_HELP, family.help.encode())
    return head + _TAG_FAMILY_TYPE + varint(kind), kind


def render(
    snapshot: Snapshot,
    labels: dict[int, bytes],
    seen: dict[int, bytes],
    dropped: frozenset[str],
) -> bytes:
    """The delimited page; each series' label bytes from ``labels`` (by ``Series.id``) where
    they are, every one used put in ``seen`` (the caller keeps only the live series')."""
    metrics: dict[str, list[bytes]] = defaultdict(list)

    def head(s: Series) -> bytes:
        b = labels.get(s.id)
        if b is None:
            b = label_bytes(s, dropped)
        seen[s.id] = b
        return b

    kinds: dict[str, int] = {}
    heads: dict[str, bytes] = {}
    for s, v in snapshot.items():
        if is_stale(v):
            continue
        if s.name not in kinds:
            heads[s.name], kinds[s.name] = _family_head(snapshot.families.get(s.name), s.name)
        tag = _VALUE_TAG.get(kinds[s.name], _VALUE_TAG[_UNTYPED])
        metrics[s.name].append(head(s) + field(tag, _double(_TAG_VALUE, v)))
    for s, h in snapshot.histograms:
        if is_stale(h.sum):
            continue
        if s.name not in kinds:
            heads[s.name], kinds[s.name] = _family_head(snapshot.families.get(s.name), s.name)
        metrics[s.name].append(head(s) + field(_TAG_METRIC_HISTOGRAM, histogram_message(h)))
    out = []
    for name in sorted(metrics):
        body = heads[name] + b"".join(field(_TAG_FAMILY_METRIC, m) for m in metrics[name])
        out.append(varint(len(body)) + body)
    return b"".join(out)


def _params(text: str) -> tuple[str, dict[str, str]]:
    media, *rest = text.split(";")
    params = {}
    for p in rest:
        k, _, v = p.strip().partition("=")
        params[k.strip().lower()] = v.strip().strip('"')
    return media.strip().lower(), params


def wants_protobuf(accept: str) -> bool:
    """Whether an ``Accept`` value picks the delimited protobuf format, as client_golang's
    ``expfmt.Negotiate`` decides: the entries by weight, the first that is either delimited
    ``MetricFamily`` protobuf or ``text/plain`` (0.0.4 or no version) wins; text otherwise."""
    entries = []
    for n, part in enumerate(accept.split(",")):
        if not part.strip():
            continue
        media, params = _params(part)
        try:
            q = float(params.get("q", "1"))
        except ValueError:
            q = 0.0
        if q > 0:
            entries.append((-q, n, media, params))
    for _, _, media, params in sorted(entries):
        if (
            media == "application/vnd.google.protobuf"
            and params.get("proto") == "io.prometheus.client.MetricFamily"
            and params.get("encoding") == "delimited"
        ):
            return True
        if media == "text/plain" and params.get("version", "0.0.4") == "0.0.4":
            return False
    return False

"""A strict Remote-Write receiver, 1.0 and 2.0 (2.0-rc.4): it refuses what the spec or the strictest
real receivers (Thanos Receive, Grafana Mimir) refuse, and records what it stored and every rule a
sender broke.

Every rule applies in both flavours; ``flavour`` only picks the answers (Thanos: 409 Conflict for
label-set and sample conflicts; Mimir: 400 with Mimir's message for the first bad series). As both
real receivers do, the valid series of a partly bad request are stored. Rules, ids and sources:
tests/support/CONFORMANCE.md. A hand-written wire parser decodes the body, not the prompb classes:
it sees what a protobuf runtime hides (a field sent twice, unknown fields, invalid UTF-8 in one
label) and keeps each value's bits, so stale markers stay distinguishable.

The Content-Type picks the message (no ``proto=`` or ``prometheus.WriteRequest``: 1.0;
``io.prometheus.write.v2.Request``: 2.0); ``accept`` narrows what is decoded (415 for the rest), and
``legacy_v1_only`` plays a 1.x receiver that decodes every body as 1.0 (a 2.0 body then reads as an
empty request: 204, no ``Written`` headers, nothing stored). 2.0 series are checked by the 1.0 rules
once their refs are resolved, and share the per-series timestamp order with 1.0 series.

Use: ``async with ConformanceReceiver() as rx`` on the test's loop; ``with ConformanceReceiver() as
rx`` on its own thread and loop (tests that run hfsampler as a subprocess); or standalone,
``python tests/support/conformance.py --port N``, which prints a report on SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import re
import signal
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import snappy
from aiohttp import web
from histograms_check import histogram_problems

from hfsampler.remote_write.prompb import writev2_pb2

Flavour = Literal["thanos", "mimir"]
Labels = tuple[tuple[str, str], ...]  # as sent (2.0: as resolved), in the order sent
Sample = tuple[int, float]  # (timestamp in ms, value); a NaN's payload is kept bit for bit
Histogram = tuple[int, bytes]  # (timestamp in ms, the encoded Histogram message, either protocol)
Exemplar = tuple[Labels, float, int]  # (labels, value, timestamp in ms)
Metadata = tuple[str, str, str]  # (type as Prometheus names it, e.g. "counter"; help; unit)
Problem = tuple[str, dict[str, Any]]  # (rule id, fields for its message)
_Point = tuple[int, Any, int | bytes, int]  # ts, value to store, identity (bits | bytes), start ts

STALE_NAN_BITS = 0x7FF0000000000002
THANOS_TENANT_HEADER = "THANOS-TENANT"
MIMIR_TENANT_HEADER = "X-Scope-OrgID"
SNAPPY_FRAMED_MAGIC = b"\xff\x06\x00\x00sNaPpY"  # the stream identifier chunk of the framed format
_METRIC_RE = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(rb"[a-zA-Z_][a-zA-Z0-9_]*")
_LIBRARY_AGENT_RE = re.compile(r"(Python/\S+ aiohttp/|Python-urllib/|python-requests/)")
_MEDIA_TYPE = "application/x-protobuf"
PROTO_V1 = "prometheus.WriteRequest"
PROTO_V2 = "io.prometheus.write.v2.Request"
CONTENT_TYPE_V2 = f"{_MEDIA_TYPE};proto={PROTO_V2}"
PROTOCOLS = {PROTO_V1: "1.0", PROTO_V2: "2.0"}  # message -> what ``protocols`` records
SAMPLES_WRITTEN_HEADER = "X-Prometheus-Remote-Write-Samples-Written"
HISTOGRAMS_WRITTEN_HEADER = "X-Prometheus-Remote-Write-Histograms-Written"
EXEMPLARS_WRITTEN_HEADER = "X-Prometheus-Remote-Write-Exemplars-Written"
_V2_VERSION_RE = re.compile(r"2\.\d+\.\d+")
# Metadata.MetricType by number, named as Prometheus' model names them (0 is "unknown").
_METRIC_TYPES = [
    "unknown",
    "counter",
    "gauge",
    "histogram",
    "gaugehistogram",
    "summary",
    "info",
    "stateset",
]
_DAY_MS = 86_400_000

# Series- and sample-level rules, "id: what the receiver says". {…} name fields of _context.
_SAYS_TABLE = """\
proto-duplicate-field: {detail}
proto-unknown-field: {detail}
missing-metric-name: series has no __name__ label
metric-name-invalid: metric name {value!r} does not match [a-zA-Z_:][a-zA-Z0-9_:]*
max-label-names-per-series: {actual} labels, limit {limit}
label-name-empty: empty label name
label-name-invalid: label name {label!r} does not match [a-zA-Z_][a-zA-Z0-9_]*
label-name-too-long: label name {label!r} of {actual} bytes, limit {limit}
label-value-empty: label {label!r} has an empty value
label-value-invalid-utf8: label {label!r} value is not valid UTF-8
label-value-too-long: label {label!r} value of {actual} bytes, limit {limit}
duplicate-label-names: label name {label!r} repeated
labels-not-sorted: label {label!r} after {prev!r}: names not in byte-wise order
sample-too-far-in-future: timestamp {ts} is {delta_s:.0f} s ahead, limit {limit} s{hint}
sample-too-old: timestamp {ts} is {delta_s:.0f} s behind, limit {limit} s{hint}
sample-out-of-order: timestamp {ts} is older than the last accepted {last}
sample-duplicate-timestamp: timestamp {ts} sent again with a different value
sample-duplicate: timestamp {ts} sent again with the same value
v2-labels-refs-odd: {detail}
v2-ref-out-of-range: {detail}
v2-no-samples: series has no samples and no histograms
v2-samples-and-histograms: {detail}
v2-metadata-missing: {detail}
v2-exemplar-timestamp-missing: exemplar of value {value} has no timestamp
samples-and-histograms: {detail}
histogram-invalid: histogram at {ts}: {detail}
histogram-reset-hint: histogram at {ts}: {detail}"""
_SAYS = {rule: says for rule, says in (line.split(": ", 1) for line in _SAYS_TABLE.splitlines())}
# Mimir's answers, "rule | err-mimir- id | per-tenant limit flag | message" (an indented line
# continues the message), worded as in pkg/distributor/validate.go and pkg/ingester/errors.go.
_MIMIR_TABLE = """\
missing-metric-name | missing-metric-name | | received series has no metric name
metric-name-invalid | metric-name-invalid | | received a series with invalid metric name: '{value}'
max-label-names-per-series | max-label-names-per-series | validation.max-label-names-per-series
    | received a series whose number of labels exceeds the limit (actual: {actual}, limit: {limit})
    series: '{series}'
label-name-empty | label-invalid | | received a series with an invalid label: '' series: '{series}'
label-name-invalid | label-invalid | | received a series with an invalid label: '{label}' series:
    '{series}'
label-name-too-long | label-name-too-long | validation.max-length-label-name | received a series
    whose label name length exceeds the limit, label: '{label}' series: '{series}'
label-value-invalid-utf8 | label-value-invalid | | received a series with invalid value in label
    '{label}': '{value}' metric: '{name}'
label-value-too-long | label-value-too-long | validation.max-length-label-value | received a series
    whose label value length exceeds the limit, label: '{label}', value: '{value}' (truncated)
    series: '{series}'
duplicate-label-names | duplicate-label-names | | received a series with duplicate label name,
    label: '{label}' series: '{series}'
labels-not-sorted | labels-not-sorted | | received a series where the label names are not
    alphabetically sorted, label: '{label}' series: '{series}'
sample-too-far-in-future | too-far-in-future | validation.create-grace-period | received a sample
    whose timestamp is too far in the future, timestamp: {ts} series: '{series}'
sample-too-old | sample-timestamp-too-old | | the sample has been rejected because its timestamp
    is too old
sample-out-of-order | sample-out-of-order | | the sample has been rejected because another sample
    with a more recent timestamp has already been ingested and out-of-order samples are not allowed
sample-duplicate-timestamp | sample-duplicate-timestamp | | the sample has been rejected because
    another sample with the same timestamp, but a different value, has already been ingested"""
_MIMIR = {
    rule: (err_id, flag, text)
    for rule, err_id, flag, text in (
        (part.strip() for part in " ".join(entry.split()).split("|"))
        for entry in re.split(r"\n(?! )", _MIMIR_TABLE)
    )
}
_INGESTER_TAIL = ". The affected sample has timestamp {when} and is from series {series}"
_LIMIT_TAIL = (
    ". To adjust the related per-tenant limit, configure -{flag}, or contact your service"
    " administrator."
)
# Thanos' own text for the rules it enforces itself (labelpb and TSDB errors): the 409 Conflicts.
_THANOS = {
    "labels-not-sorted": "out of order labels",
    "duplicate-label-names": "label set contains duplicate label names",
    "label-name-empty": "label set contains a label with empty name or value",
    "label-value-empty": "label set contains a label with empty name or value",
    "sample-out-of-order": "out of order sample",
    "sample-duplicate-timestamp": "duplicate sample for timestamp",
    "sample-duplicate": "duplicate sample for timestamp (identical resend)",
    "sample-too-old": "out of bounds",
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Mimir's default limits; ``None`` turns a check off. Byte limits count UTF-8 bytes."""

    max_label_names_per_series: int = 30
    max_label_name_bytes: int = 1024
    max_label_value_bytes: int = 2048
    past_window_s: float | None = 600.0  # older on arrival, e.g. seconds sent for milliseconds
    future_window_s: float | None = 600.0  # Mimir's creation_grace_period
    max_compressed_bytes: int | None = None  # the HTTP body as sent
    max_decoded_bytes: int | None = None  # the length the snappy block declares

    def __post_init__(self) -> None:
        for key in self.__slots__:
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"Limits.{key} must be positive (None turns a check off)")


@dataclass(frozen=True, slots=True)
class Reply:
    """A canned answer for fault tests: the request is counted but not decoded or stored."""

    status: int
    body: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule. ``labels``: the series as sent, () for a request-level rule; ``request``
    counts from 1; ``samples``: how many samples (and 2.0 histogram samples) it cost."""

    rule: str
    message: str
    labels: Labels
    request: int
    samples: int = 0


@dataclass(frozen=True, slots=True)
class Written:
    """What a 2.0 answer's ``X-Prometheus-Remote-Write-*-Written`` headers said: what was stored."""

    samples: int = 0
    histograms: int = 0
    exemplars: int = 0

    def headers(self) -> dict[str, str]:
        return {
            SAMPLES_WRITTEN_HEADER: str(self.samples),
            HISTOGRAMS_WRITTEN_HEADER: str(self.histograms),
            EXEMPLARS_WRITTEN_HEADER: str(self.exemplars),
        }


class Report(TypedDict):
    requests: int
    statuses: dict[int, int]
    series: int
    samples: int
    stale_markers: int
    metadata: int
    violations: dict[str, int]
    protocols: dict[str, int]  # {"1.0": n, "2.0": n}: requests whose Content-Type names each


def is_stale_marker(value: float) -> bool:
    """True only for the staleness NaN 0x7ff0000000000002, not for any other NaN."""
    return math.isnan(value) and struct.unpack("<Q", struct.pack("<d", value))[0] == STALE_NAN_BITS


class _Malformed(Exception):
    """The body is not a parseable protobuf message."""


@dataclass(slots=True)
class _Series:
    labels: list[tuple[bytes, bytes]] = field(default_factory=list)
    samples: list[_Point] = field(default_factory=list)  # value: float, identity: its bits
    histograms: list[_Point] = field(default_factory=list)  # value and identity: the bytes
    exemplars: list[Exemplar] = field(default_factory=list)  # 2.0
    metadata: Metadata | None = None  # 2.0, resolved; None when the series sent none
    problems: dict[str, str] = field(default_factory=dict)  # proto-* and v2-* rule -> detail


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while shift < 70:
        if pos >= end:
            raise _Malformed("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
    raise _Malformed("varint longer than 10 bytes")


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, a, b) per field: a varint's (value, 0), else its bytes a:b."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed("field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value, 0
            continue
        if wire == 2:
            size, pos = _varint(buf, pos, end)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise _Malformed(f"wire type {wire} (groups are not proto3)")
        if pos + size > end:
            raise _Malformed(f"field {number} runs past the end of its message")
        yield number, wire, pos, pos + size
        pos += size


def _expect(number: int, wire: int, want: int, where: str) -> None:
    if wire != want:
        raise _Malformed(f"{where} field {number} has wire type {wire}, want {want}")


def _singular(
    buf: bytes, a: int, b: int, wires: Mapping[int, int], where: str, problems: dict[str, str]
) -> dict[int, Any]:
    """The fields of a message of scalars: field number -> varint value or bytes."""
    out: dict[int, Any] = {}
    for number, wire, x, y in _fields(buf, a, b):
        if number not in wires:
            problems.setdefault("proto-unknown-field", f"{where} has field {number}")
            continue
        _expect(number, wire, wires[number], where)
        if number in out:  # a protobuf runtime would keep the last one silently
            problems.setdefault("proto-duplicate-field", f"{where} field {number} sent twice")
        out[number] = x if wire == 0 else buf[x:y]
    return out


def _int64(value: int) -> int:
    return value - (value >> 63 << 64)


def _sample(buf: bytes, a: int, b: int, v2: bool, problems: dict[str, str]) -> _Point:
    wires = {1: 1, 2: 0, 3: 0} if v2 else {1: 1, 2: 0}  # 2.0-rc.4 adds start_timestamp = 3
    sample = _singular(buf, a, b, wires, "Sample", problems)
    raw = sample.get(1, bytes(8))
    value = struct.unpack("<d", raw)[0]
    return _int64(sample.get(2, 0)), value, int.from_bytes(raw, "little"), _int64(sample.get(3, 0))


def _parse_request(buf: bytes) -> tuple[list[_Series], int, list[int]]:
    """The series, the number of metadata entries, and unknown WriteRequest field numbers."""
    batch, metadata, unknown = [], 0, []
    for number, wire, a, b in _fields(buf, 0, len(buf)):
        if number == 3:  # MetricMetadata: reserved in the spec, sent by Prometheus itself
            _expect(number, wire, 2, "WriteRequest")
            metadata += 1
        if number != 1:
            unknown += [number] if number != 3 else []
            continue
        _expect(number, wire, 2, "WriteRequest")
        series = _Series()
        for n, w, x, y in _fields(buf, a, b):
            if n in (1, 2):
                _expect(n, w, 2, "TimeSeries")
            if n == 1:
                label = _singular(buf, x, y, {1: 2, 2: 2}, "Label", series.problems)
                series.labels.append((label.get(1, b""), label.get(2, b"")))
            elif n == 2:
                series.samples.append(_sample(buf, x, y, False, series.problems))
            elif n == 4:  # native histograms: not in the 1.0 spec, taken by Prometheus 2.40+
                _expect(n, w, 2, "TimeSeries")
                series.histograms.append(_histogram_point(buf, x, y, series.problems, v2=False))
            else:  # exemplars (3) are not Remote-Write 1.0
                series.problems.setdefault("proto-unknown-field", f"TimeSeries has field {n}")
        if series.samples and series.histograms:
            both = f"{len(series.samples)} samples and {len(series.histograms)} histograms"
            series.problems["samples-and-histograms"] = f"series has {both}: send two series"
        batch.append(series)
    return batch, metadata, unknown


def _refs(buf: bytes, wire: int, a: int, b: int, where: str) -> list[int]:
    """A repeated uint32, packed (as proto3 encoders write it) or not (parsers accept both)."""
    if wire == 0:
        return [a]
    _expect(1, wire, 2, where)
    out, pos = [], a
    while pos < b:
        value, pos = _varint(buf, pos, b)
        out.append(value)
    return out


class _Symbols:
    """Request.symbols, resolving refs and remembering the first one out of range."""

    def __init__(self, symbols: list[bytes]) -> None:
        self.symbols = symbols
        self.bad = ""

    def __call__(self, ref: int, where: str) -> bytes:
        if ref < len(self.symbols):
            return self.symbols[ref]
        self.bad = self.bad or f"{where} = {ref}, but there are {len(self.symbols)} symbols"
        return f"<ref {ref}>".encode()

    def pairs(
        self, refs: list[int], where: str, problems: dict[str, str]
    ) -> list[tuple[bytes, bytes]]:
        if len(refs) % 2:
            problems.setdefault("v2-labels-refs-odd", f"{where} has {len(refs)} refs, not pairs")
        return [
            (self(refs[i], f"{where}[{i}]"), self(refs[i + 1], f"{where}[{i + 1}]"))
            for i in range(0, len(refs) - 1, 2)
        ]


def _histogram_point(
    buf: bytes, a: int, b: int, problems: dict[str, str], v2: bool = True
) -> _Point:
    """The timestamps are read here (15, and 2.0's 17); the message is stored as sent, and its
    buckets checked at ingest (``_histogram_check``)."""
    ts = start = 0
    for n, w, x, _ in _fields(buf, a, b):
        if n == 15 or (n == 17 and v2):
            _expect(n, w, 0, "Histogram")
            ts, start = (_int64(x), start) if n == 15 else (ts, _int64(x))
        elif n > (17 if v2 else 16):
            problems.setdefault("proto-unknown-field", f"Histogram has field {n}")
    return ts, buf[a:b], buf[a:b], start


def _histogram_check(raw: bytes, last: bytes | None) -> tuple[str, str] | None:
    """(rule, detail) for a histogram Prometheus would refuse (its validation), or whose reset
    hint contradicts the series' last accepted histogram (``last``); None when it is valid."""
    try:
        h = writev2_pb2.Histogram.FromString(raw)  # fields 1 to 16 are 1.0's too
    except Exception as err:  # the protobuf runtime's DecodeError
        return "histogram-invalid", f"not a Histogram message: {err}"
    problems = histogram_problems(h)
    if not math.isfinite(h.zero_threshold):
        problems.append(f"zero threshold {h.zero_threshold} is not finite")
    if problems:
        return "histogram-invalid", "; ".join(problems)
    hint = h.reset_hint
    if hint == writev2_pb2.Histogram.RESET_HINT_GAUGE:
        return "histogram-reset-hint", "a gauge histogram in a counter histogram series"
    if last is not None and hint == writev2_pb2.Histogram.RESET_HINT_NO:
        before = writev2_pb2.Histogram.FromString(last)
        if h.count_int < before.count_int or h.zero_count_int < before.zero_count_int:
            got = f"count {before.count_int} -> {h.count_int}"
            return "histogram-reset-hint", f"reset hint NO, but the counts went down ({got})"
    return None


def _parse_series_v2(buf: bytes, a: int, b: int, sym: _Symbols) -> _Series:
    series, refs, seen_metadata = _Series(), [], False
    problems = series.problems
    for n, w, x, y in _fields(buf, a, b):
        if n == 1:
            refs += _refs(buf, w, x, y, "TimeSeries")
            continue
        _expect(n, w, 2, "TimeSeries")
        if n == 2:
            series.samples.append(_sample(buf, x, y, True, problems))
        elif n == 3:
            series.histograms.append(_histogram_point(buf, x, y, problems))
        elif n == 4:
            ex_refs, value, ts = [], 0.0, 0
            for en, ew, ex, ey in _fields(buf, x, y):
                if en == 1:
                    ex_refs += _refs(buf, ew, ex, ey, "Exemplar")
                elif en in (2, 3):
                    _expect(en, ew, 1 if en == 2 else 0, "Exemplar")
                    value, ts = (struct.unpack("<d", buf[ex:ey])[0], ts) if en == 2 else (value, ex)
                else:
                    problems.setdefault("proto-unknown-field", f"Exemplar has field {en}")
            pairs = sym.pairs(ex_refs, "Exemplar.labels_refs", problems)
            labels = tuple((_text(k), _text(v)) for k, v in pairs)
            series.exemplars.append((labels, value, _int64(ts)))
        elif n == 5:
            if seen_metadata:  # a runtime would merge the two silently
                problems.setdefault("proto-duplicate-field", "TimeSeries field 5 sent twice")
            seen_metadata = True
            meta = _singular(buf, x, y, {1: 0, 3: 0, 4: 0}, "Metadata", problems)
            kind = meta.get(1, 0)
            name = _METRIC_TYPES[kind] if kind < len(_METRIC_TYPES) else f"type {kind}"
            help_, unit = sym(meta.get(3, 0), "Metadata.help_ref"), sym(meta.get(4, 0), "unit_ref")
            series.metadata = (name, _text(help_), _text(unit))
        else:  # 6 was created_timestamp before rc.4, and is reserved now
            problems.setdefault("proto-unknown-field", f"TimeSeries has field {n}")
    series.labels = sym.pairs(refs, "labels_refs", problems)
    if sym.bad:
        problems["v2-ref-out-of-range"], sym.bad = sym.bad, ""
    if not series.samples and not series.histograms:
        problems["v2-no-samples"] = ""
    elif series.samples and series.histograms:
        both = f"{len(series.samples)} samples and {len(series.histograms)} histograms"
        problems["v2-samples-and-histograms"] = f"series has {both}: send them as two series"
    if series.metadata is None or series.metadata[0] == "unknown":
        got = "no metadata" if series.metadata is None else "metadata without a type"
        problems["v2-metadata-missing"] = f"{got}: want type, help and unit"
    return series


def _parse_v2(buf: bytes) -> tuple[list[bytes], list[_Series], list[int]]:
    """Request.symbols, the series with their refs resolved, and unknown Request field numbers."""
    symbols, spans, unknown = [], [], []
    for number, wire, a, b in _fields(buf, 0, len(buf)):
        if number not in (4, 5):  # 1 to 3 are reserved: 1.0's WriteRequest fields
            unknown.append(number)
            continue
        _expect(number, wire, 2, "Request")
        if number == 4:
            symbols.append(buf[a:b])
        else:
            spans.append((a, b))
    sym = _Symbols(symbols)  # the symbols may come after the series that use them
    return symbols, [_parse_series_v2(buf, a, b, sym) for a, b in spans], unknown


def _proto_named(content_type: str | None) -> str | None:
    """The message a Content-Type names (no ``proto=``: 1.0's), or None unless it is one of the
    spec's three values (spaces around ``;`` and the parameter name's case aside)."""
    media, *params = [p.strip() for p in (content_type or "").split(";")]
    if media != _MEDIA_TYPE or len(params) > 1:
        return None
    if not params:
        return PROTO_V1
    name, _, value = params[0].partition("=")
    return value if name.strip().lower() == "proto" and value in PROTOCOLS else None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _text(raw: bytes) -> str:
    """Lossless, for keys: invalid UTF-8 survives as surrogates."""
    return raw.decode("utf-8", "surrogateescape")


def _quote(raw: bytes) -> str:
    """For messages: invalid UTF-8 becomes U+FFFD, as Mimir's validUTF8Message does."""
    return raw.decode("utf-8", "replace")[:200]


def _show(labels: Labels) -> str:
    text = "{" + ", ".join(f'{n}="{v}"' for n, v in labels) + "}"
    return text.encode("utf-8", "backslashreplace").decode()


def _context(labels: Labels) -> dict[str, Any]:
    """The fields every rule's message may name; the rest come from the offending label."""
    name = dict(labels).get("__name__", "").encode("utf-8", "surrogateescape")
    return {"series": _show(labels)[:200], "name": _quote(name), "hint": ""}


def _when(ts: int) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(ts / 1000, datetime.UTC)
    except (OverflowError, ValueError, OSError):
        return str(ts)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ConformanceReceiver:
    """The strict receiver on 127.0.0.1. Its attributes hold what it saw: read them after the
    ``with`` block, or during it through ``wait``/``wait_async``/``report`` (they take the lock).

    ``accept``: the messages it decodes (default both); a request naming another gets 415, which is
    no violation (a sender may probe and fall back). ``legacy_v1_only``: a 1.x receiver that ignores
    the Content-Type and decodes every body as 1.0, answering 204 without ``Written`` headers.
    ``require_metadata``: drop a 2.0 series without a metadata type (default: record
    ``v2-metadata-missing`` and store it). ``refuse_histograms``: (status, text) to answer any
    request with a native histogram, storing nothing of it (a receiver without them)."""

    def __init__(
        self,
        *,
        flavour: Flavour = "thanos",
        tenant_header: str | None = None,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
        script: Iterable[Reply] = (),
        port: int = 0,
        path: str = "/api/v1/write",
        accept: Iterable[str] | None = None,
        legacy_v1_only: bool = False,
        require_metadata: bool = False,
        refuse_histograms: tuple[int, str] | None = None,
    ) -> None:
        if flavour not in ("thanos", "mimir"):
            raise ValueError(f"flavour must be 'thanos' or 'mimir', not {flavour!r}")
        if legacy_v1_only and accept is not None:
            raise ValueError(
                "accept has no effect with legacy_v1_only=True, which reads all as 1.0"
            )
        self.accept = tuple(PROTOCOLS) if accept is None else tuple(accept)
        if (
            not self.accept
            or not set(self.accept) <= set(PROTOCOLS)
            or len(set(self.accept)) < len(self.accept)
        ):
            raise ValueError(
                f"accept must name some of {tuple(PROTOCOLS)} once each, not {accept!r}"
            )
        self.legacy_v1_only = legacy_v1_only
        self.require_metadata = require_metadata
        self.refuse_histograms = refuse_histograms
        self.flavour: Flavour = flavour
        self.tenant_header = tenant_header
        self.limits = limits or Limits()
        self.clock = clock  # seconds since the epoch, like time.time
        self.script = deque(script)
        self.path = path
        self.samples: dict[Labels, list[Sample]] = {}
        self.violations: list[Violation] = []
        self.requests = 0
        self.statuses: list[int] = []
        self.bodies: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.metadata = 0
        self.histograms: dict[Labels, list[Histogram]] = {}  # 2.0
        self.exemplars: dict[Labels, list[Exemplar]] = {}  # 2.0, of stored series
        self.metadata_of: dict[Labels, Metadata] = {}  # 2.0: the last sent with a stored sample
        self.start_timestamps: dict[Labels, set[int]] = {}  # 2.0: non-zero, of stored samples
        self.protocols: list[str] = []  # per request: "1.0", "2.0", or "" (Content-Type invalid)
        self.written: list[Written | None] = []  # per answer, beside statuses; None: no headers
        # The last accepted (ts, identity) per series: a sample's bits or a histogram's bytes.
        self._last: dict[Labels, tuple[int, int | bytes]] = {}
        self._port = port
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}{self.path}"

    async def start(self) -> None:
        """Listen on the running loop."""
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", self.path, self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self._port).start()
        self._port = int(self._runner.addresses[0][1])
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ConformanceReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __enter__(self) -> ConformanceReceiver:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve_in_thread, args=(ready,), name="conformance-receiver", daemon=True
        )
        self._thread.start()
        ready.wait(30)
        if self._thread_error is not None or self._runner is None:
            raise RuntimeError("the conformance receiver did not start") from self._thread_error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def _serve_in_thread(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.start())
            self._stop = asyncio.Event()
            ready.set()
            loop.run_until_complete(self._stop.wait())
        except BaseException as err:  # __enter__ raises it
            self._thread_error = err
            ready.set()
        finally:
            loop.run_until_complete(self.stop())
            loop.close()

    def wait(self, until: Callable[[ConformanceReceiver], bool], timeout_s: float = 10.0) -> None:
        """Block until ``until(self)`` holds (checked after each answer) or fail the test."""
        try:
            own_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            own_loop = False
        if own_loop:
            raise RuntimeError("wait() would block the receiver's own loop: await wait_async()")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not until(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"not met within {timeout_s} s: {self.report()}")
                self._cond.wait(left)

    async def wait_async(
        self, until: Callable[[ConformanceReceiver], bool], timeout_s: float = 10.0
    ) -> None:
        """``wait`` for async tests: a worker thread waits, the loop goes on serving."""
        await asyncio.to_thread(self.wait, until, timeout_s)

    def series_named(self, name: str, **match: str) -> dict[Labels, list[Sample]]:
        """Stored series with ``__name__ == name`` that carry every label in ``match``."""
        want = {("__name__", name), *match.items()}
        with self._lock:
            return {k: list(v) for k, v in self.samples.items() if want <= set(k)}

    def report(self) -> Report:
        with self._lock:
            values = [v for samples in self.samples.values() for _, v in samples]
            return Report(
                requests=self.requests,
                statuses=dict(sorted(Counter(self.statuses).items())),
                series=len(self.samples),
                samples=len(values),
                stale_markers=sum(map(is_stale_marker, values)),
                metadata=self.metadata,
                violations=dict(Counter(v.rule for v in self.violations)),
                protocols={v: self.protocols.count(v) for v in PROTOCOLS.values()},
            )

    def assert_conformant(self, ignore: Iterable[str] = ()) -> None:
        """Raise AssertionError listing every violation whose rule is not in ``ignore``."""
        skip = set(ignore)
        with self._lock:
            found = [v for v in self.violations if v.rule not in skip]
        if found:
            lines = [f"request {v.request}: {v.rule}: {v.message} {_show(v.labels)}" for v in found]
            more = f"\n... and {len(lines) - 50} more" if len(lines) > 50 else ""
            raise AssertionError(f"{len(found)} violation(s):\n" + "\n".join(lines[:50]) + more)

    async def _handle(self, request: web.Request) -> web.Response:
        proto = _proto_named(request.headers.get("Content-Type"))
        protocol = PROTOCOLS.get(proto or "", "")
        with self._lock:
            self.requests += 1
            number = self.requests
            self.headers.append(dict(request.headers))
            self.protocols.append(protocol)
            reply = self.script.popleft() if self.script else None
        if reply is not None:
            return self._answer(reply.status, reply.body, dict(reply.headers))
        v2 = protocol == "2.0" and not self.legacy_v1_only  # decoded as 2.0 once accepted
        zero = Written() if v2 and PROTO_V2 in self.accept else None  # 2.0 answers carry them
        refused = self._check_transport(request, number, proto)
        if refused is not None:
            return self._answer(*refused, written=None if refused[0] == 415 else zero)
        body = await request.read()
        refused = self._check_body(body, number)
        if refused is not None:
            return self._answer(*refused, written=zero)
        try:
            decoded = snappy.uncompress(body)
        except Exception as err:  # python-snappy raises several types for a corrupt block
            refused = self._refuse(number, "snappy-invalid", repr(err), 400)
            return self._answer(*refused, written=zero)
        metadata, symbols = 0, [b""]
        try:
            if v2:
                symbols, batch, unknown = _parse_v2(decoded)
            else:
                batch, metadata, unknown = _parse_request(decoded)
        except _Malformed as err:
            return self._answer(
                *self._refuse(number, "proto-malformed", str(err), 400), written=zero
            )
        if batch and symbols[:1] != [b""]:
            got = f"symbols[0] is {_quote(symbols[0])!r}" if symbols else "no symbols"
            message = f"{got}: the table must start with the empty string"
            refused = self._refuse(number, "v2-symbols-first-not-empty", message, 400)
            return self._answer(*refused, written=zero)
        if self.legacy_v1_only and protocol == "2.0":
            unknown = []  # what an old receiver sees: an empty WriteRequest
        if self.refuse_histograms is not None and any(s.histograms for s in batch):
            # a receiver without native histograms (Prometheus 2 without the feature flag):
            # the whole request is refused, nothing stored, and no rule of the sender's broken
            return self._answer(*self.refuse_histograms, written=zero)
        with self._lock:
            self.metadata += metadata
            status, text, written = self._ingest(batch, unknown, number, v2)
        if status == 200 and (v2 or self.legacy_v1_only):
            status = 204  # 2.0: SHOULD; what Prometheus answers, 2.x to every message
        return self._answer(status, text, written=written if v2 else None)

    def _answer(
        self,
        status: int,
        body: str,
        headers: Mapping[str, str] | None = None,
        written: Written | None = None,
    ) -> web.Response:
        with self._lock:
            self.statuses.append(status)
            self.bodies.append(body)
            self.written.append(written)
            self._cond.notify_all()
        text = body.encode("utf-8", "backslashreplace").decode() if body else None
        headers = {**(headers or {}), **(written.headers() if written else {})}
        return web.Response(status=status, text=text, headers=headers)

    def _record(self, rule: str, message: str, labels: Labels, number: int, lost: int = 0) -> None:
        with self._lock:
            self.violations.append(Violation(rule, message, labels, number, lost))

    def _refuse(self, number: int, rule: str, message: str, status: int) -> tuple[int, str]:
        self._record(rule, message, (), number)
        return status, f"{rule}: {message}"

    def _check_transport(
        self, request: web.Request, number: int, proto: str | None
    ) -> tuple[int, str] | None:
        """Method and headers: every problem is recorded, the first decides the answer."""
        headers, problems = request.headers, []

        def bad(rule: str, message: str, status: int = 400, body: str = "") -> None:
            self._record(rule, message, (), number)
            problems.append((status, body or f"{rule}: {message}"))

        if request.method != "POST":
            bad("http-method", f"method {request.method}, want POST", 405)
        if self.tenant_header is not None and not headers.get(self.tenant_header):
            if self.flavour == "mimir":  # dskit's AuthenticateUser middleware
                bad("tenant-missing", f"no {self.tenant_header} header", 401, "no org id")
            else:
                bad("tenant-missing", f"no {self.tenant_header} header")
        encoding = headers.get("Content-Encoding")
        if encoding is None or encoding.lower() != "snappy":
            bad("header-content-encoding", f"Content-Encoding {encoding!r}, want 'snappy'", 415)
        if proto is None:
            got, want = headers.get("Content-Type"), f"{_MEDIA_TYPE}[;proto={PROTO_V1}|{PROTO_V2}]"
            bad("header-content-type", f"Content-Type {got!r}, want {want!r}", 415)
        elif proto not in self.accept and not self.legacy_v1_only:  # no violation: a probe
            problems.append((415, f"{proto} is not accepted here; accepted: {list(self.accept)}"))
        version = headers.get("X-Prometheus-Remote-Write-Version")
        if proto == PROTO_V2 and not _V2_VERSION_RE.fullmatch(version or ""):
            message = f"X-Prometheus-Remote-Write-Version {version!r}, want '2.0.0' with {PROTO_V2}"
            bad("header-version", message)
        elif proto != PROTO_V2 and version != "0.1.0":
            bad("header-version", f"X-Prometheus-Remote-Write-Version {version!r}, want '0.1.0'")
        agent = headers.get("User-Agent", "")
        if not agent.strip() or _LIBRARY_AGENT_RE.match(agent):
            bad("header-user-agent", f"User-Agent {agent!r} does not name the sender")
        return problems[0] if problems else None

    def _check_body(self, body: bytes, number: int) -> tuple[int, str] | None:
        limits = self.limits
        too_large = "write request too large"  # Thanos' text; Mimir names its error id
        if self.flavour == "mimir":
            too_large = (
                "the request exceeds the size limit (err-mimir-distributor-max-write-message-size)"
            )
        if limits.max_compressed_bytes is not None and len(body) > limits.max_compressed_bytes:
            message = f"compressed body of {len(body)} bytes, limit {limits.max_compressed_bytes}"
            return self._refuse(number, "body-compressed-too-large", message, 413)[0], too_large
        if body.startswith(SNAPPY_FRAMED_MAGIC):
            return self._refuse(number, "snappy-framed", "snappy framed format, want block", 400)
        try:
            declared, _ = _varint(body, 0, len(body))
        except _Malformed:
            return self._refuse(number, "snappy-invalid", "no snappy block length", 400)
        if limits.max_decoded_bytes is not None and declared > limits.max_decoded_bytes:
            message = f"snappy block declares {declared} bytes, limit {limits.max_decoded_bytes}"
            return self._refuse(number, "body-decoded-too-large", message, 413)[0], too_large
        return None

    def _label_problems(self, raw: list[tuple[bytes, bytes]]) -> dict[str, dict[str, Any]]:
        """Series-level rules this label set breaks: rule -> its first offending label."""
        lim, seen = self.limits, set()
        found: dict[str, dict[str, Any]] = {}
        names = [v for n, v in raw if n == b"__name__"]
        if not names:
            found["missing-metric-name"] = {}
        elif not _METRIC_RE.fullmatch(names[0]):
            found["metric-name-invalid"] = {"value": _quote(names[0])}
        if len(raw) > (most := lim.max_label_names_per_series):
            found["max-label-names-per-series"] = {"actual": len(raw), "limit": most}
        for i, (name, value) in enumerate(raw):
            prev = raw[i - 1][0] if i else b""
            ctx = {"label": _quote(name), "value": _quote(value), "prev": _quote(prev)}
            name_len: dict[str, Any] = {"actual": len(name), "limit": lim.max_label_name_bytes}
            value_len: dict[str, Any] = {"actual": len(value), "limit": lim.max_label_value_bytes}
            for rule, broken, extra in (
                ("label-name-empty", not name, {}),
                ("label-name-invalid", bool(name) and not _LABEL_RE.fullmatch(name), {}),
                ("label-name-too-long", len(name) > lim.max_label_name_bytes, name_len),
                ("label-value-empty", not value, {}),
                ("label-value-invalid-utf8", not _is_utf8(value), {}),
                ("label-value-too-long", len(value) > lim.max_label_value_bytes, value_len),
                ("duplicate-label-names", name in seen, {}),
                ("labels-not-sorted", i > 0 and name not in seen and name < prev, {}),
            ):
                if broken:
                    found.setdefault(rule, {**ctx, **extra})
            seen.add(name)
        return found

    def _sample_problem(
        self, key: Labels, ts: int, ident: int | bytes, now_ms: float
    ) -> Problem | None:
        future, past, hint = self.limits.future_window_s, self.limits.past_window_s, ""
        if future is not None and ts > now_ms + future * 1000:
            if ts > now_ms * 100:
                hint = " (looks like micro- or nanoseconds, not milliseconds)"
            delta_s = (ts - now_ms) / 1000
            return "sample-too-far-in-future", {"delta_s": delta_s, "limit": future, "hint": hint}
        if past is not None and ts < now_ms - past * 1000:
            if abs(ts * 1000 - now_ms) < _DAY_MS:
                hint = " (looks like seconds, not milliseconds)"
            return "sample-too-old", {"delta_s": (now_ms - ts) / 1000, "limit": past, "hint": hint}
        last = self._last.get(key)
        if last is None or ts > last[0]:
            return None
        if ts < last[0]:
            return "sample-out-of-order", {"last": last[0]}
        return ("sample-duplicate" if ident == last[1] else "sample-duplicate-timestamp"), {}

    def _ingest(
        self, batch: list[_Series], unknown: list[int], number: int, v2: bool
    ) -> tuple[int, str, Written]:
        """Store what passes, record the rest, and answer as the flavour would. Holds the lock."""
        now_ms, refused, written = self.clock() * 1000, 0, [0, 0, 0]
        firsts: list[str] = []  # Mimir answers with the first error
        counts: dict[tuple[str, str], list[Any]] = {}  # Thanos: "add N series|samples: error"
        if unknown:
            names = list(dict.fromkeys(unknown))  # each once, in the order sent
            message = f"{'Request' if v2 else 'WriteRequest'} has fields {names}"
            if set(unknown) & ({1, 2, 3} if v2 else {4, 5}):
                message += f" (a {'1.0 WriteRequest' if v2 else '2.0 Request'} body?)"
            self._record("proto-unknown-field", message, (), number)
            firsts.append(f"{message} (conformance-proto-unknown-field)")
            counts["proto-unknown-field", "requests"] = [1, message]
            refused += 1
        for series in batch:
            labels: Labels = tuple((_text(n), _text(v)) for n, v in series.labels)
            base = _context(labels)
            problems = {rule: {"detail": detail} for rule, detail in series.problems.items()}
            if not {"v2-labels-refs-odd", "v2-ref-out-of-range"} & problems.keys():
                problems.update(self._label_problems(series.labels))  # not of placeholders
            soft = None if self.require_metadata else problems.pop("v2-metadata-missing", None)
            if soft is not None:  # a SHOULD: recorded, the series is still stored
                message = _SAYS["v2-metadata-missing"].format(**soft)
                self._record("v2-metadata-missing", message, labels, number)
            lost = len(series.samples) + len(series.histograms)
            for rule, ctx in problems.items():
                message = self._say(rule, {**base, **ctx}, firsts)
                self._record(rule, message, labels, number, lost)
                counts.setdefault((rule, "series"), [0, message])[0] += 1
                refused += 1
            kind = 1 if series.histograms else 0
            if not problems and labels in (self.samples if kind else self.histograms):
                had = "samples" if kind else "histograms"
                detail = f"series stored {had} before, and now sends the other kind"
                message = self._say("samples-and-histograms", {**base, "detail": detail}, firsts)
                self._record("samples-and-histograms", message, labels, number, lost)
                counts.setdefault(("samples-and-histograms", "series"), [0, message])[0] += 1
                refused += 1
                continue
            if problems:
                continue
            store: dict[Labels, list[Any]] = self.histograms if kind else self.samples
            dropped: dict[str, list[Any]] = {}  # rule -> [fields of its first sample, count]
            kept = 0
            for ts, value, ident, start in series.histograms or series.samples:
                problem = self._sample_problem(labels, ts, ident, now_ms)
                if problem is None and kind:
                    last = self._last.get(labels)
                    bad = _histogram_check(value, last[1] if last else None)  # type: ignore[arg-type]
                    problem = None if bad is None else (bad[0], {"detail": bad[1]})
                if problem is None:
                    store.setdefault(labels, []).append((ts, value))
                    self._last[labels] = (ts, ident)
                    kept += 1
                    if start:
                        self.start_timestamps.setdefault(labels, set()).add(start)
                else:
                    at = {**base, **problem[1], "ts": ts, "when": _when(ts)}
                    dropped.setdefault(problem[0], [at, 0])[1] += 1
            written[kind] += kept
            if series.metadata is not None and kept:
                self.metadata_of[labels] = series.metadata
            for rule, (ctx, n) in dropped.items():
                message = self._say(rule, ctx, firsts) + (f" ({n} samples)" if n > 1 else "")
                self._record(rule, message, labels, number, n)
                counts.setdefault((rule, "samples"), [0, message])[0] += n
                refused += 1
            for exemplar in series.exemplars:
                if not exemplar[2]:
                    rule = "v2-exemplar-timestamp-missing"
                    message = self._say(rule, {**base, "value": exemplar[1]}, firsts)
                    self._record(rule, message, labels, number)
                    counts.setdefault((rule, "exemplars"), [0, message])[0] += 1
                    refused += 1
                    continue
                self.exemplars.setdefault(labels, []).append(exemplar)
                written[2] += 1
        stored = Written(*written)
        if not refused:
            return 200, "", stored
        if self.flavour == "mimir":
            return 400, firsts[0], stored
        parts = [
            f"add {n} {what}: {_THANOS.get(rule, f'{rule}: {message}')}"
            for (rule, what), (n, message) in counts.items()
        ]
        return (409 if any(r in _THANOS for r, _ in counts) else 400), "; ".join(parts), stored

    def _say(self, rule: str, ctx: dict[str, Any], firsts: list[str]) -> str:
        """The rule's message; Mimir's wording (or a stand-in) goes to ``firsts``."""
        message = _SAYS[rule].format(**ctx)
        if rule not in _MIMIR:
            firsts.append(f"{message} series: '{ctx['series']}' (conformance-{rule})")
            return message
        err_id, flag, text = _MIMIR[rule]
        text += f" (err-mimir-{err_id})"
        if text.startswith("the sample has been rejected"):
            text += _INGESTER_TAIL
        if flag:
            text += _LIMIT_TAIL.replace("{flag}", flag)
        firsts.append(text.format(**ctx))
        return message


async def _serve(args: argparse.Namespace) -> int:
    limits = Limits(
        past_window_s=args.past_window_s or None,
        future_window_s=args.future_window_s or None,
        max_compressed_bytes=args.max_compressed_bytes,
        max_decoded_bytes=args.max_decoded_bytes,
    )
    rx = ConformanceReceiver(
        flavour=args.flavour,
        tenant_header=args.tenant_header,
        limits=limits,
        port=args.port,
        accept=args.accept,
        legacy_v1_only=args.legacy_v1_only,
        require_metadata=args.require_metadata,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with rx:
        print(f"listening on {rx.url}", flush=True)
        await stop.wait()
    print(json.dumps(rx.report(), indent=2))
    for v in rx.violations:
        print(f"request {v.request}: {v.rule}: {v.message} {_show(v.labels)}")
    return 1 if rx.violations else 0


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT or SIGTERM, print the report; exit 1 if any rule was broken."""
    parser = argparse.ArgumentParser(description="Strict Remote-Write 1.0 and 2.0 receiver.")
    add = parser.add_argument
    add("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    add("--flavour", choices=("thanos", "mimir"), default="thanos")
    add("--tenant-header", help="refuse requests without this header, e.g. THANOS-TENANT")
    add("--past-window-s", type=float, default=600.0, help="0 turns the check off")
    add("--future-window-s", type=float, default=600.0, help="0 turns the check off")
    add("--max-compressed-bytes", type=int)
    add("--max-decoded-bytes", type=int)
    add("--accept", action="append", choices=tuple(PROTOCOLS), help="repeat; default: both")
    add("--legacy-v1-only", action="store_true", help="decode every body as 1.0, as 1.x does")
    add("--require-metadata", action="store_true", help="drop 2.0 series without a type")
    args = parser.parse_args(argv)
    if args.legacy_v1_only and args.accept:
        parser.error("--accept has no effect with --legacy-v1-only: drop one of them")
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())

"""Wire: reads encoded ``WriteRequest`` bytes back at the field level, without protobuf objects.

The sender needs three things of bytes it already encoded (or a spool stored): cut a request
into smaller ones at ``TimeSeries`` boundaries (a ``WriteRequest`` is a concatenation of its
top-level fields, so any run of whole fields is a valid request), count the samples in a piece,
and put the labels of records spooled by an older version into the byte order the spec requires.
Nothing here runs per window on the hot path: only on a split, a 413, or a legacy record.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from hfsampler.remote_write.encoder import varint

_TIMESERIES = 1  # WriteRequest.timeseries
_TIMESERIES_TAG = b"\x0a"
_LABELS = 1  # TimeSeries.labels
_SAMPLES = 2  # TimeSeries.samples
_LABEL_NAME = 1  # Label.name


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


class Field(NamedTuple):
    """One field of a message: its number and wire type, and where it lies in the bytes."""

    number: int
    wire_type: int
    start: int  # the field's key
    payload: int  # the payload (after the length prefix of a length-delimited field)
    end: int  # one past the field


def fields(data: bytes) -> Iterator[Field]:
    """Every top-level field of a message, in order."""
    pos = 0
    size = len(data)
    while pos < size:
        start = pos
        key, pos = _varint_at(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, end = _varint_at(data, pos)
        elif wire_type == 1:
            end = pos + 8
        elif wire_type == 2:
            length, pos = _varint_at(data, pos)
            end = pos + length
        elif wire_type == 5:
            end = pos + 4
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        if end > size:
            raise WireError("field runs past the end of the message")
        yield Field(number, wire_type, start, pos, end)
        pos = end


def pieces(raw: bytes) -> list[bytes]:
    """The request's top-level fields (``TimeSeries`` and metadata entries), each whole."""
    return [raw[f.start : f.end] for f in fields(raw)]


def _is_series(f: Field) -> bool:
    return f.number == _TIMESERIES and f.wire_type == 2


def count_samples(raw: bytes) -> int:
    """How many samples the ``WriteRequest`` holds."""
    total = 0
    for f in fields(raw):
        if _is_series(f):
            body = raw[f.payload : f.end]
            total += sum(1 for g in fields(body) if g.number == _SAMPLES and g.wire_type == 2)
    return total


def split(raw: bytes, max_bytes: int) -> list[bytes]:
    """Requests of at most ``max_bytes`` each (a single larger field stays one request)."""
    if len(raw) <= max_bytes:
        return [raw]
    out: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for piece in pieces(raw):
        if current and size + len(piece) > max_bytes:
            out.append(b"".join(current))
            current, size = [], 0
        current.append(piece)
        size += len(piece)
    if current:
        out.append(b"".join(current))
    return out


def halve(raw: bytes) -> tuple[bytes, bytes] | None:
    """The request cut in two at the field boundary nearest its middle; None for one field."""
    ends = [f.end for f in fields(raw)][:-1]
    if not ends:
        return None
    cut = min(ends, key=lambda end: abs(2 * end - len(raw)))
    return raw[:cut], raw[cut:]


def sort_labels(raw: bytes) -> bytes:
    """The request with every ``TimeSeries``' labels in byte order of name; other bytes kept.

    For records spooled before the encoder put ``__name__`` in its place. The sort is stable,
    so two labels of one name (never written by hfsampler) stay for the receiver to refuse.
    """
    out: list[bytes] = []
    changed = False
    for f in fields(raw):
        piece = raw[f.start : f.end]
        if not _is_series(f):
            out.append(piece)
            continue
        body = raw[f.payload : f.end]
        labels: list[tuple[bytes, bytes]] = []
        rest: list[bytes] = []
        for g in fields(body):
            if g.number == _LABELS and g.wire_type == 2:
                labels.append((_label_name(body[g.payload : g.end]), body[g.start : g.end]))
            else:
                rest.append(body[g.start : g.end])
        ordered = sorted(labels, key=lambda label: label[0])
        if ordered == labels:
            out.append(piece)
            continue
        changed = True
        new_body = b"".join(whole for _, whole in ordered) + b"".join(rest)
        out.append(_TIMESERIES_TAG + varint(len(new_body)) + new_body)
    return b"".join(out) if changed else raw


def _label_name(label: bytes) -> bytes:
    for f in fields(label):
        if f.number == _LABEL_NAME and f.wire_type == 2:
            return label[f.payload : f.end]
    return b""


def merge_series(raw: bytes) -> bytes:
    """The request with each series' ``TimeSeries`` entries (one per block it came in) joined
    into one, samples in the order they came; other entries kept after them.

    Blocks are encoded per window, so a batch of several windows would carry every label set
    once per window; joined, a backlog is as small as one request of many samples per series.
    Assumes hfsampler's own layout: a ``TimeSeries`` holds its labels first, then its samples.
    """
    by_labels: dict[bytes, list[bytes]] = {}
    other: list[bytes] = []
    for f in fields(raw):
        if not _is_series(f):
            other.append(raw[f.start : f.end])
            continue
        pos = f.payload
        while pos < f.end and raw[pos] == 0x0A:  # the Label fields
            length, pos = _varint_at(raw, pos + 1)
            pos += length
        samples = raw[pos : f.end]
        parts = by_labels.get(raw[f.payload : pos])
        if parts is None:
            by_labels[raw[f.payload : pos]] = [samples]
        else:
            parts.append(samples)
    if len(by_labels) + len(other) == sum(1 for _ in fields(raw)):
        return raw  # every series came once: nothing to join
    out = []
    for labels, parts in by_labels.items():
        body = labels + b"".join(parts)
        out.append(_TIMESERIES_TAG + varint(len(body)) + body)
    return b"".join(out) + b"".join(other)

"""Protobuf writing: varints, length-delimited fields, and the 1.0 entries written once per series
or family (a series' ``Label`` entries, a family's ``MetricMetadata``), never per sample.

Both encoders write the wire format by hand instead of building message objects; the generated
modules in ``prompb/`` are the reference the tests hold them to, never imported here, so the hot
path does not depend on the protobuf runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hfsampler.series import Family

# Tags are (field_number << 3) | wire_type; wire type 2 is length-delimited, 1 is 64-bit, 0 varint.
TAG_WRITE_REQUEST_TIMESERIES = b"\x0a"  # WriteRequest.timeseries = 1
TAG_WRITE_REQUEST_METADATA = b"\x1a"  # WriteRequest.metadata = 3
_TAG_TIMESERIES_LABELS = b"\x0a"  # TimeSeries.labels = 1
_TAG_LABEL_NAME = b"\x0a"  # Label.name = 1
_TAG_LABEL_VALUE = b"\x12"  # Label.value = 2
_TAG_METADATA_TYPE = b"\x08"  # MetricMetadata.type = 1
_TAG_METADATA_NAME = b"\x12"  # MetricMetadata.metric_family_name = 2
_TAG_METADATA_HELP = b"\x22"  # MetricMetadata.help = 4
_TAG_METADATA_UNIT = b"\x2a"  # MetricMetadata.unit = 5

# MetricMetadata.MetricType values from prompb/types.proto (2.0's Metadata.MetricType agrees).
METRIC_TYPES: Mapping[str, int] = {
    "unknown": 0,
    "counter": 1,
    "gauge": 2,
    "histogram": 3,
    "gaugehistogram": 4,
    "summary": 5,
    "info": 6,
    "stateset": 7,
}

_UINT64 = 1 << 64


def varint(value: int) -> bytes:
    """Protobuf base-128 varint; negative int64 values take ten bytes (two's complement)."""
    if value < 0:
        value += _UINT64
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Lengths and symbol references mostly fit here; a table lookup beats computing the varint.
SMALL_LIMIT = 1 << 14
SMALL_VARINTS = [varint(i) for i in range(SMALL_LIMIT)]


def zigzag(value: int) -> int:
    """The sint32/sint64 encoding: 0, -1, 1, -2, ... as 0, 1, 2, 3, ..."""
    return (value << 1) ^ (value >> 63) if value < 0 else value << 1


def varint_len(value: int) -> int:
    """How many bytes ``varint(value)`` takes, for a value of at least 0."""
    return 1 if value < 0x80 else (value.bit_length() + 6) // 7


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + varint(len(payload)) + payload


def encode_labels(pairs: Iterable[tuple[str, str]]) -> bytes:
    """The repeated 1.0 ``TimeSeries.labels`` entries for ``(name, value)`` pairs, in the order
    given (a series' ``all_labels()``: byte order of name, ``__name__`` included)."""
    parts = []
    for name, value in pairs:
        label = field(_TAG_LABEL_NAME, name.encode()) + field(_TAG_LABEL_VALUE, value.encode())
        parts.append(field(_TAG_TIMESERIES_LABELS, label))
    return b"".join(parts)


def metadata_entry(family: Family) -> bytes:
    """One ``WriteRequest.metadata`` entry, tag and length included."""
    # proto3 leaves default values off the wire; doing the same keeps the bytes canonical.
    body = b""
    mtype = METRIC_TYPES.get(family.type, 0)
    if mtype:
        body += _TAG_METADATA_TYPE + varint(mtype)
    if family.name:
        body += field(_TAG_METADATA_NAME, family.name.encode())
    if family.help:
        body += field(_TAG_METADATA_HELP, family.help.encode())
    if family.unit:
        body += field(_TAG_METADATA_UNIT, family.unit.encode())
    return field(TAG_WRITE_REQUEST_METADATA, body)


def encode_metadata(families: Iterable[Family]) -> bytes:
    """The repeated ``WriteRequest.metadata`` entries for metric families (sorted by name)."""
    return b"".join(metadata_entry(f) for f in sorted(families, key=lambda f: f.name))

"""Encoder for Remote-Write 2.0: one ``io.prometheus.write.v2.Request`` from a batch's blocks.

Blocks are always 1.0 bytes (what memory and disk queues hold, so a fallback to 1.0 never needs
the original samples). For a 2.0 endpoint the sender turns a batch's concatenated blocks into
one 2.0 request at send time: a symbol table for the whole request (each label string once,
``symbols[0]`` empty), each series' label references, its metadata (type, help, unit, from the
catalogue's families) and, for counters whose start is known, ``start_timestamp`` on every
sample. It writes the wire format directly, like the 1.0 encoder; what it learns of a series
(its label strings, its metadata) is cached by the series' 1.0 label bytes, so a window costs a
dictionary lookup per series plus the references. 1.0 sample messages are valid 2.0 ones
(``value = 1``, ``timestamp = 2``), so samples are copied, with the start timestamp appended.

Shards build their requests in executor threads at once: that is safe, since each request's
symbol table is its own and the cache only ever gains whole entries (or is cleared).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hfsampler.remote_write import wire
from hfsampler.remote_write.encoder import _SMALL_LIMIT as _SMALL
from hfsampler.remote_write.encoder import _SMALL_VARINTS, METRIC_TYPES, varint
from hfsampler.series import Family

# 2.0 tags: (field << 3) | wire type
_TAG_SYMBOLS = b"\x22"  # Request.symbols = 4
_TAG_TIMESERIES = b"\x2a"  # Request.timeseries = 5
_TAG_LABELS_REFS = b"\x0a"  # TimeSeries.labels_refs = 1 (packed)
_TAG_SAMPLE = b"\x12"  # TimeSeries.samples = 2
_TAG_METADATA = b"\x2a"  # TimeSeries.metadata = 5
_TAG_META_TYPE = b"\x08"  # Metadata.type = 1
_TAG_META_HELP = b"\x18"  # Metadata.help_ref = 3
_TAG_META_UNIT = b"\x20"  # Metadata.unit_ref = 4
_TAG_START_TS = b"\x18"  # Sample.start_timestamp = 3

CONTENT_TYPE = "application/x-protobuf;proto=io.prometheus.write.v2.Request"
VERSION = "2.0.0"
# A family hfsampler does not know (a relabelled name): the spec's "unspecified".
_UNKNOWN = Family("", "", "unknown")
# Cache entries kept at most: a series that ends is not told to this encoder, so churn is bounded
# by clearing, as for the 1.0 encoder's timestamp frames.
MAX_CACHED_SERIES = 1 << 17


@dataclass(frozen=True, slots=True)
class _Series:
    """What a series needs in every request: its strings, its metadata and its start."""

    strings: tuple[str, ...]  # name, value, name, value, ... in byte order of name
    meta_type: bytes  # the Metadata.type field, b"" when unknown
    help: str
    unit: str
    start_tail: bytes  # the Sample.start_timestamp field, b"" when unknown
    start_ms: int


class RequestEncoderV2:
    """Turns 1.0 ``WriteRequest`` bytes into 2.0 ``Request`` bytes.

    ``families`` gives the current metric families by name (the catalogue's, as the metric
    model registered them); ``start_ms`` the start of a counter family, 0 when unknown.
    """

    def __init__(
        self,
        families: Callable[[], Mapping[str, Family]],
        start_ms: Callable[[Family], int] = lambda family: 0,
    ) -> None:
        self._families = families
        self._start_ms = start_ms
        self._series: dict[bytes, _Series] = {}

    def encode(self, raw_v1: bytes) -> tuple[bytes, int]:
        """The 2.0 request for ``raw_v1`` and the number of samples in it.

        1.0 metadata entries are left out: 2.0 carries metadata on every series.
        """
        symbols: dict[str, int] = {"": 0}
        out: list[bytes] = []
        append = out.append
        samples_total = 0
        families = self._families()
        cache = self._series
        small = _SMALL_VARINTS
        for start, end in _series_spans(raw_v1):
            # A 1.0 TimeSeries as hfsampler writes it: its Label fields (tag 0x0a) first, then
            # its Sample fields (tag 0x12).
            pos = start
            while pos < end and raw_v1[pos] == 0x0A:
                length, pos = _varint_at(raw_v1, pos + 1)
                pos += length
            key = raw_v1[start:pos]
            info = cache.get(key)
            if info is None:
                info = self._learn(key, families)
            refs = []
            for text in info.strings:
                ref = symbols.get(text)
                if ref is None:
                    ref = symbols[text] = len(symbols)
                refs.append(small[ref] if ref < _SMALL else varint(ref))
            packed = b"".join(refs)
            body = [_TAG_LABELS_REFS, varint(len(packed)), packed]
            start_ts = info.start_tail
            n = 0
            while pos < end:
                length, pos = _varint_at(raw_v1, pos + 1)
                sample = raw_v1[pos : pos + length]
                # a sample before the start (spooled by an earlier process) gets none
                if start_ts and _sample_ts(sample) >= info.start_ms:
                    sample += start_ts
                pos += length
                body += (_TAG_SAMPLE, small[len(sample)], sample)
                n += 1
            samples_total += n
            meta = info.meta_type
            for tag, text in ((_TAG_META_HELP, info.help), (_TAG_META_UNIT, info.unit)):
                if text:
                    ref = symbols.get(text)
                    if ref is None:
                        ref = symbols[text] = len(symbols)
                    meta += tag + varint(ref)
            body += (_TAG_METADATA, small[len(meta)], meta)
            series = b"".join(body)
            append(_TAG_TIMESERIES + varint(len(series)) + series)
        head = [_TAG_SYMBOLS + varint(len(d)) + d for d in map(str.encode, symbols)]
        return b"".join(head) + b"".join(out), samples_total

    def _learn(self, label_bytes: bytes, families: Mapping[str, Family]) -> _Series:
        strings: list[str] = []
        name = ""
        for label in wire.fields(label_bytes):
            pair = label_bytes[label.payload : label.end]
            label_name = label_value = ""
            for part in wire.fields(pair):
                text = pair[part.payload : part.end].decode()
                if part.number == 1:
                    label_name = text
                elif part.number == 2:
                    label_value = text
            strings += (label_name, label_value)
            if label_name == "__name__":
                name = label_value
        family = families.get(name, _UNKNOWN)
        start = self._start_ms(family) if family.type == "counter" else 0
        metric_type = METRIC_TYPES.get(family.type, 0)
        info = _Series(
            tuple(strings),
            _TAG_META_TYPE + varint(metric_type) if metric_type else b"",
            family.help,
            family.unit,
            _TAG_START_TS + varint(start) if start else b"",
            start,
        )
        if family is _UNKNOWN:
            return info  # not cached: its family may be known by the next request
        if len(self._series) >= MAX_CACHED_SERIES:
            self._series.clear()
        self._series[label_bytes] = info
        return info


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    byte = data[pos]
    if byte < 0x80:  # lengths of labels and samples almost always fit one byte
        return byte, pos + 1
    value = byte & 0x7F
    shift = 7
    pos += 1
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def _sample_ts(sample: bytes) -> int:
    """A 1.0 Sample's timestamp (``value`` fixed64 at 0-8, then tag 0x10 and the varint)."""
    if len(sample) > 10 and sample[9] == 0x10:
        value, _ = _varint_at(sample, 10)
        return value - (1 << 64) if value >= 1 << 63 else value
    return 0


def _series_spans(raw: bytes) -> list[tuple[int, int]]:
    """Where each ``TimeSeries`` body of a 1.0 request lies; other fields are skipped."""
    return [(f.payload, f.end) for f in wire.fields(raw) if f.number == 1 and f.wire_type == 2]

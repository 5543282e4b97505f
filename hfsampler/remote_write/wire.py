"""Wire: a spooled request's bytes, sent as they were stored: a drain moves bytes, not samples.

A 1.0 endpoint's spool stores each record as the ``WriteRequest`` its block makes, already
snappy-compressed (``Wire.of``), as vmagent's persistent queue stores its blocks. A drain reads
them back and joins a batch of them into one request (``join``) without decoding a byte:

- protobuf: ``WriteRequest``'s fields are all repeated, and the concatenation of two encoded
  messages is the message with both lists concatenated. A series then comes once per record
  (window) in the request rather than once per request, its samples in timestamp order: as
  Prometheus itself sends (its queue manager writes one ``TimeSeries`` per sample), and what
  every receiver takes (the 1.0 spec allows several samples of a series in one request).
- snappy (the block format): a compressed block is a varint of the uncompressed length, then
  literals and back references whose offsets count from the output written so far, never past
  the block's own start. Blocks' element streams back to back, behind the varint of their total
  length, are the compressed form of their contents back to back: compressed once, at spooling.

What needs samples, not bytes (a 413 that cuts a request at series, a 2.0 request made from 1.0
records spooled before the endpoint was switched to 2.0) decodes the bytes back into a ``Block``
(``to_block``, with the generated protobuf module): rare paths, off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import snappy

from hfsampler.remote_write.blocks import Block, Labels, metadata_only
from hfsampler.remote_write.encoder import RequestEncoderV1, compress
from hfsampler.remote_write.prompb import remote_pb2
from hfsampler.remote_write.protowrite import METRIC_TYPES, varint
from hfsampler.series import Family

_TYPE_NAMES = {number: name for name, number in METRIC_TYPES.items()}


@dataclass(frozen=True, slots=True)
class Wire:
    """A 1.0 ``WriteRequest``, snappy-compressed (block format, its length varint first).

    ``body`` is a view into the bytes a spool read back (or wrote) where it comes from one:
    copied once, by ``join``, into the request's body."""

    body: bytes | memoryview
    raw_len: int  # its uncompressed bytes: what max_request_bytes and a 413 measure
    samples: int

    @classmethod
    def of(cls, block: Block, encoder: RequestEncoderV1) -> Wire:
        raw = encoder.encode(block)
        return cls(compress(raw), len(raw), block.samples)


def preamble(body: bytes | memoryview) -> tuple[int, int] | None:
    """The uncompressed length a snappy block says it holds, and the varint's bytes; None
    where the varint is cut short or longer than 32 bits allow."""
    value = shift = 0
    for i, byte in enumerate(body[:5]):
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return None


def join(wires: Sequence[Wire]) -> Wire:
    """One request of several, in order: their snappy element streams back to back behind the
    varint of the total length (see the module's docstring); its body is ``bytes``."""
    if len(wires) == 1:
        only = wires[0]
        return (
            only
            if isinstance(only.body, bytes)
            else Wire(bytes(only.body), only.raw_len, only.samples)
        )
    parts = []
    raw = samples = 0
    for w in wires:
        head = preamble(w.body)
        if head is None or head[0] != w.raw_len:
            raise ValueError("a snappy block whose length varint is not its raw length")
        parts.append(memoryview(w.body)[head[1] :])
        raw += w.raw_len
        samples += w.samples
    return Wire(varint(raw) + b"".join(parts), raw, samples)


def to_block(wire: Wire) -> Block:
    """The request's samples as a block again (each series once, its samples in order); its
    metadata entries as families. ``ValueError`` for bytes that are not such a request."""
    try:
        request = remote_pb2.WriteRequest.FromString(snappy.uncompress(wire.body))
    except Exception as exc:  # the protobuf runtime's DecodeError, snappy's error
        raise ValueError(f"not a compressed 1.0 WriteRequest: {exc}") from exc
    families = [
        Family(m.metric_family_name, m.help, _TYPE_NAMES.get(m.type, "unknown"), m.unit)
        for m in request.metadata
    ]
    labels: dict[tuple[tuple[str, str], ...], Labels] = {}
    series: list[Labels] = []
    stamps: list[int] = []
    values: list[float] = []
    for ts in request.timeseries:
        key = tuple((label.name, label.value) for label in ts.labels)
        found = labels.get(key)
        if found is None:
            found = labels[key] = Labels.of(key)
        for sample in ts.samples:
            series.append(found)
            stamps.append(sample.timestamp)
            values.append(sample.value)
    if not series:
        return metadata_only(families)
    block = Block.of(series, stamps, values)
    # Block.of sorts families by name; the request's own order is kept instead
    return Block(block.series, block.ends, block.timestamps_ms, block.values, tuple(families))

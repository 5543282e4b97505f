"""Blocks: queued samples in one neutral form that Remote-Write 1.0 and 2.0 both serialize from.

A ``Block`` holds, per series, a reference to its ``Labels`` (encoded once per series and kept
by the encoder), and the samples as arrays (timestamps in ms, values bit for bit) grouped by
series in first-seen order, plus the metric families whose 1.0 metadata goes with it. A native
histogram series (issue 26) has its samples in the same arrays (its value is the histogram's count,
never sent) and each one's ``Histogram`` message body in ``hist`` (``histwrite.histogram_body``:
encoded once, when the window is cut, since a window's histogram never changes); a series carries
floats or histograms, never both. Memory and disk queues hold blocks. A shard's batch becomes
one block per request: ``merge`` puts each series once, its samples in the order they came;
``split`` cuts a request to a size and ``halve`` cuts one in two after a 413, both at series
boundaries and by the size its 1.0 encoding has (computed, not encoded). Only then is a request
serialized (``encoder`` for 1.0, ``encoder_v2`` for 2.0) and compressed, once.
No protobuf is ever read back.

``pack`` and ``unpack`` are a block's bytes on disk (a spool record's payload, before snappy):

    u32 series | u32 samples | u32 families | i64 timestamps[samples] | f64 values[samples] |
    u32 ends[series] | per series: u32 length | its strings | per family: u32 length | its
    strings (name, help, type, unit), where strings are u32 count | (u32 length | UTF-8)...

All integers little-endian; ``ends[i]`` is one past series ``i``'s last sample. A block with
histograms has after its families: u32 samples | u32 lengths[samples] | the bodies (a float
sample's is empty); a record without them is byte for byte what the format was before histograms.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from hfsampler.remote_write.histwrite import entry_size, entry_sizes
from hfsampler.remote_write.protowrite import encode_labels, metadata_entry, varint_len
from hfsampler.series import Family

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<III")
_SAMPLE_FIXED = 12  # a 1.0 Sample's bytes besides its timestamp's varint (tag, length, value)
_EMPTY_I64: npt.NDArray[np.int64] = np.empty(0, np.int64)
_EMPTY_F64: npt.NDArray[np.float64] = np.empty(0, np.float64)
Bodies = npt.NDArray[np.object_]  # per sample: a histogram's message body, b"" for a float
# Labels kept by a reader of packed blocks; past this many the cache starts over.
MAX_CACHED_LABELS = 1 << 17
MAX_CACHED_SERIES_SETS = 32  # the series of a request: a few per shard
_FEW_SAMPLES = 32  # a block with histograms this small is sized without numpy


def _pack_strings(strings: Iterable[str]) -> bytes:
    parts = [s.encode() for s in strings]
    return _U32.pack(len(parts)) + b"".join(_U32.pack(len(p)) + p for p in parts)


def _unpack_strings(data: bytes) -> list[str]:
    (count,) = _U32.unpack_from(data, 0)
    pos = 4
    out = []
    for _ in range(count):
        (length,) = _U32.unpack_from(data, pos)
        pos += 4
        out.append(data[pos : pos + length].decode())
        pos += length
    if pos != len(data):
        raise ValueError("labels with trailing bytes")
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Labels:
    """A series' labels, encoded once: what each protocol and the spool need of them.

    Compared by identity: the encoder keeps one per series, a spool reader one per label set.
    """

    v1: bytes  # the 1.0 TimeSeries.labels entries
    strings: tuple[str, ...]  # name, value, name, value, ... in byte order of name
    name: str  # the value of __name__: the metric family
    packed: bytes  # the strings as a spool stores them

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> Labels:
        """From ``(name, value)`` pairs in the order to send them (``Series.all_labels()``)."""
        pairs = tuple(pairs)
        strings = tuple(s for pair in pairs for s in pair)
        name = next((v for n, v in pairs if n == "__name__"), "")
        return cls(encode_labels(pairs), strings, name, _pack_strings(strings))


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """Samples of some series, grouped by series; the families whose metadata goes with them.

    Series ``i``'s samples are ``[ends[i - 1], ends[i])`` of ``timestamps_ms`` and ``values``,
    in the order they were queued; each series appears once. ``hist``: per sample, its
    ``Histogram`` body (b"" for a float sample); None when no sample is a histogram."""

    series: tuple[Labels, ...]
    ends: npt.NDArray[np.int64]
    timestamps_ms: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]
    families: tuple[Family, ...] = ()
    hist: Bodies | None = None

    @property
    def samples(self) -> int:
        return len(self.values)

    @property
    def histogram_samples(self) -> int:
        """How many of the samples are histograms."""
        return 0 if self.hist is None else int(np.count_nonzero(self.hist != b""))

    @classmethod
    def of(
        cls,
        series: Sequence[Labels],
        timestamps_ms: int | npt.ArrayLike,
        values: npt.ArrayLike,
        families: Iterable[Family] = (),
        *,
        distinct: bool = False,
        hist: Sequence[bytes] | None = None,
    ) -> Block:
        """A block of samples given one per entry of ``series`` (a series may come again: its
        samples are grouped, in the order given; ``distinct``: the caller knows none does);
        one timestamp for all, or one each. ``hist``: per sample, its histogram body (b"" for a
        float sample), when any is a histogram."""
        if isinstance(values, list):  # intake's: fromiter skips asarray's type discovery
            vals = np.fromiter(values, np.float64, len(values))
        else:
            vals = np.asarray(values, dtype=np.float64)
        n = len(vals)
        if isinstance(timestamps_ms, int):
            ts = np.full(n, timestamps_ms, dtype=np.int64)
        else:
            ts = np.asarray(timestamps_ms, dtype=np.int64)
        fams = tuple(sorted(families, key=lambda f: f.name))
        bodies = None if hist is None else _bodies(hist)
        # Labels hash by identity (eq=False): a set of them, not of their id()s, which are
        # fresh ints to make and hash, five times the cost
        if distinct or len(set(series)) == n:  # the usual case: a window
            ends = np.arange(1, n + 1, dtype=np.int64)
            return cls(tuple(series), ends, ts, vals, fams, bodies)
        position: dict[int, int] = {}
        order: list[Labels] = []
        for s in series:
            if id(s) not in position:
                position[id(s)] = len(order)
                order.append(s)
        owner = np.fromiter((position[id(s)] for s in series), np.int64, n)
        return _grouped(order, owner, ts, vals, fams, bodies)

    def counts(self) -> npt.NDArray[np.int64]:
        """Samples per series."""
        return np.diff(self.ends, prepend=0)

    def take(self, a: int, b: int, families: tuple[Family, ...] = ()) -> Block:
        """Series ``a`` to ``b`` (exclusive) with their samples, and ``families``."""
        lo = int(self.ends[a - 1]) if a > 0 else 0
        hi = int(self.ends[b - 1]) if b > a else lo
        return Block(
            self.series[a:b],
            self.ends[a:b] - lo,
            self.timestamps_ms[lo:hi],
            self.values[lo:hi],
            families,
            None if self.hist is None else self.hist[lo:hi],
        )

    def floats_then_histograms(self) -> tuple[Block, Block] | None:
        """The block as its float series (a block without histograms) and its histogram series,
        when those come after all the floats (as intake queues them, and merged windows keep
        them): the encoders write the floats from their templates. None otherwise."""
        if self.hist is None:
            return None
        # the histogram series at the end, walked back from it; they are all there when they
        # hold every non-empty body (a count in C, not a comparison per sample in Python)
        ends = self.ends
        n = k = len(ends)
        while k and self.hist[int(ends[k - 1]) - 1]:
            k -= 1
        tail = int(ends[-1]) - (int(ends[k - 1]) if k else 0)
        if k == n or np.count_nonzero(self.hist) != tail:
            return None
        return replace(self.take(0, k), hist=None), self.take(k, n)

    def without_histograms(self) -> Block:
        """The block with its histogram series left out (and its families kept)."""
        if self.hist is None:
            return self
        keep = [i for i, end in enumerate(self.ends.tolist()) if self.hist[end - 1] == b""]
        if not keep:
            return metadata_only(self.families)
        counts = self.counts()[keep]
        starts = self.ends[keep] - counts
        take = np.concatenate([np.arange(a, a + c) for a, c in zip(starts, counts, strict=True)])
        return Block(
            tuple(self.series[i] for i in keep),
            np.cumsum(counts),
            self.timestamps_ms[take],
            self.values[take],
            self.families,
        )


def metadata_only(families: Iterable[Family]) -> Block:
    """A block of metadata and no samples."""
    return Block((), _EMPTY_I64, _EMPTY_I64, _EMPTY_F64, tuple(families))


def _bodies(hist: Sequence[bytes]) -> Bodies:
    """Histogram bodies as an array (of objects: ``np.array`` would make fixed-width bytes)."""
    out = np.empty(len(hist), dtype=object)
    out[:] = hist
    return out


def _grouped(
    order: list[Labels],
    owner: npt.NDArray[np.int64],
    ts: npt.NDArray[np.int64],
    vals: npt.NDArray[np.float64],
    families: tuple[Family, ...],
    hist: Bodies | None = None,
) -> Block:
    if len(owner) > 1 and bool((owner[1:] < owner[:-1]).any()):
        perm = np.argsort(owner, kind="stable")  # a series' samples keep the order they came in
        ts, vals = ts[perm], vals[perm]
        if hist is not None:
            hist = hist[perm]
    ends = np.cumsum(np.bincount(owner, minlength=len(order))).astype(np.int64)
    return Block(tuple(order), ends, ts, vals, families, hist)


def _all_bodies(blocks: Sequence[Block]) -> list[Bodies] | None:
    """Each block's bodies (empty ones for a block of floats), or None when none has any."""
    if all(b.hist is None for b in blocks):
        return None
    return [_bodies([b""] * b.samples) if b.hist is None else b.hist for b in blocks]


def merge(blocks: Sequence[Block]) -> Block:
    """One block of several: each series once (the same labels are the same series), its
    samples in the order of the blocks; the families of every block, in order."""
    if len(blocks) == 1:
        return blocks[0]
    first = blocks[0]
    n = len(first.series)
    bodies = _all_bodies(blocks)
    if n and all(b.samples == n and b.series == first.series for b in blocks):
        # windows of the same series (a backlog read back): series i's samples are row i
        return Block(
            first.series,
            np.arange(1, n + 1, dtype=np.int64) * len(blocks),
            np.stack([b.timestamps_ms for b in blocks], axis=1).ravel(),
            np.stack([b.values for b in blocks], axis=1).ravel(),
            tuple(f for block in blocks for f in block.families),
            None if bodies is None else np.stack(bodies, axis=1).ravel(),
        )
    position: dict[bytes, int] = {}
    order: list[Labels] = []
    owners = []
    for block in blocks:
        index = []
        for labels in block.series:
            at = position.get(labels.v1)
            if at is None:
                at = position[labels.v1] = len(order)
                order.append(labels)
            index.append(at)
        owners.append(np.repeat(np.array(index, np.int64), block.counts()))
    families = tuple(f for block in blocks for f in block.families)
    if not order:
        return metadata_only(families)
    return _grouped(
        order,
        np.concatenate(owners),
        np.concatenate([b.timestamps_ms for b in blocks]),
        np.concatenate([b.values for b in blocks]),
        families,
        None if bodies is None else np.concatenate(bodies),
    )


def label_lengths(series: tuple[Labels, ...]) -> npt.NDArray[np.int64]:
    """The bytes of each series' 1.0 labels."""
    return np.fromiter((len(s.v1) for s in series), np.int64, len(series))


def piece_sizes(block: Block, labels: npt.NDArray[np.int64] | None = None) -> list[int]:
    """The bytes of each top-level entry of the block's 1.0 ``WriteRequest``: a ``TimeSeries``
    per series, then a metadata entry per family (what ``encoder.write_request`` writes).
    ``labels``: ``label_lengths(block.series)``, when known."""
    sizes: list[int] = []
    if block.series:
        ts = block.timestamps_ms
        labels = label_lengths(block.series) if labels is None else labels
        if block.hist is not None and block.samples <= _FEW_SAMPLES:
            sizes = _few_sizes(block, labels.tolist())
        elif block.hist is not None:
            upto = np.cumsum(entry_sizes(ts, block.hist))[block.ends - 1]
            body = np.diff(upto, prepend=0) + labels
        elif block.samples == len(block.series) and ts[0] == ts[-1] and bool((ts == ts[0]).all()):
            # a window: one sample per series, one timestamp
            body = labels + (_SAMPLE_FIXED + varint_len(int(ts[0]) % (1 << 64)))
        else:
            u = ts.view(np.uint64)
            vlen = np.ones(len(u), dtype=np.int64)
            for k in range(1, 10):
                vlen += u >= np.uint64(1 << (7 * k))
            upto = np.cumsum(vlen + _SAMPLE_FIXED)[block.ends - 1]
            body = np.diff(upto, prepend=0) + labels
        if not sizes:
            head = np.ones(len(body), dtype=np.int64)
            for k in range(1, 5):
                head += body >= (1 << (7 * k))
            sizes = (1 + head + body).tolist()
    return sizes + [len(metadata_entry(f)) for f in block.families]


def _few_sizes(block: Block, labels: list[int]) -> list[int]:
    """``piece_sizes``' series for a block of few samples with histograms (a window's histogram
    series, which the ``Sizer`` adds to its floats' kept sizes): numpy's cost per call would be
    most of it."""
    assert block.hist is not None
    stamps = block.timestamps_ms.tolist()
    out = []
    lo = 0
    for length, hi in zip(labels, block.ends.tolist(), strict=True):
        body = length + sum(entry_size(block.hist[k], stamps[k]) for k in range(lo, hi))
        out.append(1 + varint_len(body) + body)
        lo = hi
    return out


class Sizer:
    """``piece_sizes`` with each series set's label lengths kept: a window's requests have the
    series of the last one's, in the same order. A window's sizes (one sample per series, one
    timestamp, no families) depend only on those lengths and the timestamp's varint width: they
    are kept too, and the same list is returned for the next window (read it, never change it).
    Safe from several threads: the caches only ever gain or replace whole entries (or are
    cleared)."""

    def __init__(self) -> None:
        self._lengths: dict[tuple[Labels, ...], npt.NDArray[np.int64]] = {}
        # per series set: (the timestamp's varint width, the sizes) of its last window
        self._windows: dict[tuple[Labels, ...], tuple[int, list[int]]] = {}

    def __call__(self, block: Block) -> list[int]:
        if block.hist is not None and not block.families:
            split = block.floats_then_histograms()  # the floats' sizes as a window's, kept
            if split is not None and split[0].series:
                return self(split[0]) + piece_sizes(split[1])
        series = block.series
        ts = block.timestamps_ms
        width = 0
        if series and not block.families and block.samples == len(series) and block.hist is None:
            first = int(ts[0])
            if first == ts[-1] and bool((ts == first).all()):
                width = varint_len(first % (1 << 64))
                last = self._windows.get(series)
                if last is not None and last[0] == width:
                    return last[1]
        lengths = self._lengths.get(series)
        if lengths is None:
            lengths = label_lengths(series)
            if len(self._lengths) >= MAX_CACHED_SERIES_SETS:
                self._lengths.clear()
                self._windows.clear()
            self._lengths[series] = lengths
        sizes = piece_sizes(block, lengths)
        if width:
            self._windows[series] = (width, sizes)
        return sizes


def _cut(block: Block, start: int, stop: int) -> Block:
    """Entries ``[start, stop)`` of the block (series first, then families) as a block."""
    n = len(block.series)
    fams = block.families[max(start - n, 0) : max(stop - n, 0)]
    return block.take(min(start, n), min(stop, n), fams)


def split(block: Block, max_bytes: int, sizes: list[int] | None = None) -> list[Block]:
    """Blocks whose 1.0 requests take at most ``max_bytes`` each (a single larger entry stays one
    block), cut at entry boundaries, in order."""
    sizes = piece_sizes(block) if sizes is None else sizes
    if sum(sizes) <= max_bytes:
        return [block]
    out: list[Block] = []
    start = size = 0
    for i, piece in enumerate(sizes):
        if i > start and size + piece > max_bytes:
            out.append(_cut(block, start, i))
            start, size = i, 0
        size += piece
    out.append(_cut(block, start, len(sizes)))
    return out


def halve(block: Block) -> tuple[Block, Block] | None:
    """The block cut in two at the entry boundary nearest the middle of its 1.0 bytes; None for
    a single entry."""
    sizes = piece_sizes(block)
    if len(sizes) < 2:
        return None
    total = sum(sizes)
    ends = np.cumsum(sizes[:-1])
    cut = int(np.argmin(np.abs(2 * ends - total))) + 1
    return _cut(block, 0, cut), _cut(block, cut, len(sizes))


# -- a block's bytes on disk ---------------------------------------------------------------------


def pack(block: Block) -> bytes:
    """The block as a spool record stores it (before compression)."""
    parts = [
        _HEAD.pack(len(block.series), block.samples, len(block.families)),
        block.timestamps_ms.astype("<i8", copy=False).tobytes(),
        block.values.astype("<f8", copy=False).tobytes(),
        block.ends.astype("<u4").tobytes(),
    ]
    for labels in block.series:
        parts += (_U32.pack(len(labels.packed)), labels.packed)
    for f in block.families:
        strings = _pack_strings((f.name, f.help, f.type, f.unit))
        parts += (_U32.pack(len(strings)), strings)
    if block.hist is not None:
        lengths = np.fromiter(map(len, block.hist), np.int64, block.samples)
        parts += (_U32.pack(block.samples), lengths.astype("<u4").tobytes(), *block.hist)
    return b"".join(parts)


class Unpacker:
    """Reads packed blocks back, one ``Labels`` per label set however many records hold it (so
    that a backlog's batches find their series by identity, as the encoder's blocks do)."""

    def __init__(self) -> None:
        self._labels: dict[bytes, Labels] = {}
        # The last record's series, as stored and as read: a backlog's windows have the same
        # series in the same order, and a byte comparison finds them without a look-up each.
        self._last_stored = b""
        self._last_series: tuple[Labels, ...] = ()

    def remember(self, block: Block, data: bytes) -> None:
        """``data`` is ``pack(block)``: the records to read next will likely have its series, so
        a drain in the process that spooled them reads them with the writer's ``Labels`` and
        makes none again. Costs a comparison per block once its series are known."""
        n = len(block.series)
        if not n or block.series == self._last_series:
            return
        start = _HEAD.size + 16 * block.samples + 4 * n
        end = start + sum(4 + len(s.packed) for s in block.series)
        self._last_stored, self._last_series = data[start:end], block.series

    def unpack(self, data: bytes) -> Block:
        """The block ``pack`` wrote; ``ValueError`` for bytes it did not write."""
        try:
            return self._unpack(data)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"not a packed block: {exc}") from exc

    def _unpack(self, data: bytes) -> Block:
        n_series, n_samples, n_families = _HEAD.unpack_from(data, 0)
        pos = _HEAD.size
        ts = np.frombuffer(data, "<i8", n_samples, pos).astype(np.int64)
        pos += 8 * n_samples
        values = np.frombuffer(data, "<f8", n_samples, pos).astype(np.float64)
        pos += 8 * n_samples
        ends = np.frombuffer(data, "<u4", n_series, pos).astype(np.int64)
        pos += 4 * n_series
        if n_series and (ends[-1] != n_samples or bool((np.diff(ends, prepend=0) < 1).any())):
            raise ValueError("series ends out of order")
        last = self._last_stored
        if n_series and n_series == len(self._last_series) and data.startswith(last, pos):
            pos += len(last)
            families, hist = self._families(data, pos, n_families, n_samples)
            return Block(self._last_series, ends, ts, values, families, hist)
        start = pos
        cache = self._labels
        if len(cache) > MAX_CACHED_LABELS:
            cache.clear()
        series = []
        for _ in range(n_series):
            (length,) = _U32.unpack_from(data, pos)
            packed = data[pos + 4 : pos + 4 + length]
            pos += 4 + length
            labels = cache.get(packed)
            if labels is None:
                strings = _unpack_strings(packed)
                pairs = list(zip(strings[::2], strings[1::2], strict=True))
                labels = cache[packed] = Labels.of(pairs)
            series.append(labels)
        found = tuple(series)
        if n_series:
            self._last_stored, self._last_series = data[start:pos], found
        families, hist = self._families(data, pos, n_families, n_samples)
        return Block(found, ends, ts, values, families, hist)

    @staticmethod
    def _families(
        data: bytes, pos: int, n_families: int, n_samples: int
    ) -> tuple[tuple[Family, ...], Bodies | None]:
        """The ``n_families`` families from ``pos``, and the histogram bodies after them, if
        any: the rest of ``data``."""
        families = []
        for _ in range(n_families):
            (length,) = _U32.unpack_from(data, pos)
            name, help_, type_, unit = _unpack_strings(data[pos + 4 : pos + 4 + length])
            families.append(Family(name, help_, type_, unit))
            pos += 4 + length
        hist = None
        if pos != len(data):
            count = _U32.unpack_from(data, pos)[0] if len(data) - pos >= 4 else -1
            if count != n_samples:
                raise ValueError("trailing bytes")
            pos += 4
            lengths = np.frombuffer(data, "<u4", count, pos).tolist()
            pos += 4 * count
            bodies = []
            for length in lengths:
                bodies.append(data[pos : pos + length])
                pos += length
            if pos != len(data):
                raise ValueError("trailing bytes")
            hist = _bodies(bodies)
        return tuple(families), hist

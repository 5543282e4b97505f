"""Segment: the spool's files: how records are framed and found again, the ack file, and the
I/O thread's side of a spool (``SpoolFiles``: lock, recover, append, read back, delete).

One directory per shard::

    .lock                        flock'ed by the process that owns the directory (``dirlock``)
    <first seq, 20 digits>.seg   MAGIC (8 bytes), then records:
        RECORD_MAGIC (4) | u32 CRC32 of the next 20 bytes | u32 payload length |
        u32 sample count | u64 seq | u32 CRC32 of the payload | payload, one of:
          0x01 | u32 raw length | the block's 1.0 ``WriteRequest``, snappy-compressed
               (``wire.Wire``: a 1.0 endpoint's records, sent as they are)
          0x00 | a packed ``Block`` (``blocks.pack``), snappy-compressed (a 2.0 endpoint's)
    acked                        two slots of 16 bytes: ACK_MAGIC (4) | u64 seq | u32 CRC32 of
                                 the 12 bytes before it; every record below the higher valid
                                 seq was delivered (or dropped)

All integers little-endian. Seqs increase within a segment and from one segment to the next;
they may skip (a record delivered or dropped before it was written is never written).

Damage costs the damaged record only. Its header has a CRC of its own, so a record whose
payload is damaged is skipped by its length, its samples known and counted; where a header is
damaged the reader searches for the next ``RECORD_MAGIC`` whose header CRC holds, and the
samples of what lay between are unknown. A damaged segment header is searched the same way.
Segments of the layout before this one (``HFSPOOL4``, written until 1.0 records were kept as
they are sent) are read as they are: their payloads are packed blocks without the kind byte
(whose first byte, snappy's length varint of at least 12 bytes, is never 0 or 1); new records go
to new segments. A segment of any other format (``HFSPOOL`` and another version) is refused at
start, with one line naming the file and the version found.
Recovered segments are never appended to.

The ack file is overwritten in place, never renamed: a full disk refuses new blocks, not the
overwrite of one it gave before, so acknowledgements are kept however full the disk is. Two
slots, written in turn, so that a torn write leaves the previous value: at most the batches
acknowledged since that write are sent again. Not fsynced: after a power loss as well, some
delivered batches may be sent again (delivery is at least once). A damaged ack file means
that every record still on disk is sent again, never that any is deleted.

An append that fails (a full disk) is undone, the file cut back to where it was or deleted if it
was new, so that the disk gets back every block the failed write took.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import struct
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import snappy

from hfsampler.errors import SpoolFormatError
from hfsampler.remote_write.blocks import Block, Unpacker, pack
from hfsampler.remote_write.dirlock import DirLock
from hfsampler.remote_write.encoder import RequestEncoderV1, compress
from hfsampler.remote_write.wire import Wire, preamble

log = logging.getLogger("hfsampler.remote_write.spool")

MAGIC = b"HFSPOOL5"
LEGACY_MAGIC = b"HFSPOOL4"  # its records' payloads are packed blocks, no kind byte
_MAGIC_STEM = MAGIC[:-1]  # what every version's segment header starts with
RECORD_MAGIC = b"\xf3HR3"
ACK_MAGIC = b"HFA3"
ACK_NAME = "acked"
MAX_RECORD_BYTES = 64 << 20  # a length above this is damage, not a record

_HEAD = struct.Struct("<4sIIIQI")  # magic, header crc, length, count, seq, payload crc
_HEAD_TAIL = struct.Struct("<IIQI")  # what the header CRC covers: the header from byte 8 on
_HEAD_CRC_FROM = _HEAD.size - _HEAD_TAIL.size
_U32 = struct.Struct("<I")
_SEQ = struct.Struct("<Q")
_ACK = struct.Struct("<4sQI")
KIND_BLOCK = 0
KIND_WIRE = 1
_WIRE_HEAD = struct.Struct("<BI")  # kind, raw length
T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Segment:
    """One segment file as indexed in memory: its intact records, where each one starts."""

    first_seq: int
    path: Path
    size: int
    sealed: bool = False  # recovered at start: never appended to
    rel: array[int] = field(default_factory=lambda: array("I"))  # seq - first_seq
    counts: array[int] = field(default_factory=lambda: array("I"))
    offsets: array[int] = field(default_factory=lambda: array("Q"))

    def __len__(self) -> int:
        return len(self.rel)

    @property
    def end_seq(self) -> int:
        """One past the last record's seq."""
        return self.first_seq + self.rel[-1] + 1 if self.rel else self.first_seq

    def add(self, seq: int, count: int, offset: int) -> None:
        self.rel.append(seq - self.first_seq)
        self.counts.append(count)
        self.offsets.append(offset)

    def index(self, seq: int) -> int:
        """Position of the first record with a seq of at least ``seq``."""
        return bisect.bisect_left(self.rel, max(0, seq - self.first_seq))

    def samples_from(self, seq: int) -> int:
        """Samples in records with seq >= ``seq``."""
        return sum(self.counts[self.index(seq) :])


def frame(seq: int, count: int, payload: bytes) -> bytes:
    """A record's bytes on disk (``payload`` already compressed)."""
    tail = _HEAD_TAIL.pack(len(payload), count, seq, zlib.crc32(payload))
    return RECORD_MAGIC + _U32.pack(zlib.crc32(tail)) + tail + payload


# -- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Damage:
    """Bytes ``[start, end)`` that hold no intact record; seq and count when its header held."""

    start: int
    end: int
    seq: int | None = None
    count: int | None = None


@dataclass(slots=True)
class Scan:
    """What a segment file holds: intact records (seq, count, offset), damage."""

    records: list[tuple[int, int, int]]
    damage: list[Damage]
    header_damaged: bool = False


def scan(data: bytes, path: Path) -> Scan:
    """Every intact record of a segment file, and every stretch of damage between them.

    ``SpoolFormatError`` for a segment of another version."""
    head = data[: len(MAGIC)]
    if head in (MAGIC, LEGACY_MAGIC):
        return Scan(*_scan_v3(data, len(MAGIC)))
    if head.startswith(_MAGIC_STEM) and head[len(_MAGIC_STEM) :].isdigit():
        found = head.decode("ascii")
        raise SpoolFormatError(str(path), found, MAGIC.decode("ascii"))
    # A damaged segment header: its records are searched for.
    records, damage = _scan_v3(data, 0)
    if records:
        return Scan(records, damage, header_damaged=True)
    return Scan([], [Damage(0, len(data))] if data else [], header_damaged=True)


def _head_v3(data: bytes, pos: int) -> tuple[int, int, int, int] | None:
    """(length, count, seq, payload crc) of an intact v3 record header at ``pos``."""
    if pos + _HEAD.size > len(data) or not data.startswith(RECORD_MAGIC, pos):
        return None
    _, crc, length, count, seq, payload_crc = _HEAD.unpack_from(data, pos)
    if (
        length > MAX_RECORD_BYTES
        or zlib.crc32(data[pos + _HEAD_CRC_FROM : pos + _HEAD.size]) != crc
    ):
        return None
    return length, count, seq, payload_crc


def _next_v3(data: bytes, pos: int) -> int:
    """Offset of the next intact v3 record header from ``pos``; the end of data if none."""
    at = data.find(RECORD_MAGIC, pos)
    while at >= 0 and _head_v3(data, at) is None:
        at = data.find(RECORD_MAGIC, at + 1)
    return at if at >= 0 else len(data)


def _scan_v3(data: bytes, pos: int) -> tuple[list[tuple[int, int, int]], list[Damage]]:
    view = memoryview(data)
    records: list[tuple[int, int, int]] = []
    damage: list[Damage] = []
    while pos < len(data):
        head = _head_v3(data, pos)
        if head is None:
            nxt = _next_v3(data, pos + 1)
            damage.append(Damage(pos, nxt))
            pos = nxt
            continue
        length, count, seq, payload_crc = head
        end = pos + _HEAD.size + length
        if end <= len(data) and zlib.crc32(view[pos + _HEAD.size : end]) == payload_crc:
            records.append((seq, count, pos))
            pos = end
            continue
        # The header held, the payload did not (or was cut short): skip it, its count is known.
        end = min(end, _next_v3(data, pos + 1))
        damage.append(Damage(pos, end, seq, count))
        pos = end
    return records, damage


def payload_at(buf: bytes, pos: int, seq: int) -> memoryview | None:
    """The payload of record ``seq`` at ``pos`` in ``buf`` if it is intact there (a view of
    ``buf``: a drain copies a stored request once, into the request it joins)."""
    head = _head_v3(buf, pos)
    if head is None or head[2] != seq:
        return None
    end = pos + _HEAD.size + head[0]
    payload = memoryview(buf)[pos + _HEAD.size : end]
    return payload if len(payload) == head[0] and zlib.crc32(payload) == head[3] else None


# -- the ack file ----------------------------------------------------------------------------


def _ack_slot(acked: int) -> bytes:
    body = ACK_MAGIC + _SEQ.pack(acked)
    return body + struct.pack("<I", zlib.crc32(body))


def _ack_values(raw: bytes) -> list[int | None]:
    """Each slot's value, None where it is damaged."""
    out: list[int | None] = []
    for pos in range(0, len(raw) - _ACK.size + 1, _ACK.size):
        magic, value, crc = _ACK.unpack_from(raw, pos)
        ok = magic == ACK_MAGIC and zlib.crc32(raw[pos : pos + 12]) == crc and value < 1 << 63
        out.append(value if ok else None)
    return out


class AckFile:
    """The acknowledged seq, overwritten in place in one of two slots (on the I/O thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._slot = 0

    def open(self, acked: int, keep: bool) -> None:
        """Use the file as it is (``keep``, when it was read intact), else write a new one."""
        if keep:
            first, second = (-1 if v is None else v for v in _ack_values(self.path.read_bytes()))
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            self._slot = 1 if first >= second else 0  # not the slot that holds the value in force
            return
        tmp = self.path.with_name(ACK_NAME + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_ack_slot(acked) * 2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self._slot = 0

    def write(self, acked: int) -> None:
        if self._fd is None:  # not there yet (the disk was full at start): make it now
            self.open(acked, keep=False)
            return
        os.pwrite(self._fd, _ack_slot(acked), self._slot * _ACK.size)
        self._slot ^= 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def parse_ack(raw: bytes | None, directory: Path) -> tuple[int, bool]:
    """The acknowledged seq from the ack file's bytes, and whether to keep the file as it is.

    No file: 0. A damaged one: 0, every record on disk is sent again."""
    if raw is None:
        return 0, False
    values = [v for v in _ack_values(raw) if v is not None]
    if values:
        return max(values), len(raw) == 2 * _ACK.size
    log.warning(
        "spool %s: the ack file is damaged; sending every record still on disk (some of them "
        "were delivered before and come again)",
        directory,
    )
    return 0, False


# -- the I/O thread's side -----------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Append(Generic[T]):
    """Records to append to one segment file at ``start`` (0: a new file); ``entries`` are the
    queue's own for each record."""

    path: Path
    first_seq: int
    start: int
    segment: Segment | None  # None: a new file
    end: int = 0
    entries: list[T] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)

    def add(self, entry: T, data: bytes) -> None:
        self.entries.append(entry)
        self.offsets.append(self.end)
        self.chunks.append(data)
        self.end += len(data)


class SpoolFiles:
    """The file side of one spool; every method runs on the spool's single I/O thread."""

    def __init__(self, directory: Path, wire: bool = False) -> None:
        """``wire``: records keep their 1.0 requests (a 1.0 endpoint's), else packed blocks."""
        self.dir = directory
        self._lock: DirLock | None = None
        self._ack = AckFile(directory / ACK_NAME)
        self._unpacker = Unpacker()
        self._wire = RequestEncoderV1() if wire else None

    def open(self) -> Recovered:
        """Lock the directory, then recover it; the ack file is made ready if space allows."""
        self._lock = DirLock.acquire(self.dir)
        try:
            found = recover(self.dir)
        except BaseException:
            self.close()
            raise
        try:
            self._ack.open(found.acked, keep=found.keep_ack)
        except OSError as exc:  # made at the first acknowledgement instead
            log.warning("spool %s: cannot open the ack file yet: %s", self.dir, exc)
        return found

    def close(self) -> None:
        self._ack.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def commit(
        self, appends: list[Append[Any]], unlink: list[Path], acked: int | None
    ) -> tuple[int, OSError | None, OSError | None]:
        """The acknowledgement, then deletions (they free space), then appends in order.

        Returns how many appends were done, and the errors of the ack and of the appends."""
        ack_error = None
        if acked is not None:
            try:
                self._ack.write(acked)
            except OSError as exc:
                ack_error = exc
        for path in unlink:
            try:
                unlink_quietly(path)
            except OSError as exc:
                log.error("spool %s: cannot delete %s: %s", self.dir, path.name, exc)
        for done, append in enumerate(appends):
            try:
                self._append(append)
            except OSError as exc:
                return done, ack_error, exc
        return len(appends), ack_error, None

    def _append(self, a: Append[Any]) -> None:
        new = a.segment is None
        try:
            with open(a.path, "wb" if new else "r+b") as f:
                if new:
                    f.write(MAGIC)
                else:
                    f.truncate(a.start)  # what a failed earlier attempt may have left
                    f.seek(a.start)
                f.write(b"".join(a.chunks))
                f.flush()
                os.fsync(f.fileno())
            if new:
                fsync_dir(self.dir)
        except OSError:
            # Give back what the failed write took: a full disk needs every block it has.
            try:
                if new:
                    unlink_quietly(a.path)
                else:
                    os.truncate(a.path, a.start)
            except OSError as exc:
                log.debug("spool %s: cannot undo a failed write: %s", self.dir, exc)
            raise

    def payload(self, block: Block) -> bytes:
        """The block as a record stores it: its 1.0 request (``Wire``) for a 1.0 endpoint, else
        (or where it holds native histograms, which a refusal may have to take out of it)
        packed (``blocks.pack``, its series remembered for reading), compressed either way."""
        if self._wire is not None and block.hist is None:  # a Wire holds floats only
            wire = Wire.of(block, self._wire)
            return _WIRE_HEAD.pack(KIND_WIRE, wire.raw_len) + wire.body
        data = pack(block)
        self._unpacker.remember(block, data)
        return bytes((KIND_BLOCK,)) + compress(data)

    def read(
        self, path: Path, picks: list[tuple[int, int, int]], end: int
    ) -> list[tuple[int, int, Block | Wire | None]]:
        """The records ``picks`` (seq, count, offset), which lie before ``end`` in the file,
        as blocks or requests (``Wire``); a damaged one without either."""
        base = picks[0][2]
        try:
            with open(path, "rb") as f:
                f.seek(base)
                buf = f.read(end - base)
        except FileNotFoundError:  # dropped at the disk bound meanwhile
            return []
        out: list[tuple[int, int, Block | Wire | None]] = []
        for seq, count, offset in picks:
            payload = payload_at(buf, offset - base, seq)
            block = self._block(payload, count) if payload is not None else None
            out.append((seq, count, block))
        return out

    def written(self, framed: bytes, count: int) -> Wire | None:
        """A record just written (``framed``, as ``frame`` made it), as the request it holds:
        kept in memory instead of its block, so that a record sent from memory after it was
        written is not written and compressed again. None for a packed block."""
        if self._wire is None:
            return None
        found = self._block(memoryview(framed)[_HEAD.size :], count)
        return found if isinstance(found, Wire) else None

    def _block(self, payload: bytes | memoryview, count: int) -> Block | Wire | None:
        """A stored record as a block or request again; None when it cannot be read, or its
        header and its bytes disagree (it is dropped). A request is not decompressed: its
        length varint must say the raw length the header does (a receiver refuses the rest)."""
        kind = payload[0] if payload else KIND_BLOCK
        if kind == KIND_WIRE:
            if len(payload) <= _WIRE_HEAD.size:
                return None
            raw_len = _WIRE_HEAD.unpack_from(payload)[1]
            body = payload[_WIRE_HEAD.size :]  # a view: copied once, into the request
            head = preamble(body)
            if head is None or head[0] != raw_len:
                return None
            return Wire(body, raw_len, count)
        packed = payload[1:] if kind == KIND_BLOCK else payload  # else a segment before kinds
        try:
            block = self._unpacker.unpack(snappy.uncompress(packed))
        except (ValueError, snappy.UncompressError):
            return None
        return block if block.samples == count else None


# -- recovery --------------------------------------------------------------------------------


@dataclass(slots=True)
class Recovered:
    segments: list[Segment]
    acked: int
    keep_ack: bool  # the ack file is intact: used as it is
    corrupt_samples: int  # in damaged records not yet delivered: to count as dropped


def recover(directory: Path) -> Recovered:
    """Index every segment, find the acknowledged seq, delete what is delivered or empty.

    Damage is skipped, never cut off: the files stay as they are (they are never appended to
    again) and each damaged one is logged once."""
    directory.mkdir(parents=True, exist_ok=True)
    raw_ack = None
    with contextlib.suppress(FileNotFoundError):
        raw_ack = (directory / ACK_NAME).read_bytes()
    names = [p for p in directory.glob("*.seg") if p.stem.isdigit()]
    indexed: list[tuple[Segment, Scan, list[Damage]]] = []
    floor = 0  # seqs below it belong to an earlier segment
    for path in sorted(names, key=lambda p: int(p.stem)):
        data = path.read_bytes()
        result = scan(data, path)
        seg = Segment(int(path.stem), path, len(data), sealed=True)
        damage = result.damage
        for seq, count, offset in result.records:
            if seq < max(seg.first_seq, floor) or (len(seg) and seq < seg.end_seq):
                damage.append(Damage(offset, offset, seq, count))  # out of order: not ours
            else:
                seg.add(seq, count, offset)
        floor = max(floor, seg.end_seq)
        indexed.append((seg, result, damage))
    acked, keep_ack = parse_ack(raw_ack, directory)
    segments: list[Segment] = []
    corrupt = 0
    for seg, result, damage in indexed:
        delivered = seg.index(acked)
        for column in (seg.rel, seg.counts, seg.offsets):
            del column[:delivered]
        lost = sum(d.count or 0 for d in damage if d.seq is not None and d.seq >= acked)
        corrupt += lost
        if damage:
            _report(seg.path, result, damage, lost, len(seg))
        if not len(seg):
            seg.path.unlink()
            continue
        segments.append(seg)
    return Recovered(segments, acked, keep_ack, corrupt)


def _report(path: Path, result: Scan, damage: list[Damage], lost: int, kept: int) -> None:
    spans = sorted((d.start, d.end) for d in damage if d.end > d.start)
    where = ", ".join(f"{a}-{b}" for a, b in spans[:5]) + (
        f" and {len(spans) - 5} more" if len(spans) > 5 else ""
    )
    known = sum(1 for d in damage if d.seq is not None)
    unknown = any(d.seq is None for d in damage)
    log.warning(
        "spool: %s: %sskipped %d damaged byte(s) at %s: %d record(s) lost, %d sample(s) "
        "counted as dropped (corrupt)%s; %d intact record(s) kept",
        path,
        "the segment header is damaged; " if result.header_damaged else "",
        sum(b - a for a, b in spans),
        where or "-",
        known,
        lost,
        "; the damaged bytes without a readable record header held samples that are not "
        "counted (their number is unknown)"
        if unknown
        else "",
        kept,
    )


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()

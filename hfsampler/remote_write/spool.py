"""Spool: a persistent shard queue, bounded in memory and on disk, that survives crashes.

Every ``put`` block becomes one *record*: on disk its bytes compressed with snappy (compression,
checksums, writes, fsync and reads all run on the spool's own I/O thread, never on the event
loop). Records go to memory and, from that thread, to append-only segment files; memory keeps
at most ``capacity`` samples of the newest unsent records, older ones are read back from the
files as blocks again. A record leaves the spool when the sender acknowledges it; a segment file
is deleted once all its records are acknowledged. Past ``max_disk_bytes`` the oldest segment is
deleted unsent and its samples are counted as dropped. Delivery is at least once: a batch
delivered just before a crash, whose acknowledgement was not yet written, is sent again.

On-disk format, one directory per shard::

    <first seq, 20 digits>.seg   MAGIC (8 bytes) then records:
        u32 payload length | u32 CRC32 of (seq, count, payload) | u64 seq | u32 count | payload
    acked                        u64: every record with a lower seq was delivered (or dropped)

All integers little-endian; seqs are consecutive within a segment. Segments that start with
``LEGACY_MAGIC`` were written before labels were sent in byte order (``__name__`` first): they
are read as before and each record's labels are put in order on the way out (``wire.sort_labels``)
so nothing reaches a strict receiver unsorted; a record that cannot be repaired is dropped and
counted as ``corrupt``. At start every segment is
checked record by record: a torn or corrupt record and everything after it in that segment
is cut off (the file truncated, a warning logged), never an error; acknowledged and empty
segments are deleted. Writes are fsynced before a record counts as written, so a ``kill -9``
loses only records put since the last write (milliseconds). All file I/O runs on one thread
per queue, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
import zlib
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import snappy

from hfsampler.remote_write import wire
from hfsampler.remote_write.encoder import Block, compress
from hfsampler.remote_write.queue import Batch, BatchWaiter

log = logging.getLogger(__name__)

MAGIC = b"HFSPOOL2"
LEGACY_MAGIC = b"HFSPOOL1"  # labels as encoded before byte order: __name__ first
_HEADER = struct.Struct("<IIQI")  # length, crc, seq, count
_CRC_PART = struct.Struct("<QI")  # what the CRC covers besides the payload
_ACK = struct.Struct("<Q")
MAX_RECORD_BYTES = 64 << 20  # a length above this is corruption, not a record
MAX_SEGMENT_BYTES = 8 << 20
MIN_SEGMENT_BYTES = 16 << 10


@dataclass(slots=True)
class _Record:
    """A record as stored: its payload is the block's bytes, compressed."""

    seq: int
    count: int
    payload: bytes


@dataclass(slots=True)
class _Entry:
    """A record as queued: ``block`` is None for a legacy record that could not be repaired."""

    seq: int
    count: int
    block: Block | None


@dataclass(slots=True)
class _Segment:
    first_seq: int
    path: Path
    size: int
    counts: array[int] = field(default_factory=lambda: array("I"))
    legacy: bool = False  # written with LEGACY_MAGIC: labels need sorting on the way out

    @property
    def end_seq(self) -> int:
        """One past the last record's seq."""
        return self.first_seq + len(self.counts)

    def samples_from(self, seq: int) -> int:
        """Samples in records with seq >= ``seq``."""
        return sum(self.counts[max(0, seq - self.first_seq) :])


def segment_bytes_for(max_disk_bytes: int) -> int:
    """Segment size: small enough that dropping one frees a fraction of the disk bound."""
    return max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, max_disk_bytes // 8))


def frame(record: _Record) -> bytes:
    """A record's bytes on disk (``payload`` already compressed)."""
    crc = zlib.crc32(record.payload, zlib.crc32(_CRC_PART.pack(record.seq, record.count)))
    header = _HEADER.pack(len(record.payload), crc, record.seq, record.count)
    return header + record.payload


def parse_records(data: bytes, offset: int, first_seq: int | None) -> tuple[list[_Record], int]:
    """Valid consecutive records from ``offset``; also the offset where valid data ends."""
    out: list[_Record] = []
    expect = first_seq
    while offset + _HEADER.size <= len(data):
        length, crc, seq, count = _HEADER.unpack_from(data, offset)
        end = offset + _HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data) or (expect is not None and seq != expect):
            break
        payload = data[offset + _HEADER.size : end]
        if zlib.crc32(payload, zlib.crc32(_CRC_PART.pack(seq, count))) != crc:
            break
        out.append(_Record(seq, count, payload))
        expect = seq + 1
        offset = end
    return out, offset


# One append: the segment file, the framed records, the file size before them (0: a new file).
_Write = tuple[Path, bytes, int]


class _Files:
    """The file side of one spool; every method runs on the spool's single I/O thread."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        # Where the last read stopped, so a drain reads each segment once: (path, seq, offset).
        self._cursor: tuple[Path, int, int] | None = None

    def commit(self, writes: list[_Write], unlink: list[Path], acked: int | None) -> None:
        for path, data, start in writes:
            with open(path, "ab") as f:
                # A failed earlier attempt may have left part of this write behind: cut it off.
                f.truncate(start)
                if start == 0:
                    f.write(MAGIC)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if start == 0:
                self._fsync_dir()
        for path in unlink:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if acked is not None:
            tmp = self.dir / "acked.tmp"
            tmp.write_bytes(_ACK.pack(acked))
            os.replace(tmp, self.dir / "acked")

    def read(
        self,
        path: Path,
        first_seq: int,
        seq: int,
        max_samples: int,
        stop_seq: int,
        legacy: bool = False,
    ) -> list[_Entry]:
        """Records from ``seq`` on (below ``stop_seq``) until ``max_samples`` are gathered.

        A legacy record comes back with its labels sorted, or without a block when it cannot be
        repaired (the caller counts it as corrupt)."""
        offset, at = len(MAGIC), first_seq
        cursor = self._cursor
        if cursor is not None and cursor[0] == path and cursor[1] <= seq:
            _, at, offset = cursor
        out: list[_Entry] = []
        total = 0
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                while at < stop_seq and total < max_samples:
                    head = f.read(_HEADER.size)
                    if len(head) < _HEADER.size:
                        break
                    length, crc, rseq, count = _HEADER.unpack(head)
                    if length > MAX_RECORD_BYTES or rseq != at:
                        break
                    payload = f.read(length)
                    check = zlib.crc32(payload, zlib.crc32(_CRC_PART.pack(rseq, count)))
                    if len(payload) < length or check != crc:
                        break
                    offset += _HEADER.size + length
                    at = rseq + 1
                    if rseq >= seq:
                        out.append(_Entry(rseq, count, _block(path, rseq, count, payload, legacy)))
                        total += count
        except FileNotFoundError:  # dropped at the disk bound meanwhile
            return []
        self._cursor = (path, at, offset)
        return out

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _block(path: Path, seq: int, count: int, payload: bytes, legacy: bool) -> Block | None:
    """A stored record as a block again; a legacy one with its labels put in byte order.

    None when a legacy record cannot be decoded: it is dropped, never sent unsorted."""
    try:
        raw = snappy.uncompress(payload)
        if legacy:
            raw = wire.sort_labels(raw)
    except (wire.WireError, snappy.UncompressError) as exc:
        if not legacy:
            raise  # a CRC-valid record of our own that does not decode: a bug, not damage
        why = str(exc) or type(exc).__name__
        log.error("spool: %s: record %d cannot be repaired (%s); dropping it", path, seq, why)
        return None
    return Block.ready(raw, count)


def _stored(seq: int, count: int, raw: bytes) -> bytes:
    """A queued block's framed bytes for the segment file."""
    return frame(_Record(seq, count, compress(raw)))


def recover(directory: Path) -> tuple[list[_Segment], int]:
    """The segments worth keeping and the acknowledged seq; repairs torn or corrupt tails."""
    directory.mkdir(parents=True, exist_ok=True)
    acked = 0
    with contextlib.suppress(FileNotFoundError):
        raw = (directory / "acked").read_bytes()
        if len(raw) == _ACK.size:
            acked = _ACK.unpack(raw)[0]
        else:
            log.warning("spool %s: ignoring a damaged ack file; records may be resent", directory)
    names = [p for p in directory.glob("*.seg") if p.stem.isdigit()]
    segments: list[_Segment] = []
    for path in sorted(names, key=lambda p: int(p.stem)):
        first = int(path.stem)
        data = path.read_bytes()
        legacy = data.startswith(LEGACY_MAGIC)
        if not legacy and not data.startswith(MAGIC):
            log.warning("spool: %s has no valid header; deleting it", path)
            path.unlink()
            continue
        records, end = parse_records(data, len(MAGIC), first)
        if end != len(data):
            # A crash mid-write leaves a partial record; anything after a bad record is unusable.
            log.warning(
                "spool: %s: cutting off %d damaged byte(s) after %d good record(s)",
                path,
                len(data) - end,
                len(records),
            )
            with open(path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        if segments and records and records[0].seq < segments[-1].end_seq:
            records = []  # overlaps an earlier segment: never valid, never sent twice
        seg = _Segment(first, path, end, array("I", (r.count for r in records)), legacy)
        if not records or seg.end_seq <= acked:
            path.unlink()
            continue
        if legacy:
            log.info("spool: %s is from an older version; its labels are sorted as sent", path)
        segments.append(seg)
    return segments, acked


class SpoolQueue:
    """A ``ShardQueue`` whose records live in segment files until acknowledged."""

    persistent = True

    def __init__(
        self,
        directory: Path,
        capacity: int,
        max_disk_bytes: int,
        on_drop: Callable[[int, str], None] = lambda n, reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or max_disk_bytes < 1:
            raise ValueError("capacity and max_disk_bytes must be at least 1")
        self._dir = directory
        self._capacity = capacity
        self._max_disk = max_disk_bytes
        self._segment_bytes = segment_bytes_for(max_disk_bytes)
        self._on_drop = on_drop
        self._clock = clock
        self._files = _Files(directory)
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"spool-{directory.name}")
        segments, acked = recover(directory)
        self._segments: deque[_Segment] = deque(segments)
        self._disk_bytes = sum(s.size for s in segments)
        self._acked = acked
        self._read_seq = max(acked, segments[0].first_seq if segments else acked)
        self._next_seq = max(acked, segments[-1].end_seq if segments else acked)
        self._written_seq = self._next_seq
        self._unread = sum(s.samples_from(self._read_seq) for s in segments)
        self._mem: deque[_Entry] = deque()
        self._mem_samples = 0
        self._pending: list[_Entry] = []
        self._failed: list[_Write] = []  # appends that hit a disk error, retried first
        self._failed_last: int | None = None
        self._ack_dirty = False
        self._wake = asyncio.Event()
        self._waiter = BatchWaiter()
        self._flushing = False
        self._closing = False
        self._writer: asyncio.Task[None] | None = None
        if self._unread:
            log.info(
                "spool %s: replaying %d sample(s) in %d segment(s) from before the restart",
                directory,
                self._unread,
                len(segments),
            )

    # -- facts ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._unread

    @property
    def disk_bytes(self) -> int:
        return self._disk_bytes

    @property
    def memory_samples(self) -> int:
        """Samples held in memory (unsent records cached, or not yet written)."""
        return self._mem_samples

    # -- producer side ----------------------------------------------------------------------------

    def put(self, block: Block) -> int:
        if self._closing:
            self._on_drop(block.samples, "shutdown")
            return 0
        rec = _Entry(self._next_seq, block.samples, block)
        self._next_seq += 1
        self._pending.append(rec)
        self._mem.append(rec)
        self._mem_samples += rec.count
        self._unread += rec.count
        self._kick_writer()
        self._waiter.queued(self._unread)
        return 0

    def ack(self, batch: Batch) -> None:
        if batch.token >= self._acked:
            self._acked = batch.token + 1
            self._ack_dirty = True
            self._kick_writer()

    def start_flush(self) -> None:
        self._flushing = True
        self._waiter.wake()

    async def close(self) -> int:
        """Write what is only in memory, record the acknowledged position, stop the thread."""
        self._closing = True
        self._waiter.wake()
        self._kick_writer()
        if self._writer is not None:
            await asyncio.shield(self._writer)
        await asyncio.get_running_loop().run_in_executor(None, self._io.shutdown)
        return 0

    # -- writer -----------------------------------------------------------------------------------

    def _kick_writer(self) -> None:
        self._wake.set()
        if self._writer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop yet: the first put or get_batch inside one starts it
            self._writer = loop.create_task(self._write_loop(), name=f"spool-{self._dir}")

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, []
            frames = await self._frames(pending)
            writes, unlink, acked, last = self._plan(pending, frames)
            writes = self._failed + writes
            last = last if last is not None else self._failed_last
            if writes or unlink or acked is not None:
                try:
                    await loop.run_in_executor(self._io, self._files.commit, writes, unlink, acked)
                except OSError as exc:
                    # A full or broken disk: the records stay in memory (never evicted before
                    # they are written) and the same appends are retried.
                    log.error("spool %s: cannot write: %s", self._dir, exc.strerror or exc)
                    self._failed, self._failed_last = writes, last
                    if acked is not None:
                        self._ack_dirty = True
                    if self._closing:
                        return
                    await asyncio.sleep(1.0)
                    self._wake.set()
                    continue
                self._failed, self._failed_last = [], None
            if last is not None:
                self._written_seq = last + 1
                self._evict()
            if self._closing and not self._pending and not self._ack_dirty:
                return

    async def _frames(self, pending: list[_Entry]) -> list[bytes]:
        """The records' bytes on disk, compressed and checksummed on the I/O thread."""
        if not pending:
            return []
        raws = [await e.block.data() for e in pending if e.block is not None]
        records = [(e.seq, e.count, raw) for e, raw in zip(pending, raws, strict=True)]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, lambda: [_stored(*r) for r in records])

    def _plan(
        self, pending: list[_Entry], frames: list[bytes]
    ) -> tuple[list[_Write], list[Path], int | None, int | None]:
        """Assign framed records to segments, pick segments to delete; no I/O here."""
        writes: list[_Write] = []
        chunks: list[bytes] = []
        active = self._segments[-1] if self._segments else None
        start = active.size if active is not None else 0
        last = None
        for rec, data in zip(pending, frames, strict=True):
            if (
                active is None
                or active.legacy
                or active.size >= self._segment_bytes
                or rec.seq != active.end_seq
            ):
                if chunks and active is not None:
                    writes.append((active.path, b"".join(chunks), start))
                active = _Segment(rec.seq, self._dir / f"{rec.seq:020d}.seg", len(MAGIC))
                self._segments.append(active)
                self._disk_bytes += len(MAGIC)
                chunks, start = [], 0
            chunks.append(data)
            active.size += len(data)
            active.counts.append(rec.count)
            self._disk_bytes += len(data)
            last = rec.seq
        if chunks and active is not None:
            writes.append((active.path, b"".join(chunks), start))
        unlink: list[Path] = []
        segs = self._segments
        while len(segs) > 1 and segs[0].end_seq <= self._acked:
            unlink.append(self._forget(segs.popleft()))
        while len(segs) > 1 and self._disk_bytes > self._max_disk:
            seg = segs.popleft()
            self._drop_segment(seg)
            unlink.append(seg.path)
        acked = None
        if self._ack_dirty:
            acked, self._ack_dirty = self._acked, False
        return writes, unlink, acked, last

    def _forget(self, seg: _Segment) -> Path:
        self._disk_bytes -= seg.size
        return seg.path

    def _drop_segment(self, seg: _Segment) -> None:
        """Past the disk bound: the oldest segment goes, unsent; its samples are counted."""
        self._forget(seg)
        lost = seg.samples_from(self._read_seq)
        if lost:
            self._unread -= lost
            self._on_drop(lost, "disk_full")
        while self._mem and self._mem[0].seq < seg.end_seq:
            self._mem_samples -= self._mem.popleft().count
        self._read_seq = max(self._read_seq, seg.end_seq)
        if self._acked < seg.end_seq:
            self._acked = seg.end_seq
            self._ack_dirty = True

    def _evict(self) -> None:
        """Keep at most ``capacity`` samples in memory; only written records may leave."""
        mem = self._mem
        while self._mem_samples > self._capacity and mem and mem[0].seq < self._written_seq:
            self._mem_samples -= mem.popleft().count

    # -- consumer side ----------------------------------------------------------------------------

    async def get_batch(self, max_samples: int, deadline_s: float) -> Batch:
        end = self._clock() + deadline_s
        while True:
            n = self._unread
            backlog = bool(self._segments) and self._read_seq < self._mem_first()
            if n >= max_samples or backlog or (n and (self._flushing or self._clock() >= end)):
                batch = await self._take(max_samples)
                if batch.count:
                    return batch
                if batch.token >= 0:
                    self.ack(batch)  # only dropped records: never read them again
                continue
            if self._flushing or self._closing:
                return Batch()
            end = await self._waiter.wait(n, max_samples, end, deadline_s, self._clock)

    def _mem_first(self) -> int:
        return self._mem[0].seq if self._mem else self._next_seq

    async def _take(self, max_samples: int) -> Batch:
        batch = Batch()
        while batch.count < max_samples and self._unread:
            if self._mem and self._mem[0].seq <= self._read_seq:
                rec = self._mem.popleft()
                self._mem_samples -= rec.count
                records = [rec]
            else:
                records = await self._read_disk(max_samples - batch.count)
                if not records:
                    break
            for rec in records:
                if rec.block is None:  # a legacy record that could not be repaired
                    self._on_drop(rec.count, "corrupt")
                    self._unread -= rec.count
                    self._read_seq = rec.seq + 1
                    batch.token = rec.seq  # acknowledged with the batch, or at once if alone
                    continue
                batch.add(rec.block)
                batch.token = rec.seq
                self._unread -= rec.count
                self._read_seq = rec.seq + 1
        return batch

    async def _read_disk(self, max_samples: int) -> list[_Entry]:
        seg = next((s for s in self._segments if s.end_seq > self._read_seq), None)
        if seg is None:
            return []
        if self._read_seq < seg.first_seq:
            self._read_seq = seg.first_seq  # records lost to a damaged segment: skip the gap
        stop = min(seg.end_seq, self._mem_first(), self._written_seq)
        start = self._read_seq
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(
            self._io,
            self._files.read,
            seg.path,
            seg.first_seq,
            start,
            max_samples,
            stop,
            seg.legacy,
        )
        # The disk bound may have dropped some of these while the thread read them.
        fresh = [r for r in records if r.seq >= self._read_seq]
        if not records and self._read_seq == start and seg in self._segments:
            # Nothing readable where the index says records are: the file was damaged under us.
            log.error("spool %s: cannot read records from %d; skipping them", seg.path, start)
            lost = sum(seg.counts[start - seg.first_seq : stop - seg.first_seq])
            self._unread -= lost
            self._on_drop(lost, "corrupt")
            self._read_seq = stop
        return fresh

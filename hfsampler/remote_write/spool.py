"""Spool: a persistent shard queue, bounded in memory and on disk, that survives crashes,
restarts, a full disk and damaged files.

Every ``put`` block becomes one *record*: on disk the block's 1.0 request (a 1.0 endpoint's: read
back as a ``Wire`` and sent as it is, ``wire.py``) or the block packed (``blocks.pack``), compressed
with snappy, framed and checksummed (``segment.py`` has the format). Records go to memory and, from
the spool's own I/O thread, to append-only segment files; packing, compression, checksums, writes,
fsync, reads and the start's recovery all run on that thread, never on the event loop. Memory keeps
at most ``capacity`` samples of the newest unsent records, older ones are read back from the files
as blocks again. A record leaves the spool when the sender acknowledges it; a segment file is
deleted as soon as all its records are acknowledged, the newest one too. Past ``max_disk_bytes`` the
oldest segment is deleted unsent and its samples are counted as dropped (``disk_full``). Delivery is
at least once: a batch delivered just before a crash, whose acknowledgement was not yet written, is
sent again.

The directory is locked to one process (``dirlock``): a second one is refused, naming the pid
that holds it. At start every segment is indexed record by record; damage costs the damaged
records only, counted as dropped (``corrupt``) where their samples are known and logged once per
segment with its byte offsets; the same holds for a record found damaged when read back later.

A full disk (or one that refuses writes) is a state: appends stop, logged once; records wait in
memory, where past ``capacity`` samples the oldest unwritten ones are dropped and counted
(``disk_full``); delivery goes on from disk and memory, and what is delivered from memory is
never written; acknowledged segments are deleted at once, which frees space; every ``RETRY_S``
one record is tried, and when it is written appending resumes; the state ends, logged once, when
an append after it is written too (a disk with room for the one record only, refusing the next
append, stays in the same state and says nothing more). Acknowledgements
need no free space (``segment.AckFile``). Writes are fsynced before a record counts as written,
so a ``kill -9`` loses only records put since the last write (milliseconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.queue import Batch, BatchWaiter
from hfsampler.remote_write.segment import MAGIC, Append, Segment, SpoolFiles, frame
from hfsampler.remote_write.wire import Wire

log = logging.getLogger(__name__)

MAX_SEGMENT_BYTES = 8 << 20
MIN_SEGMENT_BYTES = 16 << 10
RETRY_S = 1.0  # how often a disk that refused a write is tried again (with one record)


@dataclass(slots=True, eq=False)
class _Entry:
    """A record as queued, or read back (a 1.0 endpoint's as the request it was stored as, a
    ``Wire``). ``block`` is None for one dropped from memory (``dropped``) or one that was read
    back damaged or could not be repaired (counted as corrupt)."""

    seq: int
    count: int
    block: Block | Wire | None
    dropped: bool = False


def segment_bytes_for(max_disk_bytes: int) -> int:
    """Segment size: small enough that dropping one frees a fraction of the disk bound."""
    return max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, max_disk_bytes // 8))


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
        on_disk_bytes: Callable[[int], None] = lambda n: None,
        wire: bool = False,
        drain_samples: int = 0,
    ) -> None:
        """``on_disk_bytes`` is told the bytes on disk each time segments were written or
        deleted (a gauge that must not wait for the next batch taken, which an outage delays).
        ``wire``: records are stored as the 1.0 requests they make (a 1.0 endpoint's), read
        back as ``Wire`` and sent as they are; else as packed blocks (``segment``).
        ``drain_samples``: a batch read from the files holds records of up to that many
        samples rather than ``get_batch``'s ``max_samples`` (``QueueConfig.drain_samples``)."""
        if capacity < 1 or max_disk_bytes < 1:
            raise ValueError("capacity and max_disk_bytes must be at least 1")
        self._dir = directory
        self._capacity = capacity
        self._max_disk = max_disk_bytes
        self._segment_bytes = segment_bytes_for(max_disk_bytes)
        self._on_drop = on_drop
        self._on_disk_bytes = on_disk_bytes
        self._clock = clock
        self._files = SpoolFiles(directory, wire)
        self._drain_samples = drain_samples
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"spool-{directory.name}")
        try:
            found = self._io.submit(self._files.open).result()
        except BaseException:
            self._io.shutdown()
            raise
        segments = found.segments
        self._segments: deque[Segment] = deque(segments)
        self._disk_bytes = sum(s.size for s in segments)
        self._acked = found.acked
        self._read_seq = found.acked
        self._next_seq = max(found.acked, segments[-1].end_seq if segments else 0)
        self._unread = sum(s.samples_from(found.acked) for s in segments)
        self._mem: deque[_Entry] = deque()  # unsent records in seq order, the newest last
        self._mem_samples = 0
        self._pending: deque[_Entry] = deque()  # not yet written (nor handed to the thread)
        self._writing: list[_Entry] = []  # with the thread now
        self._ack_dirty = False
        self._ack_failing = False
        self._full_since: float | None = None  # appends fail since then
        self._probed = False  # the one record tried was written: appending resumes on probation
        self._full_dropped = 0
        # the timer's word, not a clock compared with a deadline: uvloop fires timers up to a
        # millisecond early, and a wake that found the deadline not yet come would be the last
        self._probe_due = False
        self._retry: asyncio.TimerHandle | None = None
        self._reported: set[Path] = set()  # segments whose damage found on reading was logged
        self._wake = asyncio.Event()
        self._waiter = BatchWaiter()
        self._flushing = False
        self._closing = False
        self._writer: asyncio.Task[None] | None = None
        if found.corrupt_samples:
            on_drop(found.corrupt_samples, "corrupt")
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
        if self._refusing:
            self._evict()
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
        """Write what is only in memory, record the acknowledged position, stop the thread.

        Returns the samples that could not be written (a full disk): they are lost."""
        self._closing = True
        self._waiter.wake()
        self._kick_writer()
        if self._writer is not None:
            await asyncio.shield(self._writer)
        if self._retry is not None:
            self._retry.cancel()
        lost = sum(e.count for e in self._pending if not e.dropped and e.seq >= self._acked)
        if lost:
            log.error("spool %s: %d sample(s) could not be written before exit", self._dir, lost)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._io, self._files.close)
        await loop.run_in_executor(None, self._io.shutdown)
        return lost

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
            todo = self._writing = self._take_pending()
            frames = await self._frames(todo)
            appends = self._plan(todo, frames)
            unlink = self._reclaim(appends)
            acked = self._acked if self._ack_dirty else None
            self._ack_dirty = False
            failed = False
            if appends or unlink or acked is not None:
                done, ack_error, error = await loop.run_in_executor(
                    self._io, self._files.commit, appends, unlink, acked
                )
                self._applied(appends[:done])
                self._pending.extendleft(reversed([e for a in appends[done:] for e in a.entries]))
                self._ack_written(acked, ack_error)
                self._appended(bool(appends), done, error, freed=bool(unlink))
                self._on_disk_bytes(self._disk_bytes)
                failed = error is not None or ack_error is not None
            self._writing = []
            self._evict()
            if self._closing and (failed or not (self._pending or self._ack_dirty)):
                return
            if self._pending and (not self._refusing or self._closing):
                self._wake.set()  # more came meanwhile, or the probe succeeded

    def _take_pending(self) -> list[_Entry]:
        """What to write now: everything pending, or while the disk refuses, one record."""
        pending = self._pending
        while pending and (pending[0].dropped or pending[0].seq < self._acked):
            pending.popleft()  # gone from memory, or delivered before it was written
        if not self._refusing or self._closing:
            todo = [e for e in pending if not e.dropped and e.seq >= self._acked]
            pending.clear()
            return todo
        if not pending or not self._probe_due:
            return []
        self._probe_due = False
        return [pending.popleft()]

    async def _frames(self, todo: list[_Entry]) -> list[bytes]:
        """The records' bytes on disk, packed, compressed and checksummed on the I/O thread."""
        if not todo:
            return []
        records = [(e.seq, e.count, e.block) for e in todo if isinstance(e.block, Block)]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._io,
            lambda: [frame(seq, n, self._files.payload(b)) for seq, n, b in records],
        )

    def _plan(self, todo: list[_Entry], frames: list[bytes]) -> list[Append[_Entry]]:
        """Assign framed records to segment files; no I/O and no change here."""
        appends: list[Append[_Entry]] = []
        last = self._segments[-1] if self._segments else None
        # Append to the newest segment only if it is ours, not full, and not all delivered.
        target = (
            last
            if last is not None
            and not last.sealed
            and last.size < self._segment_bytes
            and last.end_seq > self._acked
            else None
        )
        current: Append[_Entry] | None = None
        for rec, data in zip(todo, frames, strict=True):
            if current is None or current.end >= self._segment_bytes:
                if current is None and target is not None:
                    current = Append(target.path, target.first_seq, target.size, target)
                    current.end = target.size
                else:
                    path = self._dir / f"{rec.seq:020d}.seg"
                    current = Append(path, rec.seq, 0, None, end=len(MAGIC))
                appends.append(current)
            current.add(rec, data)
        return appends

    def _reclaim(self, appends: list[Append[_Entry]]) -> list[Path]:
        """Segments to delete: every one acknowledged, then the oldest past the disk bound."""
        target = appends[0].segment if appends else None
        unlink: list[Path] = []
        segs = self._segments
        while segs and segs[0] is not target and segs[0].end_seq <= self._acked:
            seg = segs.popleft()
            self._disk_bytes -= seg.size
            unlink.append(seg.path)
        projected = self._disk_bytes + sum(a.end - a.start for a in appends)
        while segs and segs[0] is not target and projected > self._max_disk:
            seg = segs.popleft()
            projected -= seg.size
            self._drop_segment(seg)
            unlink.append(seg.path)
        return unlink

    def _applied(self, appends: list[Append[_Entry]]) -> None:
        """Index what was written."""
        for a in appends:
            seg = a.segment
            if seg is None:
                seg = Segment(a.first_seq, a.path, 0)
                self._segments.append(seg)
            self._disk_bytes += a.end - seg.size
            seg.size = a.end
            for rec, offset, framed in zip(a.entries, a.offsets, a.chunks, strict=True):
                seg.add(rec.seq, rec.count, offset)
                if isinstance(rec.block, Block) and (
                    wire := self._files.written(framed, rec.count)
                ):
                    rec.block = wire  # still in memory: sent as written, not encoded again

    @property
    def _refusing(self) -> bool:
        """The disk refused the last append: one record is tried every ``RETRY_S``."""
        return self._full_since is not None and not self._probed

    def _probe_now(self) -> None:
        self._probe_due = True
        self._wake.set()

    def _appended(self, tried: bool, done: int, error: OSError | None, freed: bool) -> None:
        """Enter or leave the state of a disk that refuses writes, saying so once each."""
        if error is not None:
            self._probed = False
            if self._full_since is None:
                self._full_since = self._clock()
                self._full_dropped = 0
                log.error(
                    "spool %s: cannot write: %s; appending stops, records wait in memory (at "
                    "most %d samples, the oldest dropped past that) and delivery goes on; "
                    "trying again every %g s",
                    self._dir,
                    error.strerror or error,
                    self._capacity,
                    RETRY_S,
                )
            self._probe_due = False
            if self._retry is not None:
                self._retry.cancel()
            self._retry = asyncio.get_running_loop().call_later(RETRY_S, self._probe_now)
        elif tried and done and self._full_since is not None and not self._probed:
            self._probed = True  # the next append says whether the disk takes writes again
        elif tried and done and self._full_since is not None:
            log.info(
                "spool %s: writing again after %.1f s; %d sample(s) dropped meanwhile",
                self._dir,
                self._clock() - self._full_since,
                self._full_dropped,
            )
            self._full_since = None
            self._probed = False
        elif freed and self._refusing:
            self._probe_now()  # deleted segments freed space: try again now

    def _ack_written(self, acked: int | None, error: OSError | None) -> None:
        if error is not None:
            self._ack_dirty = True  # again with the next write
            if not self._ack_failing:
                log.error("spool %s: cannot record acknowledgements: %s", self._dir, error)
            self._ack_failing = True
        elif acked is not None and self._ack_failing:
            log.info("spool %s: acknowledgements recorded again", self._dir)
            self._ack_failing = False

    def _drop_segment(self, seg: Segment) -> None:
        """Past the disk bound: the oldest segment goes, unsent; its samples are counted."""
        self._disk_bytes -= seg.size
        lost = seg.samples_from(self._read_seq)
        if lost:
            self._unread -= lost
            self._on_drop(lost, "disk_full")
        while self._mem and self._mem[0].seq < seg.end_seq:
            self._mem_samples -= self._mem.popleft().count
        self._read_seq = max(self._read_seq, seg.end_seq)

    def _unwritten_first(self) -> int:
        if self._writing:
            return self._writing[0].seq
        return self._pending[0].seq if self._pending else self._next_seq

    def _evict(self) -> None:
        """Keep at most ``capacity`` samples in memory. Written records leave first; while the
        disk refuses writes, the oldest unwritten ones are dropped, but not one being written:
        past ``capacity`` by that one (a single record while the disk is full) at most."""
        mem = self._mem
        written = self._unwritten_first()
        while self._mem_samples > self._capacity and mem and mem[0].seq < written:
            self._mem_samples -= mem.popleft().count
        if not self._refusing:
            return
        waiting = self._pending[0].seq if self._pending else self._next_seq
        i = 0
        while self._mem_samples > self._capacity and i < len(mem):
            rec = mem[i]
            if rec.seq < waiting:  # with the I/O thread now
                i += 1
                continue
            del mem[i]  # a hole in memory's seqs: the reader steps over it
            self._mem_samples -= rec.count
            rec.dropped, rec.block = True, None
            self._unread -= rec.count
            self._full_dropped += rec.count
            self._on_drop(rec.count, "disk_full")

    # -- consumer side ----------------------------------------------------------------------------

    async def get_batch(self, max_samples: int, deadline_s: float) -> Batch:
        end = self._clock() + deadline_s
        while True:
            n = self._unread
            backlog = n > 0 and bool(self._segments) and self._read_seq < self._mem_first()
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
        if self._drain_samples and not (self._mem and self._mem[0].seq <= self._read_seq):
            max_samples = self._drain_samples  # a backlog read back from the files
        while batch.count < max_samples and self._unread:
            records: list[_Entry] | None
            if self._mem and self._mem[0].seq <= self._read_seq:
                rec = self._mem.popleft()
                self._mem_samples -= rec.count
                records = [rec]
            else:
                records = await self._read_disk(max_samples - batch.count)
                if records is None:  # nothing on disk before what memory holds
                    if not self._mem:
                        log.error("spool %s: %d sample(s) not found", self._dir, self._unread)
                        self._unread = 0
                        break
                    self._read_seq = self._mem[0].seq
                    continue
            for rec in records:
                if rec.seq < self._read_seq:
                    continue  # dropped at the disk bound while the thread read it
                self._unread -= rec.count
                self._read_seq = rec.seq + 1
                batch.token = rec.seq  # acknowledged with the batch, or at once if alone
                if rec.block is None:
                    self._on_drop(rec.count, "corrupt")
                else:
                    batch.add(rec.block)
        return batch

    async def _read_disk(self, max_samples: int) -> list[_Entry] | None:
        """The next records on disk, up to ``max_samples``; None if none lies before memory."""
        start, stop = self._read_seq, self._mem_first()
        seg = next((s for s in self._segments if s.end_seq > start), None)
        if seg is None:
            return None
        i = seg.index(start)
        picks: list[tuple[int, int, int]] = []
        total = 0
        while i < len(seg) and total < max_samples and seg.first_seq + seg.rel[i] < stop:
            picks.append((seg.first_seq + seg.rel[i], seg.counts[i], seg.offsets[i]))
            total += seg.counts[i]
            i += 1
        if not picks:
            return None
        end = seg.offsets[i] if i < len(seg) else seg.size
        loop = asyncio.get_running_loop()
        try:
            read = await loop.run_in_executor(self._io, self._files.read, seg.path, picks, end)
            records = [_Entry(seq, count, block) for seq, count, block in read]
        except OSError as exc:
            log.error("spool %s: cannot read %s: %s", self._dir, seg.path.name, exc)
            records = [_Entry(seq, count, None) for seq, count, _ in picks]
        if not records and seg in self._segments:
            records = [_Entry(seq, count, None) for seq, count, _ in picks]  # deleted under us
        bad = [p[2] for p, r in zip(picks, records, strict=False) if r.block is None]
        if bad and seg.path not in self._reported:
            self._reported.add(seg.path)
            log.warning(
                "spool: %s: record(s) at byte offset(s) %s damaged or unreadable when read "
                "back; skipped, their samples counted as dropped (corrupt)",
                seg.path,
                ", ".join(map(str, bad[:5])),
            )
        return records

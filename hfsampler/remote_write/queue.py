"""Queue: holds one shard's blocks between ``push`` and the sender, bounded, oldest dropped first.

``ShardQueue`` is the narrow interface the sender depends on. ``MemoryQueue`` (this module) keeps
blocks in memory only; ``SpoolQueue`` (``spool.py``) replaces it when a ``queue_dir`` is set and
keeps every block in checksummed segment files until the receiver acknowledged it. Both hold
only encoded ``Block``s; a ``Batch`` is what a shard sends in one go: whole blocks, oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.wire import Wire

Clock = Callable[[], float]


@dataclass(slots=True)
class Batch:
    """Blocks handed out by ``get_batch`` and given back with ``ack``; a spool's records read
    back from disk may be requests as stored (``Wire``), never a memory queue's.

    ``token`` is the queue's own bookkeeping (a persistent queue's last record sequence).
    """

    blocks: list[Block | Wire] = field(default_factory=list)
    count: int = 0
    token: int = -1

    def __len__(self) -> int:
        return self.count

    def add(self, block: Block | Wire) -> None:
        self.blocks.append(block)
        self.count += block.samples


class ShardQueue(Protocol):
    """What a shard needs from its queue."""

    @property
    def persistent(self) -> bool:
        """True when what is queued (and not acknowledged) outlives the process."""
        ...

    @property
    def disk_bytes(self) -> int:
        """Bytes this queue keeps on disk (0 for a memory queue)."""
        ...

    def put(self, block: Block) -> int:
        """Enqueue without blocking; returns how many old samples were dropped to make room."""
        ...

    async def get_batch(self, max_samples: int, deadline_s: float) -> Batch:
        """Whole blocks of up to ``max_samples`` samples (at least one block), oldest first: as
        soon as that many are queued, or when ``deadline_s`` has passed with at least one
        queued, or at once when flushing. Without blocks only when flushing and nothing is
        left."""
        ...

    def ack(self, batch: Batch) -> None:
        """The batch is done with (delivered, or refused for good): never hand it out again."""
        ...

    def start_flush(self) -> None:
        """From now on hand out what is queued without waiting for the deadline."""
        ...

    async def close(self) -> int:
        """Stop; return how many queued samples are lost (a persistent queue keeps them)."""
        ...

    def __len__(self) -> int: ...


class BatchWaiter:
    """How a shard waits in ``get_batch``, shared by both queues.

    With samples queued it wakes on a full batch or at the deadline; with none, any sample is
    worth waking for, and the deadline restarts from that first sample.
    """

    def __init__(self) -> None:
        self._ready = asyncio.Event()
        self._wanted = 1

    def queued(self, count: int) -> None:
        """The queue now holds ``count`` samples: wake the shard if that is what it waits for."""
        if count >= self._wanted:
            self._ready.set()

    def wake(self) -> None:
        """Wake the shard whatever it waits for (flush, close)."""
        self._ready.set()

    async def wait(
        self, count: int, max_samples: int, end: float, deadline_s: float, clock: Clock
    ) -> float:
        """Sleep until more is queued or ``end``; returns the deadline to use from now on."""
        self._wanted = max_samples if count else 1
        self._ready.clear()
        remaining = end - clock()
        if remaining <= 0:
            if count:
                # The deadline passed since the caller looked: its samples are due now. Waiting
                # for a full batch here would hold them until one came, maybe forever.
                return end
            # Deadline passed with nothing queued: wait for the first sample, then start over.
            await self._ready.wait()
            return clock() + deadline_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), remaining)
        return end


def _same_window(old: Block, new: Block) -> bool:
    """Whether ``old`` is of the window ``new`` is (a window's blocks share its timestamp; the
    queue is in order, so a block of it at the head means every block queued is of it)."""
    return bool(old.samples and new.samples and old.timestamps_ms[0] == new.timestamps_ms[0])


class MemoryQueue:
    """A bounded deque of blocks; when full, the oldest windows make way for new ones."""

    persistent = False
    disk_bytes = 0

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._blocks: deque[Block] = deque()
        self._samples = 0
        self._newest = 0  # samples of the newest window queued
        self._clock = clock
        self._waiter = BatchWaiter()
        self._flushing = False

    def __len__(self) -> int:
        return self._samples

    def put(self, block: Block) -> int:
        blocks = self._blocks
        if blocks and _same_window(blocks[-1], block):
            self._newest += block.samples
        else:
            self._newest = block.samples
        blocks.append(block)
        self._samples += block.samples
        dropped = 0
        # the newest window always stays whole, even past the bound (a window larger than its
        # plan said): it is what the receiver most wants, and a window is never dropped in part
        # because it arrived whole, before the sender could take any of it
        while (
            self._samples > self._capacity
            and len(blocks) > 1
            and not _same_window(blocks[0], block)
        ):
            old = blocks.popleft()
            self._samples -= old.samples
            dropped += old.samples
        if self._full_soon():
            self._waiter.wake()
        else:
            self._waiter.queued(self._samples)
        return dropped

    def _full_soon(self) -> bool:
        """Whether another window as large as the newest would drop one: what is queued is due
        now, full batch or not. A bound below ``max_samples_per_send`` never fills a batch, and
        with a ``batch_send_deadline`` every window but the last before it was dropped, the
        receiver healthy (80% of them at 2 windows and a 2 s deadline)."""
        return self._samples + self._newest > self._capacity

    def start_flush(self) -> None:
        self._flushing = True
        self._waiter.wake()

    def ack(self, batch: Batch) -> None:
        """Nothing to do: a handed-out batch is no longer held here."""

    async def close(self) -> int:
        lost = self._samples
        self._blocks.clear()
        self._samples = self._newest = 0
        return lost

    async def get_batch(self, max_samples: int, deadline_s: float) -> Batch:
        end = self._clock() + deadline_s
        while True:
            n = self._samples
            has = bool(self._blocks)
            if (
                n >= max_samples
                or (self._flushing and has)
                or (n and (self._clock() >= end or self._full_soon()))
            ):
                return self._take(max_samples)
            if self._flushing:
                return Batch()
            end = await self._waiter.wait(n, max_samples, end, deadline_s, self._clock)

    def _take(self, max_samples: int) -> Batch:
        batch = Batch()
        blocks = self._blocks
        while blocks and (not batch.blocks or batch.count + blocks[0].samples <= max_samples):
            block = blocks.popleft()
            self._samples -= block.samples
            batch.add(block)
        return batch

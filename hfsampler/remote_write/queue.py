"""Queue: holds one shard's samples between ``push`` and the sender, bounded, oldest dropped first.

``ShardQueue`` is the narrow interface the sender depends on. ``MemoryQueue`` (this module) keeps
samples in memory only; ``SpoolQueue`` (``spool.py``) replaces it when a ``queue_dir`` is set and
keeps every record in checksummed segment files until the receiver acknowledged it. A ``Batch``
is what a shard sends in one request: samples still to encode and/or records already encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from hfsampler.remote_write.encoder import QueuedSample

Clock = Callable[[], float]


@dataclass(slots=True)
class Batch:
    """One request's worth of data, handed out by ``get_batch`` and given back with ``ack``.

    ``samples`` still need encoding; ``parts`` are snappy-compressed ``WriteRequest`` bytes that
    a persistent queue stored already encoded (concatenated WriteRequests are one WriteRequest).
    ``token`` is the queue's own bookkeeping (the last record's sequence number).
    """

    samples: list[QueuedSample] = field(default_factory=list)
    parts: list[bytes] = field(default_factory=list)
    count: int = 0
    token: int = -1

    def __len__(self) -> int:
        return self.count


class ShardQueue(Protocol):
    """What a shard needs from its queue."""

    @property
    def persistent(self) -> bool:
        """True when what is queued (and not acknowledged) outlives the process."""
        ...

    def put(self, samples: Iterable[QueuedSample]) -> int:
        """Enqueue without blocking; returns how many old samples were dropped to make room."""
        ...

    async def get_batch(self, max_samples: int, deadline_s: float) -> Batch:
        """Up to ``max_samples`` samples, oldest first: as soon as that many are queued, or when
        ``deadline_s`` has passed with at least one queued, or at once when flushing. Empty only
        when flushing and nothing is left."""
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
            # Deadline passed with nothing queued: wait for the first sample, then start over.
            await self._ready.wait()
            return clock() + deadline_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), remaining)
        return end


class MemoryQueue:
    """A bounded deque of samples; when full, the oldest samples make way for new ones."""

    persistent = False

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._items: deque[QueuedSample] = deque()
        self._clock = clock
        self._waiter = BatchWaiter()
        self._flushing = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, samples: Iterable[QueuedSample]) -> int:
        items = self._items
        items.extend(samples)
        dropped = len(items) - self._capacity
        if dropped > 0:
            for _ in range(dropped):
                items.popleft()
        else:
            dropped = 0
        self._waiter.queued(len(items))
        return dropped

    def start_flush(self) -> None:
        self._flushing = True
        self._waiter.wake()

    def ack(self, batch: Batch) -> None:
        """Nothing to do: a handed-out batch is no longer held here."""

    async def close(self) -> int:
        lost = len(self._items)
        self._items.clear()
        return lost

    async def get_batch(self, max_samples: int, deadline_s: float) -> Batch:
        end = self._clock() + deadline_s
        while True:
            n = len(self._items)
            if n >= max_samples or (self._flushing and n) or (n and self._clock() >= end):
                samples = self._take(max_samples)
                return Batch(samples=samples, count=len(samples))
            if self._flushing:
                return Batch()
            end = await self._waiter.wait(n, max_samples, end, deadline_s, self._clock)

    def _take(self, max_samples: int) -> list[QueuedSample]:
        items = self._items
        n = min(max_samples, len(items))
        return [items.popleft() for _ in range(n)]

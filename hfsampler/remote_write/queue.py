"""Queue: holds one shard's samples between ``push`` and the sender, bounded, oldest dropped first.

``ShardQueue`` is the narrow interface the sender depends on; ``MemoryQueue`` is the in-memory
implementation. A disk-spooling queue (persistent segment files) can replace it behind the same
interface without the sender changing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from hfsampler.remote_write.encoder import QueuedSample


class ShardQueue(Protocol):
    """What a shard needs from its queue."""

    def put(self, samples: Iterable[QueuedSample]) -> int:
        """Enqueue without blocking; returns how many old samples were dropped to make room."""
        ...

    async def get_batch(self, max_samples: int, deadline_s: float) -> list[QueuedSample]:
        """Up to ``max_samples`` samples, oldest first: as soon as that many are queued, or when
        ``deadline_s`` has passed with at least one queued, or at once when flushing. Empty only
        when flushing and nothing is left."""
        ...

    def start_flush(self) -> None:
        """From now on hand out what is queued without waiting for the deadline."""
        ...

    def drain(self) -> list[QueuedSample]:
        """Remove and return everything still queued (at shutdown, to count it)."""
        ...

    def __len__(self) -> int: ...


class MemoryQueue:
    """A bounded deque of samples; when full, the oldest samples make way for new ones."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._items: deque[QueuedSample] = deque()
        self._clock = clock
        self._wanted = 1
        self._ready = asyncio.Event()
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
        if len(items) >= self._wanted:
            self._ready.set()
        return dropped

    def start_flush(self) -> None:
        self._flushing = True
        self._ready.set()

    def drain(self) -> list[QueuedSample]:
        out = list(self._items)
        self._items.clear()
        return out

    async def get_batch(self, max_samples: int, deadline_s: float) -> list[QueuedSample]:
        end = self._clock() + deadline_s
        while True:
            n = len(self._items)
            if n >= max_samples or (self._flushing and n) or (n and self._clock() >= end):
                return self._take(max_samples)
            if self._flushing:
                return []
            # Wake on a full batch; with nothing queued, any sample is worth waking for so the
            # deadline clock below runs against real data.
            self._wanted = max_samples if n else 1
            self._ready.clear()
            remaining = end - self._clock()
            if remaining <= 0:
                # Deadline passed with nothing queued: wait for the first sample, then start over.
                await self._ready.wait()
                end = self._clock() + deadline_s
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), remaining)

    def _take(self, max_samples: int) -> list[QueuedSample]:
        items = self._items
        n = min(max_samples, len(items))
        return [items.popleft() for _ in range(n)]

"""The memory queue's batching against the clock: a batch's deadline is never missed."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from hfsampler.remote_write.blocks import Block, Labels
from hfsampler.remote_write.queue import MemoryQueue

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops


def samples(n: int) -> Block:
    return Block.of([Labels.of([("__name__", f"m{i}")]) for i in range(n)], 1000, [1.0] * n)


async def test_a_deadline_that_passes_between_two_looks_still_sends() -> None:
    """The clock passes the batch's deadline after the queue looked at it and before the wait:
    the queued samples go at once, not when a full batch comes (here: never). Under load this
    hung a shard now and then, with a test's samples queued and never sent."""
    deadline_s = 1.0
    readings = itertools.count(0.0, 0.6 * deadline_s)  # each look at the clock is 0.6 s later
    queue = MemoryQueue(1000, clock=lambda: next(readings))
    queue.put(samples(3))
    batch = await asyncio.wait_for(queue.get_batch(500, deadline_s), 2.0)
    assert batch.count == 3


async def test_nothing_queued_waits_for_the_first_sample_then_its_deadline() -> None:
    queue = MemoryQueue(1000)
    waiting = asyncio.ensure_future(queue.get_batch(500, 0.05))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # nothing to send: no empty batch
    queue.put(samples(2))
    batch = await asyncio.wait_for(waiting, 5.0)
    assert batch.count == 2


def window(ts: int, n: int) -> Block:
    return Block.of([Labels.of([("__name__", f"m{i}")]) for i in range(n)], ts, [1.0] * n)


async def test_a_queue_that_another_window_would_overflow_sends_before_its_deadline() -> None:
    """A bound below max_samples_per_send never fills a batch: with a batch_send_deadline the
    shard waited while each window pushed the oldest out (80% of windows lost at 2 windows and a
    2 s deadline, the receiver healthy). What is queued goes once another window would drop."""
    queue = MemoryQueue(10, clock=lambda: 0.0)  # the deadline never comes
    waiting = asyncio.ensure_future(queue.get_batch(100, 5.0))
    assert queue.put(window(1000, 5)) == 0
    await asyncio.sleep(0)
    assert not waiting.done()  # room for another window: the batch waits
    assert queue.put(window(2000, 5)) == 0
    batch = await asyncio.wait_for(waiting, 2.0)  # a third would overflow: due now
    assert batch.count == 10
    assert queue.put(window(3000, 5)) == 0  # nothing lost

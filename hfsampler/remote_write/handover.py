"""Hand-over: an endpoint's shards stopped at safe points, and what they had not delivered yet.

A reload that changes an endpoint's configuration replaces its writer; the old one hands its
backlog to the new one (``RemoteWriter.hand_over`` / ``take_over``) rather than drop it or race
it. No request on the wire is abandoned: its answer decides whether it was delivered (and
``remote_timeout`` bounds the wait), so nothing goes to the receiver twice or beside the next
writer's newer samples. ``Delivery`` stops a shard, once ``stopping`` is set, before its batch's
first request or at a retry of it; a batch partly delivered (split by a 413) is finished first,
for the deadline at most, then handed over whole, said in a warning. The backlog is blocks, as
every queue holds, so the next writer sends them as 1.0 or 2.0 as it negotiates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.delivery import Delivery
from hfsampler.remote_write.queue import Batch, ShardQueue

log = logging.getLogger(__name__)


async def hand_over(
    delivery: Delivery,
    tasks: Sequence[asyncio.Task[None]],
    queues: Sequence[ShardQueue],
    deadline_s: float,
) -> tuple[list[list[Block]], int]:
    """Stop ``delivery``'s shard ``tasks`` (one per queue) at safe points, close ``queues``:
    per shard, the blocks not delivered yet, oldest first (none from a spool: what is left
    stays spooled, unacknowledged), and how many samples a spool could not write (a full
    disk), for the caller to count."""
    delivery.stopping = True
    loop = asyncio.get_running_loop()
    end = loop.time() + max(0.0, deadline_s)
    pending = set(tasks)
    while pending:
        late = loop.time() >= end
        for i, task in enumerate(tasks):
            flight = delivery.inflight[i]
            partial = flight is not None and flight.settled > 0
            if task in pending and not delivery.posting[i] and (late or not partial):
                task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    left: list[list[Block]] = []
    twice = lost = 0
    for q, flight in zip(queues, delivery.inflight, strict=True):
        blocks: list[Block] = []
        if flight is not None and flight.unsettled:
            twice += flight.settled
            if not q.persistent:  # a spooled batch is still on disk, unacknowledged
                blocks += _memory_blocks(flight.batch)
        if not q.persistent:
            q.start_flush()
            while len(q):
                blocks += _memory_blocks(await q.get_batch(len(q), 0.0))
        lost += await q.close()  # a spool's records it could not write (a full disk)
        left.append(blocks)
    delivery.inflight = [None] * len(queues)
    if twice:
        log.warning(
            "remote write %s (%s): a batch partly delivered when the endpoint's writer was "
            "replaced goes again in full: %d samples may reach the receiver twice",
            delivery.config.remote_name,
            delivery.config.display_url,
            twice,
        )
    return left, lost


def _memory_blocks(batch: Batch) -> list[Block]:
    """A memory queue's batch: blocks only (a ``Wire`` is a spool's record read back)."""
    blocks = [b for b in batch.blocks if isinstance(b, Block)]
    assert len(blocks) == len(batch.blocks), "a memory queue handed out a spooled request"
    return blocks

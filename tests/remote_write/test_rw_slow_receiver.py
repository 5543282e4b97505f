"""A receiver slower than the input for minutes of windows: memory and disk stay bounded, every
sample is delivered, dropped (and counted) or still spooled: none vanishes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from test_rw_sender import FAST, Receiver, labels_of

from hfsampler import selfmetrics as sm
from hfsampler.remote_write.config import EndpointConfig
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import SeriesRegistry, Snapshot

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = [pytest.mark.both_loops, pytest.mark.alone]

GPUS = 8
PER_GPU = 100  # about what a default run exports per GPU per window
WINDOWS = 300  # five minutes of 1 s windows, pushed faster than real time
CAPACITY = 4000
MAX_DISK = 1 << 20


def segment_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.seg"))


class SlowReceiver(Receiver):
    """Accepts everything, but takes 150 ms per request: slower than the input."""

    async def handle(self, request: web.Request) -> web.Response:
        await asyncio.sleep(0.15)
        return await super().handle(request)


async def test_slow_receiver_bounded_memory_and_disk_drops_counted(tmp_path: Path) -> None:
    reg = SeriesRegistry()
    series = [
        reg.series(f"DCGM_FI_DEV_FIELD_{j}", {"gpu": str(g), "UUID": f"GPU-{g:08x}-aaaa-bbbb"})
        for g in range(GPUS)
        for j in range(PER_GPU)
    ]
    async with SlowReceiver() as rx:
        queue = replace(FAST, capacity=CAPACITY, max_samples_per_send=1000, max_disk_bytes=MAX_DISK)
        cfg = EndpointConfig(rx.url, name="slow", queue=queue)
        m = SelfMetrics()
        writer = RemoteWriter(cfg, m, tmp_path)
        await writer.start()
        spool = writer._queues[0]
        assert isinstance(spool, SpoolQueue)
        peak_memory = peak_disk = 0
        started = time.monotonic()
        for t in range(1, WINDOWS + 1):
            writer.push(Snapshot(1000 * t, series, [float(t)] * len(series)))
            await asyncio.sleep(0.01)  # ~80,000 samples/s in against ~6,000 out
            peak_memory = max(peak_memory, spool.memory_samples)
            peak_disk = max(peak_disk, spool.disk_bytes)
        elapsed = time.monotonic() - started
        await writer.close(0.5)
    delivered = len(rx.accepted())
    dropped = m.get(sm.RW_DROPPED, labels_of(cfg, reason="disk_full"))
    reopened = SpoolQueue(tmp_path / "slow" / "shard-0", CAPACITY, MAX_DISK)
    left = len(reopened)
    await reopened.close()
    pushed = WINDOWS * len(series)
    assert delivered == m.get(sm.RW_SAMPLES, labels_of(cfg))
    assert delivered < pushed / 2, "the receiver was not slower than the input"
    assert dropped > 0
    assert delivered + dropped + left == pushed
    # Memory: capacity plus what was not yet encoded and put on disk. Windows come 100x faster
    # than real time here, and encoding runs on the writer's own thread (never on the event loop,
    # so it no longer slows the producer down): on a loaded 2-core runner some 25 windows can
    # wait for it. Unbounded growth would be all 300.
    assert peak_memory <= CAPACITY + 40 * len(series), peak_memory
    assert peak_disk <= MAX_DISK, peak_disk
    assert segment_bytes(tmp_path) <= MAX_DISK
    assert elapsed < 30

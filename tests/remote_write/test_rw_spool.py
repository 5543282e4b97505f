"""SpoolQueue: records on disk, replay in order after a restart, torn tails, bounds, drops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import snappy

from hfsampler.errors import SpoolFormatError
from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.encoder import Encoder, QueuedSample, write_request
from hfsampler.remote_write.prompb import remote_pb2
from hfsampler.remote_write.queue import Batch
from hfsampler.remote_write.segment import MAGIC, recover
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.remote_write.wire import Wire
from hfsampler.series import Series, SeriesRegistry

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops

REG = SeriesRegistry()
SERIES = [REG.series("DCGM_FI_DEV_POWER_USAGE", {"gpu": str(i)}) for i in range(10)]


def window(ts: int, series: list[Series] = SERIES) -> Block:
    samples = [QueuedSample(s, float(ts + i), ts) for i, s in enumerate(series)]
    return Encoder().block(samples)


def raw_of(batch: Batch) -> bytes:
    """A batch's 1.0 bytes: its blocks written, its records kept as requests (``Wire``) as
    they are."""
    return b"".join(
        snappy.uncompress(b.body) if isinstance(b, Wire) else write_request(b) for b in batch.blocks
    )


def decode(batch: Batch) -> list[tuple[str, int, float]]:
    """(gpu, timestamp, value) of every sample in a batch's encoded blocks, in order."""
    raw = raw_of(batch)
    req = remote_pb2.WriteRequest.FromString(raw)
    out = []
    for ts in req.timeseries:
        gpu = next(lb.value for lb in ts.labels if lb.name == "gpu")
        out.extend((gpu, s.timestamp, s.value) for s in ts.samples)
    return out


def segment_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*.seg"))


def cut_tail(root: Path, cut: int) -> None:
    (seg,) = root.glob("*.seg")
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - cut)


def flip_middle_byte(root: Path) -> None:
    (seg,) = root.glob("*.seg")
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))


class Drops:
    def __init__(self) -> None:
        self.by_reason: dict[str, int] = {}

    def __call__(self, n: int, reason: str) -> None:
        self.by_reason[reason] = self.by_reason.get(reason, 0) + n


def spool(path: Path, capacity: int = 1000, max_disk: int = 1 << 30, drops: Drops | None = None):  # type: ignore[no-untyped-def]
    return SpoolQueue(path, capacity, max_disk, drops or Drops())


async def take_all(q: SpoolQueue, ack: bool = True) -> list[tuple[str, int, float]]:
    q.start_flush()
    out = []
    while True:
        batch = await q.get_batch(25, 0.01)
        if not batch.count:
            return out
        out.extend(decode(batch))
        if ack:
            q.ack(batch)


async def test_replay_after_restart_in_order_then_new_records(tmp_path: Path) -> None:
    q = spool(tmp_path)
    for t in range(1, 21):
        q.put(window(1000 * t))
    assert len(q) == 200
    first = await q.get_batch(25, 0.01)  # handed out, never acknowledged: must come back
    assert first.count == 30  # whole records only: three windows
    assert await q.close() == 0
    q2 = spool(tmp_path)
    assert len(q2) == 200
    q2.put(window(21_000))
    got = await take_all(q2)
    stamps = [ts for gpu, ts, _ in got if gpu == "0"]
    assert stamps == [1000 * t for t in range(1, 22)]
    await q2.close()
    # Everything acknowledged: no segment is left but the newest, empty of unsent records.
    q3 = spool(tmp_path)
    assert len(q3) == 0
    await q3.close()


async def test_acknowledged_segments_are_deleted(tmp_path: Path) -> None:
    q = spool(tmp_path, max_disk=1 << 16)  # small segments (16 KiB)
    for t in range(1, 400):
        q.put(window(1000 * t))
        if t % 50 == 0:
            await take_all_nowait(q)
    await take_all_nowait(q)
    await asyncio.sleep(0.05)
    q.put(window(500_000))
    await eventually(lambda: len(list(tmp_path.glob("*.seg"))) <= 2)
    await q.close()


async def take_all_nowait(q: SpoolQueue) -> None:
    while len(q):
        batch = await q.get_batch(10_000, 0.0)
        q.ack(batch)


async def eventually(check, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not check():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("cut", [1, 7, 19, 30])
async def test_torn_tail_is_skipped_not_fatal(tmp_path: Path, cut: int) -> None:
    q = spool(tmp_path)
    for t in range(1, 6):
        q.put(window(1000 * t))
    await q.close()
    cut_tail(tmp_path, cut)  # a crash in the middle of the last record's write
    q2 = spool(tmp_path)
    got = await take_all(q2)
    assert sorted({ts for _, ts, _ in got}) == [1000, 2000, 3000, 4000]
    q2.put(window(6000))
    assert [ts for _, ts, _ in await take_all(q2)] == [6000] * 10
    await q2.close()


async def test_corrupt_record_is_skipped_alone(tmp_path: Path) -> None:
    q = spool(tmp_path)
    for t in range(1, 6):
        q.put(window(1000 * t))
    await q.close()
    flip_middle_byte(tmp_path)  # a flipped bit in the third record
    found = recover(tmp_path)
    assert len(found.segments) == 1
    assert len(found.segments[0].counts) == 4
    assert found.corrupt_samples == 10
    q2 = spool(tmp_path)
    assert sorted({ts for _, ts, _ in await take_all(q2)}) == [1000, 2000, 4000, 5000]
    await q2.close()


async def test_garbage_files_do_not_stop_the_start(tmp_path: Path) -> None:
    (tmp_path / "00000000000000000000.seg").write_bytes(b"junk")
    (tmp_path / "acked").write_bytes(b"xyz")
    (tmp_path / "notes.txt").write_text("left alone")
    q = spool(tmp_path)
    assert len(q) == 0
    q.put(window(1000))
    assert len(await take_all(q)) == 10
    await q.close()
    assert (tmp_path / "notes.txt").exists()


async def test_disk_bound_drops_oldest_and_counts(tmp_path: Path) -> None:
    drops = Drops()
    big = [REG.series("DCGM_FI_DEV_FB_USED", {"gpu": str(i), "x": "y" * 40}) for i in range(200)]
    q = spool(tmp_path, capacity=500, max_disk=1 << 17, drops=drops)
    n = 300
    for t in range(1, n + 1):
        q.put(window(1000 * t, big))
        if t % 20 == 0:
            # Once the writer thread caught up, memory is back within capacity.
            await eventually(lambda: q.memory_samples <= 500)
    await q.close()
    on_disk = segment_bytes(tmp_path)
    assert on_disk <= 1 << 17
    assert drops.by_reason["disk_full"] > 0
    q2 = spool(tmp_path, capacity=500, max_disk=1 << 17, drops=drops)
    got = await take_all(q2)
    stamps = sorted({ts for _, ts, _ in got})
    # What is left is the newest, contiguous; dropped + left = everything put.
    assert stamps[-1] == 1000 * n
    assert stamps == list(range(stamps[0], 1000 * n + 1, 1000))
    assert drops.by_reason["disk_full"] + len(got) == 200 * n
    await q2.close()


async def test_memory_stays_bounded_while_spooling(tmp_path: Path) -> None:
    q = spool(tmp_path, capacity=100)
    for t in range(1, 201):
        q.put(window(1000 * t))
        await asyncio.sleep(0)
    await eventually(lambda: q.memory_samples <= 100)
    assert len(q) == 2000
    got = await take_all(q)
    assert [ts for gpu, ts, _ in got if gpu == "3"] == [1000 * t for t in range(1, 201)]
    await q.close()


def test_segment_starts_with_magic(tmp_path: Path) -> None:
    async def scenario() -> None:
        q = spool(tmp_path)
        q.put(window(1000))
        await q.close()

    asyncio.run(scenario())
    (seg,) = tmp_path.glob("*.seg")
    assert seg.read_bytes().startswith(MAGIC)
    # The ack file is made at the start, while there is space, and says nothing was delivered.
    assert (tmp_path / "acked").stat().st_size == 32
    assert recover(tmp_path).acked == 0


def write_segment(root: Path, data: bytes) -> None:
    (root / f"{0:020d}.seg").write_bytes(data)


@pytest.mark.parametrize("magic", [b"HFSPOOL3", b"HFSPOOL2", b"HFSPOOL1", b"HFSPOOL6"])
def test_a_segment_of_another_format_is_refused_naming_file_and_version(
    tmp_path: Path, magic: bytes
) -> None:
    """Nothing was released that wrote another format: one clear line, not a conversion."""
    write_segment(tmp_path, magic + b"\xf3HR3" + bytes(40))
    with pytest.raises(SpoolFormatError) as refused:
        SpoolQueue(tmp_path, 1000, 1 << 20)
    line = str(refused.value)
    assert "\n" not in line
    assert str(tmp_path / f"{0:020d}.seg") in line
    assert magic.decode() in line
    assert MAGIC.decode() in line
    assert refused.value.key == "queue_dir"
    # the lock was let go: once the file is moved away the directory opens
    (tmp_path / f"{0:020d}.seg").rename(tmp_path / "old.seg.moved")
    asyncio.run(SpoolQueue(tmp_path, 1000, 1 << 20).close())

"""A 1.0 endpoint's spool keeps each record as the request it makes (``wire``): joined as stored,
the requests decode to what the blocks hold; its faults (damaged or cut bytes, a record whose
header and bytes disagree) cost that record only, counted; segments written before this layout
(``HFSPOOL4``) read back; a drain reaches receivers with every sample, in order, and cut at
series on a 413."""

from __future__ import annotations

import logging
import shutil
import struct
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import snappy
from test_rw_sender import FAST, Receiver, labels_of, make_series, snap
from test_rw_spool import Drops, eventually, take_all, window

from hfsampler import selfmetrics as sm
from hfsampler.remote_write.blocks import Block, Labels, merge
from hfsampler.remote_write.config import DRAIN_SAMPLES, EndpointConfig, QueueConfig
from hfsampler.remote_write.encoder import RequestEncoderV1, write_request
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.prompb import remote_pb2
from hfsampler.remote_write.segment import LEGACY_MAGIC, MAGIC, frame, recover
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.remote_write.wire import Wire, join, to_block
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Family

pytestmark = pytest.mark.both_loops

LOGGER = "hfsampler.remote_write.spool"
HEAD = 28  # a record's header: magic, its CRC, length, count, seq, the payload's CRC
V4 = Path(__file__).parents[1] / "support" / "spool_hfspool4"


def wire_spool(path: Path, drops: Drops | None = None, capacity: int = 1000) -> SpoolQueue:
    return SpoolQueue(path, capacity, 1 << 30, drops or Drops(), wire=True)


def same(a: Block, b: Block) -> None:
    assert [s.v1 for s in a.series] == [s.v1 for s in b.series]
    assert a.ends.tolist() == b.ends.tolist()
    assert a.timestamps_ms.tolist() == b.timestamps_ms.tolist()
    assert a.values.view(np.uint64).tolist() == b.values.view(np.uint64).tolist()
    assert a.families == b.families


def only_segment(root: Path) -> Path:
    (seg,) = root.glob("*.seg")
    return seg


async def spooled(root: Path, windows: int) -> None:
    """``windows`` windows of 10 samples in a wire spool, all on disk."""
    q = wire_spool(root)
    for t in range(1, windows + 1):
        q.put(window(1000 * t))
    await q.close()


# -- the bytes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 7])
def test_joined_requests_are_the_requests_back_to_back(count: int) -> None:
    fam = Family("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge", "W")
    v1 = RequestEncoderV1()
    blocks = [window(1000 * (t + 1)) for t in range(count)]
    first = blocks[0]
    blocks[0] = Block(first.series, first.ends, first.timestamps_ms, first.values, (fam,))
    wires = [Wire.of(b, v1) for b in blocks]
    joined = join(wires)
    raw = snappy.uncompress(joined.body)
    assert raw == b"".join(write_request(b) for b in blocks)  # compressed once, never again
    assert joined.raw_len == len(raw)
    assert joined.samples == 10 * count
    request = remote_pb2.WriteRequest.FromString(raw)
    assert len(request.timeseries) == 10 * count  # each series once per window
    assert [m.metric_family_name for m in request.metadata] == [fam.name]
    same(to_block(joined), merge(blocks))  # and decoded, the samples merge does


def test_join_refuses_a_body_whose_length_varint_is_not_its_raw_length() -> None:
    wire = Wire.of(window(1000), RequestEncoderV1())
    with pytest.raises(ValueError, match="length varint"):
        join([wire, Wire(wire.body, wire.raw_len + 1, wire.samples)])


def test_to_block_refuses_bytes_that_are_no_request() -> None:
    with pytest.raises(ValueError, match="not a compressed"):
        to_block(Wire(snappy.compress(b"\xff\xff\xff"), 3, 1))


# -- the spool -----------------------------------------------------------------------------------


async def test_records_read_back_are_the_requests_as_stored(tmp_path: Path) -> None:
    await spooled(tmp_path, 20)
    assert only_segment(tmp_path).read_bytes().startswith(MAGIC)
    q = wire_spool(tmp_path)
    q.start_flush()
    batch = await q.get_batch(25, 0.0)
    assert all(isinstance(p, Wire) for p in batch.blocks)  # no decoding on the way out
    assert batch.count == 30  # whole records, as block records
    got = snappy.uncompress(join([p for p in batch.blocks if isinstance(p, Wire)]).body)
    assert got == b"".join(write_request(window(1000 * t)) for t in (1, 2, 3))
    await q.close()


async def test_a_record_sent_from_memory_once_written_is_the_request_written(
    tmp_path: Path,
) -> None:
    q = wire_spool(tmp_path)
    for t in (1, 2, 3):
        q.put(window(1000 * t))
    await eventually(lambda: q.disk_bytes > 0 and q.memory_samples == 30)
    q.start_flush()
    batch = await q.get_batch(30, 0.0)
    assert batch.count == 30
    assert all(isinstance(p, Wire) for p in batch.blocks)  # not written and compressed again
    got = snappy.uncompress(join([p for p in batch.blocks if isinstance(p, Wire)]).body)
    assert got == b"".join(write_request(window(1000 * t)) for t in (1, 2, 3))
    await q.close()


async def test_a_block_with_native_histograms_is_spooled_packed_not_as_a_request(
    tmp_path: Path,
) -> None:
    """A refusal of native histograms takes them out of what is queued: a record holding them
    stays a block, whatever the endpoint's protocol."""
    floats = window(1000)
    labels = Labels.of([("__name__", "DCGM_FI_DEV_POWER_USAGE_histogram"), ("gpu", "0")])
    series = (*floats.series, labels)
    mixed = Block.of(series, 1000, [*floats.values.tolist(), 3.0], hist=[b""] * 10 + [b"\x08\x03"])
    q = wire_spool(tmp_path)
    q.put(mixed)
    q.put(window(2000))
    await q.close()
    q = wire_spool(tmp_path)
    q.start_flush()
    batch = await q.get_batch(100, 0.0)
    await q.close()
    first, second = batch.blocks
    assert isinstance(first, Block)
    assert first.hist is not None
    assert first.hist.tolist()[-1] == b"\x08\x03"
    assert isinstance(second, Wire)


async def test_a_drain_reads_records_of_up_to_drain_samples(tmp_path: Path) -> None:
    await spooled(tmp_path, 20)
    q = SpoolQueue(tmp_path, 1000, 1 << 30, Drops(), wire=True, drain_samples=60)
    batch = await q.get_batch(25, 0.0)  # a backlog in the files: 60, not 25
    assert batch.count == 60
    await q.close()


def test_drain_samples_keeps_to_a_max_samples_per_send_the_user_changed() -> None:
    assert QueueConfig().drain_samples == DRAIN_SAMPLES
    assert QueueConfig(max_samples_per_send=500).drain_samples == 500
    assert QueueConfig(max_samples_per_send=20000).drain_samples == 20000
    assert QueueConfig(max_samples_per_drain_send=3000).drain_samples == 3000


@pytest.mark.parametrize("where", ["payload", "tail"])
async def test_a_damaged_or_cut_byte_section_costs_that_record_only(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    await spooled(tmp_path, 20)
    seg = only_segment(tmp_path)
    offsets = recover(tmp_path).segments[0].offsets
    data = bytearray(seg.read_bytes())
    if where == "payload":
        at = offsets[9] + HEAD + 40  # inside the tenth record's compressed request
        data[at] ^= 0xFF
        lost = [10]
    else:
        data = data[: offsets[19] + HEAD + 30]  # the last record's bytes cut short
        lost = [20]
    seg.write_bytes(bytes(data))
    drops = Drops()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        q = wire_spool(tmp_path, drops)
    got = await take_all(q)
    await q.close()
    assert [ts for gpu, ts, _ in got if gpu == "0"] == [
        1000 * t for t in range(1, 21) if t not in lost
    ]
    assert drops.by_reason == {"corrupt": 10}
    assert any("damaged" in r.getMessage() for r in caplog.records)


async def test_a_record_whose_header_and_bytes_disagree_is_dropped_counted(
    tmp_path: Path,
) -> None:
    """A record intact by its checksums whose raw length is not what its snappy bytes say
    (written so by a bug, not by damage): not sent, counted as corrupt; the others go."""
    await spooled(tmp_path, 3)
    seg = only_segment(tmp_path)
    scanned = recover(tmp_path).segments[0]
    data = seg.read_bytes()
    start = scanned.offsets[1]
    length = struct.unpack_from("<I", data, start + 8)[0]
    payload = bytearray(data[start + HEAD : start + HEAD + length])
    struct.pack_into("<I", payload, 1, struct.unpack_from("<I", payload, 1)[0] + 1)
    forged = frame(scanned.first_seq + scanned.rel[1], 10, bytes(payload))
    assert zlib.crc32(bytes(payload)) == struct.unpack_from("<I", forged, 24)[0]  # intact
    seg.write_bytes(data[:start] + forged + data[start + HEAD + length :])
    drops = Drops()
    q = wire_spool(tmp_path, drops)
    got = await take_all(q)
    await q.close()
    assert [ts for gpu, ts, _ in got if gpu == "0"] == [1000, 3000]
    assert drops.by_reason == {"corrupt": 10}


async def test_a_spool_written_before_this_layout_reads_back(tmp_path: Path) -> None:
    """``spool_hfspool4`` was written by 5c00df9 (6 windows of 10 series, the second with its
    family's metadata, the first acknowledged): packed blocks without a kind byte."""
    root = tmp_path / "shard-0"
    shutil.copytree(V4, root)
    assert only_segment(root).read_bytes().startswith(LEGACY_MAGIC)
    for wire in (True, False):  # whichever protocol the endpoint has now
        q = SpoolQueue(root, 1000, 1 << 30, Drops(), wire=wire)
        assert len(q) == 50
        q.start_flush()
        batch = await q.get_batch(1000, 0.0)
        await q.close()
        assert all(isinstance(p, Block) for p in batch.blocks)
        block = merge([p for p in batch.blocks if isinstance(p, Block)])
        assert block.timestamps_ms.tolist()[:5] == [2000, 3000, 4000, 5000, 6000]
        assert block.values.tolist()[:5] == [200.5, 300.5, 400.5, 500.5, 600.5]
        assert [f.name for f in block.families] == ["DCGM_FI_DEV_POWER_USAGE"]
        assert (
            dict(zip(block.series[3].strings[::2], block.series[3].strings[1::2], strict=True))[
                "UUID"
            ]
            == "GPU-00000003"
        )


# -- delivery ------------------------------------------------------------------------------------

SERIES = 50
WINDOWS = 40


async def backlog_then_receiver(
    tmp_path: Path, rx: Receiver, queue: QueueConfig, port_url: str
) -> SelfMetrics:
    """``WINDOWS`` windows spooled while nobody listens at ``port_url``; then delivered to ``rx``
    by a writer started afresh on the same spool (every record read back from the files)."""
    cfg = EndpointConfig(port_url, name="t", queue=queue)
    writer = RemoteWriter(cfg, SelfMetrics(), tmp_path)
    series = make_series(SERIES)
    for t in range(WINDOWS):
        writer.push(snap(series, 1000 * (t + 1), base=float(t)))
    await writer.close(5)  # never started: everything stays spooled
    metrics = SelfMetrics()
    writer = RemoteWriter(replace(cfg, url=rx.url), metrics, tmp_path)
    await writer.start()
    await eventually(lambda: metrics.total(sm.RW_SAMPLES) >= SERIES * WINDOWS)
    await writer.close(5)
    return metrics


def per_series(rx: Receiver) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for key, ts, _ in rx.accepted():
        out.setdefault(key, []).append(ts)
    return out


async def test_a_drain_sends_the_records_joined_every_sample_once_in_order(
    tmp_path: Path,
) -> None:
    async with Receiver() as rx:
        queue = replace(FAST, max_samples_per_drain_send=SERIES * 8)
        m = await backlog_then_receiver(tmp_path, rx, queue, "http://127.0.0.1:9/api/v1/write")
        sent = m.get(sm.RW_BYTES, labels_of(EndpointConfig(rx.url, name="t")))
    assert m.total(sm.RW_DROPPED) == 0
    assert sent == sum(r.size for r in rx.received)
    stamps = per_series(rx)
    assert len(stamps) == SERIES
    assert all(ts == [1000 * (t + 1) for t in range(WINDOWS)] for ts in stamps.values())
    # requests of up to 8 windows (9 with the record that crosses the bound), a series once
    # per window in each
    assert len(rx.received) <= WINDOWS // 8 + 1
    assert max(len(r.request.timeseries) for r in rx.received) <= 9 * SERIES


async def test_a_413_to_joined_records_cuts_them_at_series(tmp_path: Path) -> None:
    async with Receiver(max_body_bytes=16 << 10) as rx:
        queue = replace(FAST, max_samples_per_drain_send=SERIES * WINDOWS)
        m = await backlog_then_receiver(tmp_path, rx, queue, "http://127.0.0.1:9/api/v1/write")
    statuses = [r.status for r in rx.received]
    assert 413 in statuses
    assert m.total(sm.RW_DROPPED) == 0
    stamps = per_series(rx)
    assert all(sorted(ts) == [1000 * (t + 1) for t in range(WINDOWS)] for ts in stamps.values())
    assert sum(len(ts) for ts in stamps.values()) == SERIES * WINDOWS  # none twice
    assert max(r.size for r in rx.received if r.status == 204) <= 16 << 10


def test_labels_decoded_are_the_labels_encoded() -> None:
    labels = Labels.of([("__name__", "x"), ("gpu", "0"), ("UUID", "GPU-\u00e9")])
    block = Block.of([labels, labels], [1000, 2000], [1.0, float("nan")])
    back = to_block(Wire.of(block, RequestEncoderV1()))
    assert back.series[0].v1 == labels.v1
    same(back, block)

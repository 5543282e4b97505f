"""Blocks with native-histogram series: merged, cut and sized as bytes, written as 1.0 and 2.0
exactly as the protobuf library writes the same messages, packed for the spool (records of the
format before histograms still read), and kept by a spool across a restart."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from histograms_check import fill_message, histogram_problems

from hfsampler.histograms import HistogramAccumulator, NativeHistogram
from hfsampler.remote_write.blocks import (
    Block,
    Labels,
    Sizer,
    Unpacker,
    halve,
    merge,
    pack,
    piece_sizes,
    split,
)
from hfsampler.remote_write.encoder import RequestEncoderV1, write_request
from hfsampler.remote_write.encoder_v2 import RequestEncoderV2
from hfsampler.remote_write.histwrite import histogram_body
from hfsampler.remote_write.prompb import remote_pb2, types_pb2, writev2_pb2
from hfsampler.remote_write.protowrite import METRIC_TYPES, metadata_entry
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.series import Family

POWER = Family("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge")
HIST = Family("DCGM_FI_DEV_POWER_USAGE_histogram", "Power draw (in W), every sample.", "histogram")
FAMILIES = {f.name: f for f in (POWER, HIST)}
T0 = 1_700_000_000_000


def labels(name: str, gpu: int) -> Labels:
    return Labels.of([("__name__", name), ("gpu", str(gpu))])


FLOATS = [labels(POWER.name, g) for g in range(3)]
HISTS = [labels(HIST.name, g) for g in range(2)]


def snapshots(windows: int, gpus: int = 2) -> list[list[NativeHistogram]]:
    """Per window, each GPU's cumulative histogram of known power samples."""
    rng = np.random.default_rng(7)
    accs = [HistogramAccumulator(3) for _ in range(gpus)]
    out = []
    for _ in range(windows):
        for acc in accs:
            acc.add(rng.normal(300, 80, 200).clip(0))
        out.append([acc.snapshot() for acc in accs])
    return out


def window(ts: int, hists: list[NativeHistogram], values: tuple[float, ...] = (1, 2, 3)) -> Block:
    series = [*FLOATS, *HISTS]
    vals = [*values, *(float(h.count) for h in hists)]
    bodies = [b""] * len(FLOATS) + [histogram_body(h) for h in hists]
    return Block.of(series, ts, vals, [POWER, HIST], hist=bodies)


def expected_v1(blocks: list[tuple[int, list[NativeHistogram], tuple[float, ...]]]) -> bytes:
    """The 1.0 WriteRequest of those windows merged, as the protobuf library writes it."""
    req = remote_pb2.WriteRequest()
    for lab in [*FLOATS, *HISTS]:
        ts = req.timeseries.add()
        for name, value in zip(lab.strings[::2], lab.strings[1::2], strict=True):
            ts.labels.add(name=name, value=value)
        for stamp, hists, values in blocks:
            if lab in FLOATS:
                ts.samples.add(value=values[FLOATS.index(lab)], timestamp=stamp)
            else:
                fill_message(ts.histograms.add(), hists[HISTS.index(lab)], stamp)
    for family in (POWER, HIST) * len(blocks):
        req.metadata.add(
            type=METRIC_TYPES[family.type], metric_family_name=family.name, help=family.help
        )
    return req.SerializeToString(deterministic=True)


def test_v1_bytes_are_the_librarys_and_sizes_are_exact() -> None:
    snaps = snapshots(3)
    rows = [(T0 + 1000 * i, snaps[i], (1.0 + i, 2.0, 3.0)) for i in range(3)]
    merged = merge([window(*row) for row in rows])
    assert merged.histogram_samples == 6
    raw = write_request(merged)
    assert raw == expected_v1(rows)
    assert RequestEncoderV1().encode(merged) == raw
    assert sum(piece_sizes(merged)) == len(raw)
    parsed = remote_pb2.WriteRequest.FromString(raw)
    hist_series = [ts for ts in parsed.timeseries if ts.histograms]
    assert len(hist_series) == 2
    assert not any(ts.samples for ts in hist_series)
    assert [h.timestamp for h in hist_series[0].histograms] == [r[0] for r in rows]
    assert all(histogram_problems(h) == [] for ts in hist_series for h in ts.histograms)
    assert parsed.metadata[1].type == types_pb2.MetricMetadata.HISTOGRAM


def test_v2_bytes_are_the_librarys() -> None:
    snaps = snapshots(2)
    merged = merge([window(T0, snaps[0]), window(T0 + 1000, snaps[1])])
    raw, samples = RequestEncoderV2(lambda: FAMILIES).encode(merged)
    assert samples == 10
    req = writev2_pb2.Request()
    symbols: dict[str, int] = {"": 0}

    def ref(text: str) -> int:
        return symbols.setdefault(text, len(symbols))

    for lab in [*FLOATS, *HISTS]:
        ts = req.timeseries.add()
        ts.labels_refs.extend(ref(s) for s in lab.strings)
        family = FAMILIES[lab.name]
        if lab in FLOATS:
            value = 1.0 + FLOATS.index(lab)
            ts.samples.add(value=value, timestamp=T0)
            ts.samples.add(value=value, timestamp=T0 + 1000)
        else:
            for stamp, hists in ((T0, snaps[0]), (T0 + 1000, snaps[1])):
                fill_message(ts.histograms.add(), hists[HISTS.index(lab)], stamp)
        ts.metadata.type = METRIC_TYPES[family.type]
        ts.metadata.help_ref = ref(family.help)
    req.symbols.extend(symbols)
    assert raw == req.SerializeToString(deterministic=True)
    parsed = writev2_pb2.Request.FromString(raw)
    assert parsed.timeseries[3].metadata.type == writev2_pb2.Metadata.METRIC_TYPE_HISTOGRAM


def test_a_windows_sizes_are_kept_for_its_floats_and_counted_for_its_histograms() -> None:
    sizer = Sizer()
    for i, hists in enumerate(snapshots(3)):
        block = Block.of([*FLOATS, *HISTS], T0 + i, [1.0, 2.0, 3.0, 4.0, 5.0],
                         hist=[b"", b"", b"", *(histogram_body(h) for h in hists)])  # fmt: skip
        assert sizer(block) == piece_sizes(block)
        assert sum(sizer(block)) == len(write_request(block))
        assert RequestEncoderV1().encode(block) == write_request(block)


@pytest.mark.parametrize("windows", [1, 4, 10])  # few samples are sized without numpy
def test_sizes_are_the_bytes_written(windows: int) -> None:
    merged = merge([window(T0 + 1000 * i, h) for i, h in enumerate(snapshots(windows))])
    series = [len(write_request(merged.take(i, i + 1))) for i in range(5)]
    assert piece_sizes(merged) == series + [len(metadata_entry(f)) for f in merged.families]


def test_split_and_halve_keep_histograms_with_their_series() -> None:
    snaps = snapshots(4)
    merged = merge([window(T0 + 1000 * i, snaps[i]) for i in range(4)])
    sizes = piece_sizes(merged)
    pieces = split(merged, max(sizes[:5]) + 1)
    assert len(pieces) >= 5
    assert b"".join(write_request(p) for p in pieces) == write_request(merged)
    assert sum(p.histogram_samples for p in pieces) == 8
    halves = halve(merged)
    assert halves is not None
    assert b"".join(write_request(p) for p in halves) == write_request(merged)
    assert all(sum(piece_sizes(p)) == len(write_request(p)) for p in (*pieces, *halves))


def test_without_histograms_keeps_every_float() -> None:
    snaps = snapshots(2)
    merged = merge([window(T0, snaps[0]), window(T0 + 1000, snaps[1], (4, 5, 6))])
    floats = merged.without_histograms()
    assert floats.hist is None
    assert floats.series == tuple(FLOATS)
    assert floats.values.tolist() == [1, 4, 2, 5, 3, 6]
    assert floats.families == merged.families
    only = Block.of(HISTS, T0, [1.0, 1.0], hist=[histogram_body(h) for h in snaps[0]])
    assert only.without_histograms().samples == 0


def test_pack_round_trip_with_histograms() -> None:
    snaps = snapshots(2)
    merged = merge([window(T0, snaps[0]), window(T0 + 1000, snaps[1])])
    back = Unpacker().unpack(pack(merged))
    assert write_request(back) == write_request(merged)
    assert back.histogram_samples == 4
    with pytest.raises(ValueError, match="trailing bytes"):
        Unpacker().unpack(pack(merged) + b"\x00")


def old_layout_pack(block: Block) -> bytes:
    """A record as the spool wrote it before histograms (the layout blocks.py's docstring gave),
    written here independently of ``pack``."""
    u32 = struct.Struct("<I")

    def strings(items: tuple[str, ...]) -> bytes:
        enc = [s.encode() for s in items]
        return u32.pack(len(enc)) + b"".join(u32.pack(len(e)) + e for e in enc)

    out = struct.pack("<III", len(block.series), block.samples, len(block.families))
    out += b"".join(struct.pack("<q", t) for t in block.timestamps_ms.tolist())
    out += b"".join(struct.pack("<d", v) for v in block.values.tolist())
    out += b"".join(u32.pack(e) for e in block.ends.tolist())
    for lab in block.series:
        packed = strings(lab.strings)
        out += u32.pack(len(packed)) + packed
    for f in block.families:
        packed = strings((f.name, f.help, f.type, f.unit))
        out += u32.pack(len(packed)) + packed
    return out


def test_a_record_of_the_old_format_reads_back_unchanged() -> None:
    block = Block.of(FLOATS, T0, [1.5, 2.5, 3.5], [POWER])
    old = old_layout_pack(block)
    assert pack(block) == old  # a record without histograms is what it always was
    back = Unpacker().unpack(old)
    assert back.hist is None
    assert write_request(back) == write_request(block)


@pytest.mark.both_loops
async def test_a_spooled_histogram_survives_a_restart(tmp_path: Path) -> None:
    drops: list[tuple[int, str]] = []
    snaps = snapshots(2)
    q = SpoolQueue(tmp_path, 1000, 1 << 20, lambda n, why: drops.append((n, why)))
    blocks = [window(T0, snaps[0]), window(T0 + 1000, snaps[1])]
    for block in blocks:
        q.put(block)
    assert await q.close() == 0
    again = SpoolQueue(tmp_path, 1000, 1 << 20, lambda n, why: drops.append((n, why)))
    again.start_flush()
    batch = await again.get_batch(100, 0.01)
    assert batch.count == 10
    assert write_request(merge(batch.blocks)) == write_request(merge(blocks))
    again.ack(batch)
    await again.close()
    assert drops == []

"""The Remote-Write 2.0 encoder against the protobuf library: what it writes parses to the request
the 1.0 bytes describe, with a symbol table, label references in byte order and metadata."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st
from test_rw_encoder import batches, bits

from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.encoder import Encoder, QueuedSample, RequestEncoderV1, write_request
from hfsampler.remote_write.encoder_v2 import RequestEncoderV2
from hfsampler.remote_write.prompb import writev2_pb2
from hfsampler.series import STALE_NAN, Family, SeriesRegistry, is_stale

TYPES = {"gauge": 2, "counter": 1}


def resolve(req: writev2_pb2.Request) -> list[object]:
    """Each series as (labels, samples as bits, metadata strings): what a receiver stores."""
    sym = list(req.symbols)
    out: list[object] = []
    for ts in req.timeseries:
        refs = list(ts.labels_refs)
        labels = [(sym[refs[i]], sym[refs[i + 1]]) for i in range(0, len(refs), 2)]
        samples = [(bits(s.value), s.timestamp, s.start_timestamp) for s in ts.samples]
        meta = (ts.metadata.type, sym[ts.metadata.help_ref], sym[ts.metadata.unit_ref])
        out.append((labels, samples, meta))
    return out


@given(batches(), st.sampled_from([0, 1_700_000_000_000]))
def test_v2_parses_to_what_the_v1_bytes_describe(
    batch: tuple[list[QueuedSample], list[Family]], start_ms: int
) -> None:
    samples, families = batch
    by_name = {f.name: f for f in families}
    block = Encoder().block(samples, families)
    encoder = RequestEncoderV2(lambda: by_name, lambda f: start_ms)
    raw_v2, count = encoder.encode(block)
    req = writev2_pb2.Request.FromString(raw_v2)
    assert count == len(samples)
    assert req.symbols[0] == ""
    assert len(set(req.symbols)) == len(req.symbols)  # each string once
    expected: list[object] = []
    order: dict[int, int] = {}
    for s, value, ts in samples:  # one TimeSeries per series, first-seen order, as 1.0
        if s.id not in order:
            order[s.id] = len(expected)
            fam = by_name.get(s.name, Family("", "", "unknown"))
            meta = (TYPES.get(fam.type, 0), fam.help, fam.unit)
            expected.append((list(s.all_labels()), [], meta))
        counter = by_name.get(s.name, Family("", "", "")).type == "counter"
        start = start_ms if counter and ts >= start_ms else 0  # none before the start
        expected[order[s.id]][1].append((bits(value), ts, start))  # type: ignore[index]
    assert resolve(req) == expected
    # encoding again from a warm cache gives the same bytes
    assert encoder.encode(block) == (raw_v2, count)


def test_stale_marker_bits_survive_v2() -> None:
    reg = SeriesRegistry()
    s = reg.series("DCGM_FI_DEV_GPU_TEMP", {"gpu": "3", "UUID": "GPU-1", "Hostname": "n"})
    block = Encoder().block([QueuedSample(s, STALE_NAN, 5000)])
    raw_v2, _ = RequestEncoderV2(dict).encode(block)
    (ts,) = writev2_pb2.Request.FromString(raw_v2).timeseries
    assert is_stale(ts.samples[0].value)
    assert struct.pack("<d", ts.samples[0].value) == struct.pack("<d", STALE_NAN)


def test_symbols_shared_across_series_and_windows() -> None:
    """A window of many GPUs' series sends each label string once per request."""
    reg = SeriesRegistry()
    series = [
        reg.series(f"DCGM_FI_DEV_{m}", {"gpu": str(g), "Hostname": "node-17", "cluster": "fra1"})
        for g in range(8)
        for m in ("POWER_USAGE", "GPU_TEMP", "SM_CLOCK")
    ]
    samples = [QueuedSample(s, 1.0, 1000 * w) for w in range(1, 4) for s in series]
    block = Encoder().block(samples)
    raw_v1 = write_request(block)
    raw_v2, count = RequestEncoderV2(dict).encode(block)
    req = writev2_pb2.Request.FromString(raw_v2)
    assert count == len(samples)
    # "", 3 label names + __name__, 3 metric names, 8 gpu values, node-17, fra1
    assert len(req.symbols) == 1 + 4 + 3 + 8 + 2
    assert len(raw_v2) < len(raw_v1) / 2


def test_start_timestamp_never_after_the_sample_and_unknown_families_not_cached() -> None:
    reg = SeriesRegistry()
    s = reg.series("hfsampler_windows_total", {"Hostname": "n"})
    families: dict[str, Family] = {}
    encoder = RequestEncoderV2(lambda: families, lambda f: 5000)
    raw = Encoder().block([QueuedSample(s, 1.0, 1000), QueuedSample(s, 2.0, 6000)])
    (ts,) = writev2_pb2.Request.FromString(encoder.encode(raw)[0]).timeseries
    assert ts.metadata.type == 0  # not known yet: a spool replayed before the first window
    families[s.name] = Family(s.name, "Windows.", "counter")
    (ts,) = writev2_pb2.Request.FromString(encoder.encode(raw)[0]).timeseries
    assert ts.metadata.type == 1  # known now: the earlier answer was not cached
    # a sample spooled before this process started gets no start timestamp
    assert [(x.timestamp, x.start_timestamp) for x in ts.samples] == [(1000, 0), (6000, 5000)]


def test_steady_windows_written_from_templates_equal_the_first() -> None:
    """Later windows of the same series come from a template: the same bytes as written anew."""
    reg = SeriesRegistry()
    series = [reg.series("DCGM_FI_DEV_POWER_USAGE", {"gpu": str(g)}) for g in range(5)]
    families = {"DCGM_FI_DEV_POWER_USAGE": Family("DCGM_FI_DEV_POWER_USAGE", "Power.", "gauge")}
    enc, v1 = Encoder(), RequestEncoderV1()
    v2, fresh_v2 = RequestEncoderV2(lambda: families), RequestEncoderV2(lambda: families)
    for w, ts in enumerate([1000, 2000, 2**40, 2**40 + 1000]):  # timestamps of two widths
        values = [STALE_NAN if g == w else float(w * 10 + g) for g in range(5)]
        block = enc.block([QueuedSample(s, v, ts) for s, v in zip(series, values, strict=True)])
        assert v1.encode(block) == write_request(block)
        raw_v2, count = v2.encode(block)
        assert count == 5
        assert raw_v2 == RequestEncoderV2(lambda: families).encode(block)[0]
        req = writev2_pb2.Request.FromString(raw_v2)
        got = [(bits(s.value), s.timestamp) for t in req.timeseries for s in t.samples]
        assert got == [(bits(v), ts) for v in values]
    assert fresh_v2.encode(block) == v2.encode(block)


def test_one_sample_per_series_at_several_timestamps_written_as_anew() -> None:
    """A block of one sample per series whose timestamps differ (a drain's merge of series from
    different windows) takes the template when every timestamp's varint is as wide, and is
    written series by series when not: the same bytes either way, 1.0 and 2.0."""
    reg = SeriesRegistry()
    series = [reg.series("DCGM_FI_DEV_GPU_TEMP", {"gpu": str(g)}) for g in range(4)]
    families = {"DCGM_FI_DEV_GPU_TEMP": Family("DCGM_FI_DEV_GPU_TEMP", "Temp.", "gauge", "C")}
    labels = [Encoder().labels(s) for s in series]
    v1, v2 = RequestEncoderV1(), RequestEncoderV2(lambda: families)
    for stamps in ([1000, 2000, 3000, 4000], [2**40, 2**40 + 7, 2**40 + 9, 2**40 + 11],
                   [100, 1000, 2**40, -1], [5, 5, 5, 5]):  # fmt: skip
        values = [1.5, -0.0, STALE_NAN, 1e300]
        block = Block.of(labels, stamps, values)
        assert v1.encode(block) == write_request(block)
        raw_v2 = v2.encode(block)[0]
        assert raw_v2 == RequestEncoderV2(lambda: families).encode(block)[0]
        req = writev2_pb2.Request.FromString(raw_v2)
        got = [(bits(s.value), s.timestamp) for t in req.timeseries for s in t.samples]
        assert got == [(bits(v), t) for v, t in zip(values, stamps, strict=True)]

"""The hand-written Remote-Write encoder produces exactly what the protobuf library would."""

from __future__ import annotations

import math
import struct

import snappy
from hypothesis import given
from hypothesis import strategies as st

from hfsampler.remote_write.blocks import Block, Sizer, piece_sizes
from hfsampler.remote_write.encoder import Encoder, QueuedSample, compress, write_request
from hfsampler.remote_write.prompb import remote_pb2, types_pb2
from hfsampler.remote_write.protowrite import encode_metadata, varint
from hfsampler.series import STALE_NAN, Family, SeriesRegistry, Snapshot, is_stale

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
OTHER_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000123))[0]
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([STALE_NAN, OTHER_NAN, -0.0, 0.0, math.inf, -math.inf, 5e-324]),
)
METRIC_NAMES = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
LABEL_NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True).filter(
    lambda n: n != "__name__"
)
LABEL_VALUES = st.text(min_size=1, max_size=20).filter(lambda s: "\ud800" not in s)
LABELS = st.dictionaries(LABEL_NAMES, LABEL_VALUES, max_size=6)


def bits(value: float) -> int:
    return int(struct.unpack("<Q", struct.pack("<d", value))[0])


def reference(samples: list[QueuedSample], families: list[Family]) -> remote_pb2.WriteRequest:
    """What the protobuf library builds: one TimeSeries per series in first-seen order."""
    req = remote_pb2.WriteRequest()
    by_id: dict[int, types_pb2.TimeSeries] = {}
    for series, value, ts in samples:
        msg = by_id.get(series.id)
        if msg is None:
            msg = req.timeseries.add()
            by_id[series.id] = msg
            for name, lv in series.all_labels():
                msg.labels.add(name=name, value=lv)
        msg.samples.add(value=value, timestamp=ts)
    for fam in sorted(families, key=lambda f: f.name):
        mtype = {"gauge": 2, "counter": 1}.get(fam.type, 0)
        req.metadata.add(type=mtype, metric_family_name=fam.name, help=fam.help, unit=fam.unit)
    return req


def canonical(req: remote_pb2.WriteRequest) -> object:
    """A comparable form that tells NaN payloads apart (NaN != NaN in message equality)."""
    return (
        [
            (
                [(lb.name, lb.value) for lb in ts.labels],
                [(bits(s.value), s.timestamp) for s in ts.samples],
            )
            for ts in req.timeseries
        ],
        [(m.type, m.metric_family_name, m.help, m.unit) for m in req.metadata],
    )


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[QueuedSample], list[Family]]:
    reg = SeriesRegistry()
    pool = [
        reg.series(draw(METRIC_NAMES), draw(LABELS))
        for _ in range(draw(st.integers(min_value=1, max_value=8)))
    ]
    picks = draw(st.lists(st.tuples(st.sampled_from(pool), VALUES, INT64), max_size=40))
    families = [
        Family(
            name,
            draw(st.text(max_size=30)),
            draw(st.sampled_from(["gauge", "counter"])),
            draw(st.sampled_from(["", "watts", "bytes"])),
        )
        for name in draw(st.sets(METRIC_NAMES, max_size=4))
    ]
    return [QueuedSample(s, v, t) for s, v, t in picks], families


@given(batches())
def test_fast_path_parses_to_what_protobuf_builds(
    batch: tuple[list[QueuedSample], list[Family]],
) -> None:
    samples, families = batch
    enc = Encoder()
    raw = enc.encode_samples(samples, encode_metadata(families))
    parsed = remote_pb2.WriteRequest.FromString(raw)
    expected = reference(samples, families)
    assert canonical(parsed) == canonical(expected)
    assert parsed.SerializeToString(deterministic=True) == expected.SerializeToString(
        deterministic=True
    )
    for ts in parsed.timeseries:  # the spec's order, which Thanos and Mimir enforce
        names = [lb.name.encode() for lb in ts.labels]
        assert names == sorted(names)
        assert len(set(names)) == len(names)
        assert b"__name__" in names
    # Encoding again from a warm cache gives the same bytes.
    assert enc.encode_samples(samples, encode_metadata(families)) == raw


@given(INT64)
def test_varint_matches_protobuf(value: int) -> None:
    msg = types_pb2.Sample(timestamp=value)
    wire = msg.SerializeToString()
    if value != 0:
        assert wire == b"\x10" + varint(value)


def test_label_bytes_cached_once_per_series_id() -> None:
    reg = SeriesRegistry()
    a = reg.series("DCGM_FI_DEV_POWER_USAGE", {"gpu": "0", "UUID": "GPU-1"})
    b = reg.series("DCGM_FI_DEV_POWER_USAGE", {"gpu": "1", "UUID": "GPU-2"})
    enc = Encoder()
    first = enc.label_bytes(a)
    assert enc.label_bytes(a) is first
    assert enc.cached_series == 1
    for ts in range(5):
        enc.encode([Snapshot(1_700_000_000_000 + ts, [a, b], [1.0, 2.0])])
    assert enc.cached_series == 2
    assert enc.label_bytes(a) is first
    enc.forget([a.id])
    assert enc.cached_series == 1


def test_snapshots_group_samples_per_series_in_time_order() -> None:
    reg = SeriesRegistry()
    a = reg.series("x", {"gpu": "0"})
    b = reg.series("y", {"gpu": "0"})
    raw = Encoder().encode(
        [Snapshot(1000, [a, b], [1.0, 2.0]), Snapshot(2000, [a, b], [3.0, 4.0])],
        families=[Family("x", "help x", "gauge")],
    )
    req = remote_pb2.WriteRequest.FromString(raw)
    assert [[(lb.name, lb.value) for lb in ts.labels] for ts in req.timeseries] == [
        [("__name__", "x"), ("gpu", "0")],
        [("__name__", "y"), ("gpu", "0")],
    ]
    assert [[(s.value, s.timestamp) for s in ts.samples] for ts in req.timeseries] == [
        [(1.0, 1000), (3.0, 2000)],
        [(2.0, 1000), (4.0, 2000)],
    ]
    assert req.metadata[0].type == types_pb2.MetricMetadata.GAUGE


def test_stale_marker_bits_survive_encode_and_snappy() -> None:
    reg = SeriesRegistry()
    s = reg.series("DCGM_FI_DEV_GPU_TEMP", {"gpu": "3"})
    raw = Encoder().encode([Snapshot(-5, [s], [STALE_NAN])])
    assert snappy.uncompress(compress(raw)) == raw
    value = remote_pb2.WriteRequest.FromString(raw).timeseries[0].samples[0].value
    assert is_stale(value)
    assert bits(value) == 0x7FF0000000000002


def test_compress_is_snappy_block_format() -> None:
    raw = b"\x0a\x05hello" * 100
    out = compress(raw)
    # Block format starts with the uncompressed length as a varint; framed starts with 0xff.
    assert out[:2] == varint(len(raw))
    assert snappy.uncompress(out) == raw


def test_stale_marker_ends_the_series_label_cache() -> None:
    registry = SeriesRegistry()
    a = registry.series("m", {"pod": "a"})
    b = registry.series("m", {"pod": "b"})
    enc = Encoder()
    enc.encode_samples([QueuedSample(a, 1.0, 1000), QueuedSample(b, 2.0, 1000)])
    assert enc.cached_series == 2
    raw = enc.encode_samples([QueuedSample(a, STALE_NAN, 2000), QueuedSample(b, 3.0, 2000)])
    assert enc.cached_series == 1  # a ended; b lives on
    assert b"pod" in raw  # the stale marker itself still went out with a's labels


def test_label_names_in_byte_order_with_name_among_them() -> None:
    """dcgm-exporter's labels put ``__name__`` between upper- and lower-case names."""
    reg = SeriesRegistry()
    s = reg.series(
        "DCGM_FI_DEV_POWER_USAGE",
        {
            "gpu": "0",
            "UUID": "GPU-1",
            "device": "nvidia0",
            "modelName": "H200",
            "Hostname": "node",
            "DCGM_FI_DRIVER_VERSION": "560.35",
            "instance": "node:9400",
            "_private": "x",
        },
    )
    (ts,) = remote_pb2.WriteRequest.FromString(
        Encoder().encode([Snapshot(1, [s], [1.0])])
    ).timeseries
    assert [lb.name for lb in ts.labels] == [
        "DCGM_FI_DRIVER_VERSION",
        "Hostname",
        "UUID",
        "__name__",
        "_private",
        "device",
        "gpu",
        "instance",
        "modelName",
    ]


def entry_sizes(raw: bytes) -> list[int]:
    """The bytes of each top-level entry of a request (tag, length and body)."""
    sizes, pos = [], 0
    while pos < len(raw):
        length, shift, at = 0, 0, pos + 1
        while True:
            byte = raw[at]
            length |= (byte & 0x7F) << shift
            shift, at = shift + 7, at + 1
            if byte < 0x80:
                break
        sizes.append(at + length - pos)
        pos = at + length
    return sizes


def test_sizer_gives_the_1_0_entries_window_after_window() -> None:
    """What delivery measures a 2.0 request by is its 1.0 request's entries, also when a window's
    sizes come from the last window's (the same series, the timestamp's varint as wide), and not
    when the varint widens, families come along, or a series comes twice."""
    reg = SeriesRegistry()
    enc = Encoder()
    series = [enc.labels(reg.series("m", {"gpu": str(i), "pad": "x" * (i + 1)})) for i in range(99)]
    values = [float(i) / 3 for i in range(len(series))]
    sizer = Sizer()
    family = Family("m", "help text", "gauge", "watts")
    blocks = [
        Block.of(series, ts, values)
        for ts in (1, 2, 1000, 1_764_000_000_000, 1_764_000_001_000, -1, -2)
    ]
    blocks += [
        Block.of(series, 1_764_000_002_000, values, [family]),
        Block.of([*series, series[0]], 1_764_000_003_000, [*values, 1.0]),
        Block.of(series, list(range(len(series))), values),
    ]
    seen = []
    for block in blocks:
        sizes = sizer(block)
        assert sizes == entry_sizes(write_request(block)) == piece_sizes(block)
        seen.append(sizes)
    # kept from the last window, not made again; made again when the timestamp widens
    assert [seen[1] is seen[0], seen[2] is seen[1], seen[3] is seen[2]] == [True, False, False]
    assert [seen[4] is seen[3], seen[6] is seen[5]] == [True, True]

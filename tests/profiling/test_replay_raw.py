"""`replay --raw`'s blocks from arrays: the same bytes as the sample-at-a-time encoder, the same
samples as the per-millisecond snapshot path, labels in byte order."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from inprocess import record_sim

from hfsampler.profiling.recording import Recording
from hfsampler.profiling.replay import RawBatches, raw_snapshots, replay_labels, window_snapshots
from hfsampler.remote_write.arrays import sample_bytes
from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.encoder import Encoder, QueuedSample, write_request
from hfsampler.remote_write.prompb import remote_pb2
from hfsampler.series import STALE_NAN, SeriesRegistry


def test_array_bytes_equal_the_sample_encoder() -> None:
    rng = np.random.default_rng(7)
    registry = SeriesRegistry()
    series = [registry.series("x_raw", {"gpu": str(i), "UUID": f"GPU-{i}"}) for i in range(5)]
    # every varint width: 0, small, 2**35 .. 2**42 (today's ms), the largest int64, negatives
    ts = np.concatenate([[0, 1, 127, 128, 16_383, 16_384, -1, -(2**40), 2**63 - 1],
                         rng.integers(2**35, 2**42, 200)]).astype(np.int64)  # fmt: skip
    values = rng.normal(300, 50, len(ts))
    values[:4] = [np.nan, -0.0, np.inf, STALE_NAN]
    owner = rng.integers(0, len(series), len(ts))
    order = np.argsort(owner, kind="stable")
    ts, values, owner = ts[order], values[order], owner[order]
    enc = Encoder()
    counts = np.bincount(owner, minlength=len(series))
    block = Block(tuple(enc.labels(s) for s in series), np.cumsum(counts), ts, values)
    got = write_request(block)
    want = Encoder().encode_samples(
        [
            QueuedSample(series[o], float(v), int(t))
            for o, v, t in zip(owner, values, ts, strict=True)
        ]
    )
    assert got == want
    # and the same-width fast path
    same = sample_bytes(np.full(3, 2**41, np.int64), np.ones(3))
    assert same.span(0, 3) == b"".join(struct.pack("<BBBdB", 0x12, 16, 0x09, 1.0, 0x10)
                                       + bytes([0x80] * 5 + [0x40]) for _ in range(3))  # fmt: skip


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    """`record` of the sim, in this process on a virtual clock."""
    out = tmp_path_factory.mktemp("raw") / "run.hfs"
    return Recording(record_sim(out, "--label", "run=t", "--duration", "2.5s"))


def _decoded(data: bytes) -> dict[tuple[tuple[str, str], ...], list[tuple[int, float]]]:
    req = remote_pb2.WriteRequest()
    req.ParseFromString(data)
    out: dict[tuple[tuple[str, str], ...], list[tuple[int, float]]] = {}
    for ts in req.timeseries:
        labels = tuple((lb.name, lb.value) for lb in ts.labels)
        assert [n.encode() for n, _ in labels] == sorted(n.encode() for n, _ in labels)
        out.setdefault(labels, []).extend((s.timestamp, s.value) for s in ts.samples)
    return out


def test_a_replays_external_labels_leave_each_gpu_its_own(recording: Recording) -> None:
    """``replay --label gpu=x`` (or a recording made with it) made every GPU's series one."""
    labels = {**replay_labels(recording, {}), "gpu": "x", "cluster": "eu1"}
    gpus = {dict(s.labels)["gpu"] for snap in raw_snapshots(recording, labels) for s in snap.series}
    assert gpus == {"0", "1"}
    got = set()
    for b in RawBatches(recording, labels, n_shards=1):
        for _, block in b.blocks:
            got |= {dict(k)["gpu"] for k in _decoded(write_request(block))}
    assert got == {"0", "1"}
    windows = window_snapshots(recording, labels)
    assert {
        dict(s.labels)["gpu"] for snap in windows for s in snap.series if "gpu" in dict(s.labels)
    } == {"0", "1"}


@pytest.mark.parametrize("batch", [3_000, 1_000_000], ids=["small-batches", "one-batch"])
def test_batches_hold_the_snapshot_paths_samples(recording: Recording, batch: int) -> None:
    labels = replay_labels(recording, {})
    want: dict[tuple[tuple[str, str], ...], list[tuple[int, float]]] = {}
    for snap in raw_snapshots(recording, labels):
        for s, v in snap.items():
            want.setdefault(s.all_labels(), []).append((snap.timestamp_ms, v))
    batches = RawBatches(recording, labels, n_shards=3, batch_samples=batch)
    got: dict[tuple[tuple[str, str], ...], list[tuple[int, float]]] = {}
    shard_of: dict[tuple[tuple[str, str], ...], set[int]] = {}
    for b in batches:
        assert b.samples == sum(block.samples for _, block in b.blocks)
        for shard, block in b.blocks:
            part = _decoded(write_request(block))
            assert sum(len(v) for v in part.values()) == block.samples
            for key, samples in part.items():
                got.setdefault(key, []).extend(samples)
                shard_of.setdefault(key, set()).add(shard)
    assert len(want) > 50
    assert set(got) == set(want)
    for key, samples in want.items():
        assert got[key] == samples, key  # same timestamps, same values, bit for bit, in order
    assert all(len(s) == 1 for s in shard_of.values())  # a series stays on its shard
    assert {next(iter(s)) for s in shard_of.values()} == {0, 1, 2}
    assert set(batches.families) == {dict(k)["__name__"] for k in want}

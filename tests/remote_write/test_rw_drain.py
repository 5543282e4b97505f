"""Draining a backlog: windows of the same series read back from the spool, unpacked with the
series of the record before, merged row by row and written from a template, give what the general
paths give; a receiver back after an outage is met within a second."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from test_rw_sender import (
    FAST,
    Receiver,
    eventually,
    free_port,
    labels_of,
    make_series,
    running,
    snap,
)

from hfsampler import selfmetrics as sm
from hfsampler.errors import ReceiverDownError
from hfsampler.remote_write.blocks import Block, Labels, Unpacker, merge, pack
from hfsampler.remote_write.config import EndpointConfig
from hfsampler.remote_write.encoder import RequestEncoderV1, write_request
from hfsampler.remote_write.retry import RECEIVER_DOWN_RETRY_S, Backoff
from hfsampler.series import STALE_NAN, Family


def labels(n: int, host: str = "a") -> tuple[Labels, ...]:
    return tuple(
        Labels.of([("__name__", "DCGM_FI_DEV_GPU_TEMP"), ("gpu", str(g)), ("host", host)])
        for g in range(n)
    )


def window(series: tuple[Labels, ...], ts_ms: int, first: float) -> Block:
    values = [first + i for i in range(len(series))]
    return Block.of(series, ts_ms, values, distinct=True)


def same(a: Block, b: Block) -> None:
    assert a.series == b.series
    assert a.ends.tolist() == b.ends.tolist()
    assert a.timestamps_ms.tolist() == b.timestamps_ms.tolist()
    assert a.values.view(np.uint64).tolist() == b.values.view(np.uint64).tolist()  # bit for bit
    assert a.families == b.families


@pytest.mark.parametrize("shared", [True, False], ids=["one-tuple", "equal-tuples"])
def test_windows_of_the_same_series_merge_as_the_grouping_path(shared: bool) -> None:
    series = labels(4)
    fam = Family("DCGM_FI_DEV_GPU_TEMP", "Temperature.", "gauge")
    blocks = [
        Block(
            series if shared else tuple(series),
            np.arange(1, 5),
            np.full(4, 1000 * (w + 1), np.int64),
            np.array([w * 10.0, STALE_NAN, -0.0, w + 0.5]),
            (fam,) if w == 0 else (),
        )
        for w in range(3)
    ]
    merged = merge(blocks)
    # Block.of groups samples given series by series (a series again: grouped, in order given)
    grouped = Block.of(
        [s for b in blocks for s in b.series],
        np.concatenate([b.timestamps_ms for b in blocks]),
        np.concatenate([b.values for b in blocks]),
        [fam],
    )
    same(merged, grouped)
    assert merged.ends.tolist() == [3, 6, 9, 12]


def test_windows_of_other_series_still_merge_series_by_series() -> None:
    a, b = labels(3), labels(3, host="b")
    merged = merge([window(a, 1000, 0.0), window(b[:2] + a[2:], 2000, 10.0)])
    assert merged.series == (*a, b[0], b[1])
    assert merged.ends.tolist() == [1, 2, 4, 5, 6]
    assert merged.values.tolist() == [0.0, 1.0, 2.0, 12.0, 10.0, 11.0]


def test_the_unpacker_reads_each_record_with_its_own_series() -> None:
    """The series of the record before are taken as they are only when stored the same."""
    a = labels(3)
    longer = labels(4)  # a's series and one more: the same bytes at first
    other = labels(3, host="b")  # as many series, other labels
    unpacker = Unpacker()
    read = [
        unpacker.unpack(pack(window(s, 1000 * (i + 1), float(i))))
        for i, s in enumerate([a, a, longer, other, other, a])
    ]
    for block, want in zip(read, [a, a, longer, other, other, a], strict=True):
        assert [s.strings for s in block.series] == [s.strings for s in want]
        assert [s.v1 for s in block.series] == [s.v1 for s in want]
    assert read[1].series is read[0].series  # found by one comparison: merged without a look-up
    assert read[4].series is read[3].series
    assert read[5].series[0] is read[0].series[0]  # one Labels per label set, still


def test_records_read_back_take_the_series_of_the_blocks_spooled() -> None:
    """The process that spooled the windows reads them with the writer's labels, made once."""
    a, other = labels(3), labels(3, host="b")
    unpacker = Unpacker()
    spooled = window(a, 1000, 0.0)
    unpacker.remember(spooled, pack(spooled))
    again = window(tuple(a), 2000, 1.0)  # the next window: another tuple, the same labels
    unpacker.remember(again, pack(again))
    read = unpacker.unpack(pack(again))
    assert read.series is spooled.series
    assert read.values.tolist() == [1.0, 2.0, 3.0]
    read_other = unpacker.unpack(pack(window(other, 3000, 5.0)))
    assert [s.strings for s in read_other.series] == [s.strings for s in other]
    assert unpacker.unpack(pack(window(a, 4000, 0.0))).series[0] is not a[0]  # its own, again


def test_a_damaged_record_after_a_good_one_is_still_refused() -> None:
    a = labels(3)
    unpacker = Unpacker()
    data = pack(window(a, 1000, 0.0))
    unpacker.unpack(data)
    with pytest.raises(ValueError, match="trailing bytes"):
        unpacker.unpack(data + b"\0")


@pytest.mark.parametrize("windows", [2, 3, 7])
def test_merged_windows_written_from_a_template_equal_the_bytes_written_anew(windows: int) -> None:
    series = labels(5)
    encoder = RequestEncoderV1()
    for start in (1000, 2**40 - 2000):  # timestamps of one width, then crossing a varint width
        blocks = [window(series, start + 1000 * w, float(w)) for w in range(windows)]
        merged = merge(blocks)
        assert merged.samples == 5 * windows
        assert encoder.encode(merged) == write_request(merged)
        assert encoder.encode(merged) == write_request(merged)  # from the cached template


def test_a_refused_connection_is_tried_again_within_a_second_whatever_the_backoff() -> None:
    backoff = Backoff(0.03, 5.0)
    for _ in range(10):  # a long outage: the backoff is at max_backoff
        backoff.next_delay(down=True)
    assert backoff.next_delay(down=True).seconds <= RECEIVER_DOWN_RETRY_S
    assert backoff.next_delay().seconds >= 0.75 * 5.0  # a 503 still waits its backoff


@pytest.mark.both_loops
async def test_a_receiver_back_after_an_outage_gets_the_backlog_within_a_second() -> None:
    """With retries 3 s apart or more (min_backoff 4 s), the receiver's return is still met
    within about a second: nothing listened, so the connection was refused."""
    port = free_port()
    queue = replace(FAST, min_backoff_s=4.0, max_backoff_s=8.0)
    cfg = EndpointConfig(f"http://127.0.0.1:{port}/api/v1/write", queue=queue)
    writer, metrics = await running(cfg)
    writer.push(snap(make_series(2), 1000))
    await eventually(lambda: metrics.get(sm.RW_REQUESTS, labels_of(cfg, status="error")) >= 1)
    async with Receiver(port=port) as rx:
        back = time.monotonic()
        await eventually(lambda: len(rx.accepted()) == 2)
        waited = time.monotonic() - back
        await writer.close(5)
    assert waited < 2.5, waited  # at most RECEIVER_DOWN_RETRY_S, and a loaded machine's slack
    assert isinstance(ReceiverDownError("x"), ConnectionRefusedError)

"""Per-link NVLink from the NVML source, against a fake libnvidia-ml under the real pynvml."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import pynvml
import pytest
from fake_nvml import FakeNvml, install, nvlink_gpu, standard_gpu

from hfsampler import fields as F
from hfsampler.fields import Field, Kind
from hfsampler.sources.nvml.source import NvmlSource

PER_LINK = tuple(f for f in F.CATALOGUE if f.per == "link")
TX = F.BY_NAME["DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"]
RX = F.BY_NAME["DCGM_FI_DEV_NVLINK_RX_THROUGHPUT_PER_LINK"]
CRC_FLIT = F.BY_NAME["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL"]
REPLAY = F.BY_NAME["DCGM_FI_DEV_NVLINK_REPLAY_ERROR_PER_LINK_TOTAL"]
# the all-links CRC total: a GPU-level field read in the same batch as the per-link ones
ALL_LINKS_CRC = F.BY_NAME["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL"]
BANDWIDTH = F.BY_NAME["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"]
DATA_BYTES = F.BY_NAME["hfsampler_nvlink_data_bytes_total"]
MIB = float(1 << 20)


class Clock:
    """The fake driver's clock and the reads' now, together (microseconds)."""

    def __init__(self) -> None:
        self.us = 1_000_000_000

    def __call__(self) -> int:
        return self.us


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> FakeNvml:
    """GPU 0: links 0-3, link 2 down; GPU 1: links 0-3, link 3 down; GPU 2: no NVLink."""
    gpus = [nvlink_gpu(0, 4, down=(2,)), nvlink_gpu(1, 4, down=(3,)), standard_gpu(2)]
    return install(monkeypatch, FakeNvml(gpus=gpus, clock_us=clock))


@pytest.fixture
def source() -> Iterator[NvmlSource]:
    s = NvmlSource()
    yield s
    s.close()


def column(fields: Sequence[Field], f: Field, link: int) -> int:
    return fields.index(f.instance(str(link)))


def read(s: NvmlSource, fields: Sequence[Field], clock: Clock) -> np.ndarray:
    clock.us += 100_000
    values = np.zeros((len(s.gpu_up), len(fields)))
    ts = np.zeros((len(s.gpu_up), len(fields)), dtype=np.int64)
    s.read(fields, values, ts, clock.us * 1000)
    return values


def test_every_link_a_gpu_has_becomes_one_field_each(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    inv = source.open((ALL_LINKS_CRC, *PER_LINK))
    # links some GPU has, up or down: 0-3; one field per link, each labelled
    assert inv.fields[0] == ALL_LINKS_CRC
    assert inv.fields[1:] == tuple(f.instance(str(k)) for f in PER_LINK for k in range(4))
    assert all(f.kind is Kind.COUNTER for f in PER_LINK if f not in (TX, RX))
    up = {(g, k): bool(inv.supported[g, column(inv.fields, CRC_FLIT, k)]) for g in range(3)
          for k in range(4)}  # fmt: skip
    # a link down at open is read once it is up: supported, unread while down
    assert [k for k in range(4) if up[0, k]] == [0, 1, 2, 3]
    assert [k for k in range(4) if up[1, k]] == [0, 1, 2, 3]
    assert not any(up[2, k] for k in range(4))  # no NVLink at all
    # a link that is down, or a GPU without NVLink, is no warning: one line says which were down
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "GPU 0: NVLink link(s) 2 not up at start: read once up" in caplog.text
    # each link's state asked once, at open; GPU 2 answers NOT_SUPPORTED once
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 5 + 5 + 1


def test_bandwidth_is_a_rate_per_link_and_errors_are_counters(
    fake: FakeNvml, source: NvmlSource, clock: Clock
) -> None:
    inv = source.open(PER_LINK)
    fields = inv.fields
    first = read(source, fields, clock)
    assert np.isnan(first[:, column(fields, TX, 0)]).all()  # a rate needs two samples
    values = read(source, fields, clock)
    # link k of GPU i moves (10 + k + i) MiB/s out, twice that in (the fake's KiB counters)
    for g, k in ((0, 0), (0, 3), (1, 0), (1, 2)):
        assert values[g, column(fields, TX, k)] == pytest.approx((10 + k + g) * MIB, rel=1e-3)
        assert values[g, column(fields, RX, k)] == pytest.approx(2 * (10 + k + g) * MIB, rel=1e-3)
    # the error counters are the driver's cumulative counts: k CRC errors per second on link k
    t_s = (clock.us - clock.us % 10_000) / 1e6
    assert values[0, column(fields, CRC_FLIT, 3)] == int(3 * t_s)
    assert values[1, column(fields, REPLAY, 1)] == int(t_s)
    # a link down at open, and a GPU without NVLink, give no value; and no read error
    assert np.isnan(values[0, column(fields, TX, 2)])
    assert np.isnan(values[1, [column(fields, f, 3) for f in PER_LINK]]).all()
    assert np.isnan(values[2]).all()
    assert source.read_errors.tolist() == [0, 0, 0]


def test_every_link_is_in_the_one_batched_read_per_gpu(
    fake: FakeNvml, source: NvmlSource, clock: Clock
) -> None:
    inv = source.open((ALL_LINKS_CRC, *PER_LINK))
    before = fake.calls["nvmlDeviceGetFieldValues"]
    read(source, inv.fields, clock)
    # one call per GPU for the total and every link (GPU 2 reads only the total)
    assert fake.calls["nvmlDeviceGetFieldValues"] - before == 3
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 11  # at open only: not again so soon
    read(source, inv.fields, clock)
    assert fake.calls["nvmlDeviceGetFieldValues"] - before == 6


def test_a_link_going_down_mid_run_is_skipped_and_read_again_when_back(
    fake: FakeNvml, source: NvmlSource, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    inv = source.open(PER_LINK)
    fields = inv.fields
    read(source, fields, clock)
    assert not np.isnan(read(source, fields, clock)[0, column(fields, TX, 1)])
    states = fake.calls["nvmlDeviceGetNvLinkState"]
    fake.gpus[0].links[1].active = False  # the driver still answers its counters
    # within a second the state is not asked again, ten reads or not
    for _ in range(5):
        read(source, fields, clock)
    asked = fake.calls["nvmlDeviceGetNvLinkState"] - states
    assert asked == 0  # 0.6 s since the first read
    clock.us += 1_000_000
    down = read(source, fields, clock)
    assert np.isnan(down[0, [column(fields, f, 1) for f in PER_LINK]]).all()
    assert not np.isnan(down[0, column(fields, TX, 0)])  # the other links keep going
    assert not np.isnan(down[1, column(fields, TX, 1)])  # and the other GPU's link 1
    assert "GPU 0: NVLink link 1 went down" in caplog.text
    assert source.read_errors.tolist() == [0, 0, 0]
    fake.gpus[0].links[1].active = True
    clock.us += 1_000_000
    read(source, fields, clock)
    back = read(source, fields, clock)
    assert back[0, column(fields, TX, 1)] == pytest.approx(11 * MIB, rel=1e-3)
    assert "GPU 0: NVLink link 1 is up again" in caplog.text


def test_a_down_link_that_answers_errors_costs_nothing_once_seen_down(
    fake: FakeNvml, source: NvmlSource, clock: Clock
) -> None:
    inv = source.open(PER_LINK)
    read(source, inv.fields, clock)
    link = fake.gpus[1].links[0]
    link.active, link.down_ret = False, pynvml.NVML_ERROR_NOT_SUPPORTED
    read(source, inv.fields, clock)  # its six entries fail: counted, and the states asked again
    states = fake.calls["nvmlDeviceGetNvLinkState"]
    for _ in range(3):
        read(source, inv.fields, clock)
    assert fake.calls["nvmlDeviceGetNvLinkState"] - states == 8  # the 4 links of GPUs 0, 1: once
    assert source.read_errors.tolist() == [0, len(PER_LINK), 0]
    assert source.gpu_up.tolist() == [True, True, True]


def test_links_past_11_have_bandwidth_but_no_error_ids(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    install(monkeypatch, FakeNvml(gpus=[nvlink_gpu(0, 18)], clock_us=clock))
    source = NvmlSource()
    try:
        inv = source.open((TX, CRC_FLIT))
        # TX on links 0-17; CRC errors on links 0-11 only: NVML has no id for 12-17
        assert inv.fields == (*(TX.instance(str(k)) for k in range(18)),
                              *(CRC_FLIT.instance(str(k)) for k in range(12)))  # fmt: skip
        assert inv.supported.all()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert f"{CRC_FLIT.name}: NVML has no field id for link(s) 12,13,14,15,16,17" in caplog.text
        values = read(source, inv.fields, clock)
        assert values[0, column(inv.fields, CRC_FLIT, 11)] == int(11 * (clock.us // 10_000) / 100)
    finally:
        source.close()


def test_no_nvlink_anywhere_keeps_the_fields_unexpanded_and_unsupported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    install(monkeypatch, FakeNvml(gpus=[standard_gpu(0)]))
    source = NvmlSource()
    try:
        inv = source.open((ALL_LINKS_CRC, *PER_LINK))
        assert inv.fields == (ALL_LINKS_CRC, *PER_LINK)
        assert inv.supported.tolist() == [[True] + [False] * len(PER_LINK)]
        assert "no GPU has NVLink links" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        source.close()


def test_a_gpu_lost_at_a_link_recheck_goes_down_through_its_reads(
    fake: FakeNvml, source: NvmlSource, clock: Clock
) -> None:
    inv = source.open(PER_LINK)
    read(source, inv.fields, clock)
    fake.gpus[0].lost = True
    clock.us += 2_000_000
    values = read(source, inv.fields, clock)
    assert source.gpu_up.tolist() == [False, True, True]
    assert np.isnan(values[0]).all()
    assert not np.isnan(values[1, column(inv.fields, CRC_FLIT, 0)])


def test_a_link_down_at_open_is_read_once_it_comes_up(
    fake: FakeNvml, source: NvmlSource, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """GPU 0's link 2 was down at open (the fabric manager not done yet): watched with the
    others, its fields are read from the first recheck that finds it up."""
    caplog.set_level(logging.INFO)
    inv = source.open(PER_LINK)
    read(source, inv.fields, clock)
    assert np.isnan(read(source, inv.fields, clock)[0, column(inv.fields, TX, 2)])
    fake.gpus[0].links[2].active = True
    states = fake.calls["nvmlDeviceGetNvLinkState"]
    clock.us += 1_000_000
    read(source, inv.fields, clock)
    assert fake.calls["nvmlDeviceGetNvLinkState"] - states == 4 + 4  # GPU 0: 0-3; GPU 1: 0-3
    values = read(source, inv.fields, clock)
    assert values[0, column(inv.fields, TX, 2)] == pytest.approx(12 * MIB, rel=1e-3)
    t_s = (clock.us - clock.us % 10_000) / 1e6
    assert values[0, column(inv.fields, CRC_FLIT, 2)] == int(2 * t_s)
    assert "GPU 0: NVLink link 2 came up: read from now on" in caplog.text
    assert "is up again" not in caplog.text
    assert source.read_errors.tolist() == [0, 0, 0]


def test_links_all_down_at_open_that_answer_errors_while_down_are_read_once_up(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Every link down at a boot-time start, their entries refused meanwhile: no warning, no
    error counted, and each link read from when it comes up."""
    gpu = nvlink_gpu(0, 4, down=(0, 1, 2, 3))
    for link in gpu.links:
        link.down_ret = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake = install(monkeypatch, FakeNvml(gpus=[gpu], clock_us=clock))
    source = NvmlSource()
    try:
        inv = source.open(PER_LINK)
        assert inv.supported.all()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert np.isnan(read(source, inv.fields, clock)).all()
        for link in fake.gpus[0].links:
            link.active = True
        clock.us += 1_000_000
        read(source, inv.fields, clock)
        values = read(source, inv.fields, clock)
        assert values[0, column(inv.fields, TX, 3)] == pytest.approx(13 * MIB, rel=1e-3)
        assert not np.isnan(values[0, [column(inv.fields, REPLAY, k) for k in range(4)]]).any()
        assert source.read_errors.tolist() == [0]
    finally:
        source.close()


def test_the_bandwidth_total_is_dcgms_rate_of_every_links_tx_and_rx(
    fake: FakeNvml, source: NvmlSource, clock: Clock
) -> None:
    """DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL as DCGM computes it: NVML's TX and RX data KiB
    counters over every link (scopeId UINT_MAX), summed, per second, / 1000; and the same
    counters as hfsampler_nvlink_data_bytes_total, in bytes."""
    inv = source.open((BANDWIDTH, DATA_BYTES))
    # a GPU without NVLink has neither
    assert inv.supported.tolist() == [[True, True], [True, True], [False, False]]
    first = read(source, inv.fields, clock)
    assert np.isnan(first[:, 0]).all()  # a rate needs two readings
    values = read(source, inv.fields, clock)
    # link k of GPU i: (10 + k + i) MiB/s out, twice that in, on the links that are up (GPU 0:
    # 0, 1, 3; GPU 1: 0, 1, 2); DCGM's "MB/s" is KiB/s / 1000
    for g, up in ((0, (0, 1, 3)), (1, (0, 1, 2))):
        kib_per_s = sum(3 * (10 + k + g) * 1024 for k in up)
        assert values[g, 0] == pytest.approx(kib_per_s / 1000, rel=1e-3)
        t_s = (clock.us - clock.us % 10_000) / 1e6
        assert values[g, 1] == pytest.approx(kib_per_s * 1024 * t_s, rel=1e-3)
    assert np.isnan(values[2]).all()
    # a repeat of the driver's reading (its 10 ms refresh not passed) gives no rate, not 0
    clock.us += 1_000
    values = read(source, inv.fields, clock)
    clock.us -= 99_000  # read() adds 100 ms: 1 ms later, inside the same 10 ms refresh
    again = read(source, inv.fields, clock)
    assert np.isnan(again[0, 0])
    assert again[0, 1] == values[0, 1]
    assert source.read_errors.tolist() == [0, 0, 0]

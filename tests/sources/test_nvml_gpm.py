"""GPM activity metrics through the nvml source, over the fake NVML's GPM entry points."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pynvml
import pytest
from fake_nvml import GPM_BASE, FakeNvml, gpm_value, install, make_fake

from hfsampler import fields as F
from hfsampler.sources.nvml.source import NvmlSource

ACTIVITY = tuple(f for f in F.CATALOGUE if f.group == F.GPM)
INSTANT = F.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"]


@pytest.fixture
def now() -> list[int]:
    return [5_000_000]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, now: list[int]) -> FakeNvml:
    f = install(monkeypatch, make_fake(2))
    f.clock_us = lambda: now[0]
    return f


@pytest.fixture
def source() -> Iterator[NvmlSource]:
    s = NvmlSource()
    yield s
    s.close()


def read(s: NvmlSource, fields: tuple[F.Field, ...], now_us: int) -> tuple[np.ndarray, np.ndarray]:
    values = np.zeros((len(s.gpu_up), len(fields)))
    ts = np.zeros((len(s.gpu_up), len(fields)), dtype=np.int64)
    s.read(fields, values, ts, now_us * 1000)
    return values, ts


def test_catalogue_activity_fields_use_dcgm_names_and_units() -> None:
    assert len(ACTIVITY) == 12
    for f in ACTIVITY:
        assert f.name.startswith("DCGM_FI_PROF_")
        assert isinstance(getattr(pynvml, f.gpm_metric or ""), int)
        assert f.dcgm_field is not None
        assert f.scale in (0.01, float(1 << 20))  # percent -> ratio, MiB/s -> B/s
    assert F.select(["gpm"]) == ACTIVITY
    assert F.select(["sm_active"]) == (F.BY_NAME["DCGM_FI_PROF_SM_ACTIVE"],)


def test_gpm_pairs_give_ratios_and_bytes(
    fake: FakeNvml, source: NvmlSource, now: list[int]
) -> None:
    inv = source.open(ACTIVITY)
    assert inv.supported.all()
    first, ts = read(source, ACTIVITY, now[0])
    assert np.isnan(first).all()  # one sample is not a pair
    assert (ts == 0).all()
    now[0] += 100_000
    values, ts = read(source, ACTIVITY, now[0])
    for j, f in enumerate(ACTIVITY):
        for g in range(2):
            expected = gpm_value(f.gpm_metric or "", g, 5_100_000) * f.scale
            assert values[g, j] == pytest.approx(expected), f.name
    assert (ts == now[0]).all()
    sm = F.BY_NAME["DCGM_FI_PROF_SM_ACTIVE"]
    assert 0.0 <= values[0, ACTIVITY.index(sm)] <= 1.0
    assert fake.calls["nvmlGpmSampleGet"] == 4  # one sample per GPU per read


def test_pair_inside_one_refresh_keeps_the_older_sample(
    fake: FakeNvml, source: NvmlSource, now: list[int]
) -> None:
    source.open(ACTIVITY)
    read(source, ACTIVITY, now[0])
    now[0] += 40_000  # same 100 ms counter refresh: no value
    values, ts = read(source, ACTIVITY, now[0])
    assert np.isnan(values).all()
    assert (ts == 0).all()
    now[0] += 70_000  # the pair (first sample, this one) spans a refresh
    values, _ = read(source, ACTIVITY, now[0])
    assert not np.isnan(values).any()
    assert source.read_errors.tolist() == [0, 0]


def test_unsupported_device_skips_the_group_with_one_log_line(
    fake: FakeNvml, source: NvmlSource, now: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    fake.gpus[1].gpm_supported = False
    fields = (INSTANT, *ACTIVITY)
    with caplog.at_level(logging.INFO, logger="hfsampler.sources.nvml.source"):
        inv = source.open(fields)
    assert inv.supported[0].all()
    assert inv.supported[1].tolist() == [True] + [False] * len(ACTIVITY)
    lines = [r.getMessage() for r in caplog.records if "GPM" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "GPU 1" in lines[0]
    read(source, fields, now[0])
    now[0] += 100_000
    values, _ = read(source, fields, now[0])
    assert not np.isnan(values[0]).any()
    assert np.isnan(values[1, 1:]).all()
    assert fake.calls["nvmlGpmSampleGet"] == 2  # GPU 1 is never sampled


def test_driver_without_gpm(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    fake.missing.add("nvmlGpmQueryDeviceSupport")
    with caplog.at_level(logging.WARNING, logger="hfsampler.sources.nvml.source"):
        inv = source.open(ACTIVITY)
    assert not inv.supported.any()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "Function Not Found" in lines[0]


def test_metric_a_gpu_lacks_is_dropped_once(
    fake: FakeNvml, source: NvmlSource, now: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    del fake.gpus[0].gpm[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC]
    source.open(ACTIVITY)
    nvlink = ACTIVITY.index(F.BY_NAME["DCGM_FI_PROF_NVLINK_TX_BYTES"])
    with caplog.at_level(logging.WARNING, logger="hfsampler.sources.nvml.source"):
        for _ in range(4):
            values, _ = read(source, ACTIVITY, now[0])
            now[0] += 100_000
    assert np.isnan(values[0, nvlink])
    assert not np.isnan(values[1, nvlink])
    assert len([r for r in caplog.records if "NVLINK_TX" in r.getMessage()]) == 1
    assert source.read_errors.tolist() == [0, 0]


def test_gpu_lost_during_gpm(fake: FakeNvml, source: NvmlSource, now: list[int]) -> None:
    source.open(ACTIVITY)
    read(source, ACTIVITY, now[0])
    fake.gpus[0].lost = True
    now[0] += 100_000
    values, _ = read(source, ACTIVITY, now[0])
    assert source.gpu_up.tolist() == [False, True]
    assert np.isnan(values[0]).all()
    assert not np.isnan(values[1]).any()


def test_close_frees_every_sample(fake: FakeNvml, now: list[int]) -> None:
    s = NvmlSource()
    s.open(ACTIVITY)
    read(s, ACTIVITY, now[0])
    assert len(fake.gpm_samples) == 4
    s.close()
    assert fake.gpm_samples == {}
    assert set(GPM_BASE) == {f.gpm_metric for f in ACTIVITY}

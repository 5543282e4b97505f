"""Per-process GPU use: NVML's process list and utilisation (fake driver), and the sim's model."""

from __future__ import annotations

import logging

import numpy as np
import pynvml
import pytest
from fake_nvml import FakeNvml, FakeProcess, install, make_fake

from hfsampler.sources import GpuProcess, SourceSpec, open_processes
from hfsampler.sources.sim import SimSource

GIB = 1 << 30


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return install(monkeypatch, make_fake(2))


def test_nvml_gives_memory_and_mean_sm_util_per_process(fake_nvml: FakeNvml) -> None:
    clock = [1_000_000_000]
    fake_nvml.clock_us = lambda: clock[0]
    fake_nvml.gpus[0].processes = [
        FakeProcess(4242, 3 * GIB, lambda ts: 40.0 + (ts // 100_000) % 2 * 20),
        FakeProcess(77, GIB, None),  # the driver has no utilisation samples of it
    ]
    reader = open_processes(SourceSpec("nvml"), [0, 1])
    assert reader is not None
    try:
        first = reader.read_processes({4242}, 0)
        assert first == {
            0: [GpuProcess(77, GIB, None), GpuProcess(4242, 3 * GIB, 40.0)],
            1: [],
        }
        # nothing newer than the sample already read: no utilisation, memory still
        again = reader.read_processes({4242}, 0)
        assert again[0][1] == GpuProcess(4242, 3 * GIB, None)
        clock[0] += 100_000
        assert reader.read_processes({4242}, 0)[0][1].sm_util_pct == 60.0
    finally:
        reader.close()
    assert fake_nvml.initialised == 0  # its own init, its own shutdown


def test_nvml_without_process_utilisation_gives_memory_said_once(
    fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake_nvml.gpus[0].processes = [FakeProcess(10, GIB, 50.0)]
    fake_nvml.gpus[0].errors["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake_nvml.gpus[1].errors["nvmlDeviceGetComputeRunningProcesses_v3"] = (
        pynvml.NVML_ERROR_NO_PERMISSION
    )
    reader = open_processes(SourceSpec("nvml"), [0, 1])
    assert reader is not None
    with caplog.at_level(logging.INFO, "hfsampler.sources.nvml_processes"):
        for _ in range(3):
            assert reader.read_processes(set(), 0) == {0: [GpuProcess(10, GIB, None)]}
    reader.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert "GPU 0 gives no per-process utilisation" in said[0]
    assert "cannot list the processes on GPU 1" in said[1]


def test_sim_processes_share_the_gpu_as_its_own_values_say() -> None:
    sim = SimSource(gpus=2, seed=3)
    t = 1_700_000_000_123_456_789
    got = sim.read_processes({300, 100, 200}, t)
    used = sim.value_at("DCGM_FI_DEV_FB_USED", t)
    util = sim.value_at("DCGM_FI_DEV_GPU_UTIL", t)
    for g in (0, 1):
        procs = got[g]
        assert [p.pid for p in procs] == [100, 200, 300]
        mem = [p.used_memory_bytes or 0 for p in procs]
        assert mem[0] > mem[1] > mem[2] > 0
        assert sum(mem) == pytest.approx(used[g] * 2**20, abs=3)
        assert sum(p.sm_util_pct or 0 for p in procs) == pytest.approx(util[g])
    assert got == SimSource(gpus=2, seed=3).read_processes([100, 200, 300], t)  # deterministic
    assert sim.read_processes(set(), t) == {}
    assert np.isfinite(util).all()

"""Per-process GPU use: NVML's process list and utilisation (fake driver), the sim's model, and
what record stores of processes and markers."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pynvml
import pytest
from fake_nvml import FakeNvml, FakeProcess, install, make_fake

from hfsampler.profiling.record import Recorder
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import Marker
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.sources.base import DeviceInfo, GpuProcess, SourceSpec
from hfsampler.sources.registry import open_processes
from hfsampler.sources.sim.source import SimSource

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
    with caplog.at_level(logging.INFO, "hfsampler.sources.nvml.processes"):
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


class _Writer:
    def __init__(self) -> None:
        self.snapshots: list[tuple[int, dict[int, list[dict[str, object]]]]] = []

    def add_processes(self, t_ns: int, processes: dict[int, list[dict[str, object]]]) -> None:
        self.snapshots.append((t_ns, processes))


class _Reader:
    def __init__(self) -> None:
        self.found: dict[int, list[GpuProcess]] = {0: [GpuProcess(5, GIB, 50.0)], 1: []}

    def read_processes(self, job: object, t_ns: int) -> dict[int, list[GpuProcess]]:
        return self.found

    def close(self) -> None:
        pass


def test_record_writes_a_snapshot_when_something_changes_or_every_10_s() -> None:
    """A steady job: one PROC chunk per 10 s instead of one a second; a change at once."""
    recorder = object.__new__(Recorder)  # only the process bookkeeping, no sampler or child
    recorder.child = None
    recorder.inventory = SimpleNamespace(  # type: ignore[assignment]
        devices=[DeviceInfo(i, f"GPU-{i}", "test", f"0:{i}", "1.0", i) for i in range(2)]
    )
    recorder.keep = [0, 1]
    recorder._last_processes = {}
    recorder._processes_written_ns = 0
    recorder._looks = None  # no consumers: the snapshots alone
    writer, reader = _Writer(), _Reader()
    second = 10**9
    for t in range(60):
        if t == 33:
            reader.found = {0: [GpuProcess(5, 2 * GIB, 50.0)], 1: []}  # its memory grew
        if t == 45:
            reader.found = {}  # gone
        recorder._processes(writer, reader, (1000 + t) * second)  # type: ignore[arg-type]
    times = [t_ns // second - 1000 for t_ns, _ in writer.snapshots]
    assert times == [0, 10, 20, 30, 33, 43, 45]
    assert writer.snapshots[4][1][0][0]["used_memory_bytes"] == 2 * GIB
    assert writer.snapshots[-1][1] == {}  # the first empty one says that they have gone


def test_a_marker_the_file_refuses_is_counted_and_the_others_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One marker orjson cannot write (a step past 64 bits) must not end the recording."""
    recorder = object.__new__(Recorder)
    recorder.markers_not_stored = 0
    writer = RecordingWriter(tmp_path / "m.hfs", {"start_ns": 0}, [], [])
    recorder._markers = [Marker(2, "mark", "after"), Marker(1, "step", "step", 2**64),
                         Marker(0, "mark", "before")]  # fmt: skip
    with caplog.at_level(logging.WARNING, "hfsampler.profiling.record"):
        recorder._store_markers(writer)
        recorder._markers = [Marker(3, "step", "step", 2**70)]
        recorder._store_markers(writer)
    writer.close({"end_ns": 4})
    assert [m.name for m in Recording(tmp_path / "m.hfs").markers()] == ["before", "after"]
    assert recorder.markers_not_stored == 2
    assert len([r for r in caplog.records if "could not store a marker" in r.getMessage()]) == 1

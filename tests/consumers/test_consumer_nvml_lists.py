"""The fake NVML's process lists (compute, graphics, MPS; per GPU and MIG instance; processes that
start and leave) and utilisation samples, read through hfsampler's calls, then one window split
among consumers found in a made-up procfs: memory and SM ratio exact, energy by SM share."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import procfs_trees as t
import pynvml
import pytest
from fake_nvml import COMPUTE, GRAPHICS, MPS, FakeNvml, FakeProcess, enable_mig, install, make_fake

from hfsampler.consumers.identity import Consumer, Kind
from hfsampler.consumers.procfs import ProcfsReader
from hfsampler.consumers.split import WindowUse, split
from hfsampler.sources.nvml import calls
from hfsampler.sources.nvml.consumer_reads import ConsumerReads

GIB = 1 << 30
PERIOD_US = 100_000


class Clock:
    def __init__(self, now_us: int = 10_000_000) -> None:
        self.now_us = now_us

    def __call__(self) -> int:
        return self.now_us


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    f = make_fake(1)
    f.clock_us = Clock()
    install(monkeypatch, f)
    calls.init()
    yield f
    calls.shutdown()


def _lists(handle: object) -> dict[str, list[tuple[int, int | None, int | None]]]:
    return {kind: calls.running_processes(handle, kind) for kind, _ in calls.PROCESS_LISTS}


def test_three_lists_and_processes_that_start_and_leave(fake: FakeNvml) -> None:
    clock = fake.clock_us
    assert isinstance(clock, Clock)
    now = clock.now_us
    fake.gpus[0].processes = [
        FakeProcess(10, 2 * GIB, 30.0),
        FakeProcess(11, GIB, 10.0, lists=(COMPUTE, GRAPHICS)),
        FakeProcess(12, None, 5.0, lists=(MPS,)),
        FakeProcess(13, GIB, 50.0, start_us=now + 1_000_000),
        FakeProcess(14, GIB, 50.0, end_us=now + 1_000_000),
    ]
    h = calls.device_handle(0)
    assert _lists(h) == {
        "compute": [(10, 2 * GIB, None), (11, GIB, None), (14, GIB, None)],
        "graphics": [(11, GIB, None)],
        "mps": [(12, None, None)],
    }
    clock.now_us = now + 1_000_000
    assert [p[0] for p in _lists(h)["compute"]] == [10, 11, 13]


def test_mig_instances_list_their_own(fake: FakeNvml) -> None:
    gpu = fake.gpus[0]
    enable_mig(gpu, 0, [(1, "3g.40gb"), (2, "3g.40gb")])
    gpu.mig[0].processes = [FakeProcess(20, GIB, 40.0)]
    gpu.mig[1].processes = [FakeProcess(21, 2 * GIB, 70.0), FakeProcess(22, GIB, 0.0)]
    parent = calls.device_handle(0)
    assert _lists(parent)["compute"] == [(20, GIB, 1), (21, 2 * GIB, 2), (22, GIB, 2)]
    second = calls.mig_device_handle(parent, 1)
    assert _lists(second)["compute"] == [(21, 2 * GIB, 2), (22, GIB, 2)]
    samples = calls.process_utilization(second, 0)
    assert sorted((pid, sm) for pid, _, sm in samples) == [(21, 70), (22, 0)]


def test_utilisation_history_and_since(fake: FakeNvml) -> None:
    clock = fake.clock_us
    assert isinstance(clock, Clock)
    gpu = fake.gpus[0]
    gpu.process_util_history = 10
    gpu.processes = [FakeProcess(10, GIB, lambda ts: float((ts // PERIOD_US) % 3) * 10)]
    h = calls.device_handle(0)
    got = calls.process_utilization(h, clock.now_us - 5 * PERIOD_US)
    assert len(got) == 5  # the periods since, not the older ones in the driver's buffer
    assert calls.process_utilization(h, clock.now_us) == []
    gpu.errors["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError):
        calls.process_utilization(h, 0)


def test_one_window_split_among_consumers(fake: FakeNvml, tmp_path: Path) -> None:
    """What a slow lane does per window: list reads and utilisation samples over the window,
    pids to consumers through procfs, then the split."""
    clock = fake.clock_us
    assert isinstance(clock, Clock)
    root = t.host_procfs(tmp_path)
    t.add_process(root, 100, t.K8S_SYSTEMD_CONTAINERD)
    t.add_process(root, 101, t.K8S_SYSTEMD_CONTAINERD)  # a second process of the container
    t.add_process(root, 200, t.SLURM_V2)
    t.add_process(root, 300, t.ROOT_CGROUP, comm="idle-holder", uid=7)
    start = clock.now_us
    gpu = fake.gpus[0]
    gpu.process_util_history = 10
    gpu.processes = [
        FakeProcess(100, 3 * GIB, 40.0),
        FakeProcess(101, GIB, 20.0, lists=(COMPUTE, GRAPHICS)),
        FakeProcess(200, 2 * GIB, 30.0, start_us=start + 500_000),  # joins halfway
        FakeProcess(300, 5 * GIB, 0.0),  # holds memory, uses no SM
    ]
    h = calls.device_handle(0)
    entries: list[tuple[int, int, float | None]] = []
    for read in range(10):  # one list read per 100 ms of a 1 s window
        clock.now_us = start + read * PERIOD_US
        for kind, _ in calls.PROCESS_LISTS:
            entries += [(pid, read, mem) for pid, mem, _ in calls.running_processes(h, kind)]
    clock.now_us = start + 10 * PERIOD_US - 1
    samples = [(pid, ts, float(sm)) for pid, ts, sm in calls.process_utilization(h, start - 1)]
    assert len({ts for _, ts, _ in samples}) == 10
    consumers = ProcfsReader(str(root)).consumers({pid for pid, _, _ in entries})
    got = split(WindowUse.of(300.0, samples, entries), consumers)
    by = {s.consumer: s for s in got.shares}
    pod = Consumer(Kind.POD, pod_uid=t.POD_UID, container_id=t.CONTAINER_ID)
    job = Consumer(Kind.HPC_JOB, hpc_job=t.JOB)
    idle = Consumer(Kind.COMMAND, uid=7, command="idle-holder")
    assert set(by) == {pod, job, idle}
    assert by[pod].sm_ratio == pytest.approx(0.6)
    assert by[job].sm_ratio == pytest.approx(0.15)  # 30 % for half the window
    assert by[idle].sm_ratio == 0.0
    assert by[pod].memory_used_bytes == 4 * GIB  # 3 + 1, its process in two lists once
    assert by[job].memory_used_bytes == 2 * GIB
    assert by[idle].memory_used_bytes == 5 * GIB
    assert by[pod].energy_j == pytest.approx(240.0)  # 0.6 / 0.75 of 300 J
    assert by[job].energy_j == pytest.approx(60.0)
    assert by[idle].energy_j == 0.0
    assert got.total_j == pytest.approx(300.0, rel=1e-12)


def test_consumer_reads_gather_a_window_per_device(fake: FakeNvml, tmp_path: Path) -> None:
    clock = fake.clock_us
    assert isinstance(clock, Clock)
    start = clock.now_us
    gpu = fake.gpus[0]
    gpu.process_util_history = 10
    gpu.processes = [
        FakeProcess(100, 3 * GIB, 40.0, lists=(COMPUTE, GRAPHICS)),
        FakeProcess(200, 2 * GIB, 30.0, start_us=start + 500_000, end_us=start + 1_500_000),
    ]
    reads = ConsumerReads([(calls.device_handle(0), "GPU 0")])
    clock.now_us = start - PERIOD_US + 1
    reads.read()  # before the window: the driver's older samples are not the window's
    reads.take()
    for k in range(10):
        clock.now_us = start + k * PERIOD_US + 1
        reads.read()
    (first,) = reads.take()
    for k in range(10, 20):
        clock.now_us = start + k * PERIOD_US + 1
        reads.read()
    (second,) = reads.take()
    root = t.host_procfs(tmp_path)
    t.add_process(root, 100, t.K8S_CGROUPFS)
    t.add_process(root, 200, t.SLURM_V1)
    consumers = ProcfsReader(str(root)).consumers([100, 200])
    pod, job = consumers[100], consumers[200]
    by = {s.consumer: s for s in split(replace(first, energy_j=100.0), consumers).shares}
    assert by[pod].sm_ratio == pytest.approx(0.4)
    assert by[job].sm_ratio == pytest.approx(0.15)
    assert by[pod].memory_used_bytes == 3 * GIB  # in two lists, counted once
    assert by[pod].energy_j + by[job].energy_j == pytest.approx(100.0)
    later = {s.consumer: s for s in split(second, consumers).shares}
    assert later[job].sm_ratio == pytest.approx(0.15)  # left halfway through the second window
    assert set(second.util_timestamp_us.tolist()) == {start + k * PERIOD_US for k in range(10, 20)}


def test_consumer_reads_degrade(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    gpu = fake.gpus[0]
    gpu.processes = [FakeProcess(100, GIB, 40.0)]
    fake.missing |= {"nvmlDeviceGetMPSComputeRunningProcesses_v3"}
    gpu.errors["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    reads = ConsumerReads([(calls.device_handle(0), "GPU 0")])
    with caplog.at_level(logging.INFO, "hfsampler.sources.nvml.consumer_reads"):
        reads.read()
        reads.read()
        gpu.errors["nvmlDeviceGetComputeRunningProcesses_v3"] = pynvml.NVML_ERROR_UNKNOWN
        reads.read()
        reads.read()
        del gpu.errors["nvmlDeviceGetComputeRunningProcesses_v3"]
        reads.read()
    (use,) = reads.take()
    assert len(use.mem_pid) == 3  # three good reads of one process; the failed ones skipped
    assert len(use.util_pid) == 0
    said = [r.getMessage() for r in caplog.records]
    assert sum("no mps process list" in m for m in said) == 1
    assert sum("no per-process utilisation" in m for m in said) == 1
    assert sum("cannot list" in m for m in said) == 1
    assert sum("listed again" in m for m in said) == 1
    got = split(replace(use, energy_j=10.0), {100: Consumer(Kind.HPC_JOB, hpc_job="1")})
    assert got.unattributed_j == 10.0  # no utilisation: nobody is charged

"""Faults of `run`'s consumers, in this process on a virtual clock with the fake NVML: a procfs
hidden by a PID namespace or missing, a process gone between two reads, a pid reused, the
container runtime's socket missing, slow or refusing, a process list that fails. Each is one log
line, attribution degrades to what is known, no window is lost, nothing crashes."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import grpc
import procfs_trees as t
import pytest
import yaml
from conformance import ConformanceReceiver, is_stale_marker
from fake_cri import FakeContainer, FakeRuntime, FakeSandbox, fake_runtime
from fake_nvml import FakeNvml, FakeProcess, install, make_fake
from inprocess import start_ns

from hfsampler import selfmetrics as sm
from hfsampler.cli.main import build_parser
from hfsampler.config.flags import config_from_args
from hfsampler.export import consumer_series as cs
from hfsampler.export.service import Service
from hfsampler.sampling.plan import build_run
from hfsampler.sampling.stepping import VirtualClock

__all__ = ["fake_runtime"]  # fixtures

S = 10**9
GIB = 1 << 30
WINDOWS = 4


def _service(tmp_path: Path, config: dict[str, object], clock: VirtualClock) -> Service:
    path = tmp_path / "hfsampler.yml"
    path.write_text(yaml.safe_dump({"intervals": {"fast": "10ms"}, "listen": "", **config}))
    parser, _ = build_parser()
    argv = ["run", "--source", "nvml", "--config", str(path), "--duration", f"{WINDOWS}s"]
    return Service(build_run(config_from_args(parser.parse_args(argv))), clock=clock)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = install(monkeypatch, make_fake(2))
    fake.gpus[0].processes = [FakeProcess(10, 2 * GIB, 60.0), FakeProcess(20, GIB, 20.0)]
    fake.gpus[1].processes = [FakeProcess(30, GIB, 50.0)]
    return fake


def _clocked(fake: FakeNvml) -> VirtualClock:
    clock = VirtualClock(start_ns())
    fake.clock_us = lambda: clock.now_ns() // 1000
    return clock


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def _consumers(rx: ConformanceReceiver, gpu: str) -> set[tuple[tuple[str, str], ...]]:
    """The consumer labels (the GPU's left out) of a GPU's live energy series at the end."""
    gpu_keys = {"__name__", "gpu", "UUID", "device", "modelName", "hostname", "instance",
                "pci_bus_id", "DCGM_FI_DRIVER_VERSION"}  # fmt: skip
    out = set()
    for labels, samples in rx.series_named(cs.ENERGY, gpu=gpu).items():
        if any(math.isfinite(v) for _, v in samples):
            out.add(tuple((k, v) for k, v in labels if k not in gpu_keys))
    return out


async def _run(service: Service) -> None:
    assert await service.run() == 0
    assert service.windows == WINDOWS  # never a window lost


async def test_a_procfs_of_another_pid_namespace_is_said_once_and_consumers_are_unknown(
    tmp_path: Path, fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    root = t.child_procfs(tmp_path / "proc")  # a container's own /proc, not the host's
    t.add_process(root, 10, t.SLURM_V2)
    async with ConformanceReceiver() as rx:
        service = _service(tmp_path, {"procfs": str(root), "remote_write": [{"url": rx.url}]},
                           _clocked(fake))  # fmt: skip
        await _run(service)
    rx.assert_conformant()
    assert _lines(caplog, "not the host's") == 1
    assert _consumers(rx, "0") == {(("consumer", "unknown"),)}
    # the energy still adds up: all of it to the one unknown consumer
    assert service.metrics.get(sm.CONSUMER_PROCFS_FAULTS, {"kind": "namespace"}) == 1


async def test_a_missing_procfs_is_said_once_and_the_run_goes_on(
    tmp_path: Path, fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    service = _service(tmp_path, {"procfs": str(tmp_path / "nowhere")}, _clocked(fake))
    await _run(service)
    assert _lines(caplog, "has no pid 1") == 1
    assert service.metrics.get(sm.CONSUMER_PROCFS_FAULTS, {"kind": "procfs"}) == 1
    assert "Traceback" not in caplog.text


async def test_a_process_gone_between_reads_and_a_reused_pid(
    tmp_path: Path, fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.K8S_SYSTEMD_CONTAINERD, start_ticks=100)
    t.add_process(root, 20, t.SLURM_V1)
    t.add_process(root, 30, t.SYSTEMD_SERVICE)
    clock = _clocked(fake)
    started = clock.now_ns()

    async def churn() -> None:
        # pid 30's files go while NVML still lists it (it is exiting): its consumer stays
        # the one last read; pid 10 is taken by a new process of another job
        t.remove_process(root, 30)
        t.remove_process(root, 10)
        t.add_process(root, 10, t.SLURM_V2, start_ticks=900)

    clock.at(started + 2 * S + S // 2, churn)
    async with ConformanceReceiver() as rx:
        service = _service(tmp_path, {"procfs": str(root), "remote_write": [{"url": rx.url}]},
                           clock)  # fmt: skip
        await _run(service)
    rx.assert_conformant()
    energy = rx.series_named(cs.ENERGY, gpu="0")
    pod = [s for lb, s in energy.items() if dict(lb).get("pod_uid") == t.POD_UID]
    job = [s for lb, s in energy.items() if dict(lb).get("hpc_job") == t.JOB]
    assert len(pod) == 1
    assert len(job) == 1
    assert is_stale_marker(pod[0][-1][1])  # the pod left when its pid was taken
    pod_end = pod[0][-1][0]
    assert pod_end < max(ts for ts, _ in job[0])  # ... before the run ended
    # the new process of pid 10 is Slurm job 4242's (v2), which pid 20 already holds
    assert {v for _, v in job[0] if math.isfinite(v)}
    unit = _consumers(rx, "1")
    assert unit == {(("systemd_unit", "inference-server.service"),)}
    assert _lines(caplog, "is not in procfs") == 1  # pid 30's files gone: said once
    assert service.metrics.get(sm.CONSUMER_PROCFS_FAULTS, {"kind": "hidden"}) >= 1


@pytest.mark.parametrize("fault", ["missing", "slow", "refusing"])
async def test_the_container_runtime_missing_slow_or_refusing(
    tmp_path: Path,
    fake: FakeNvml,
    fake_runtime: FakeRuntime,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    caplog.set_level(logging.INFO)
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.K8S_SYSTEMD_CONTAINERD)
    fake_runtime.sandboxes = [FakeSandbox("sb1", t.POD_UID, "trainer-0", "ml")]
    fake_runtime.containers = [FakeContainer(t.CONTAINER_ID, "sb1", "train")]
    socket = str(fake_runtime.path)
    if fault == "missing":
        socket = str(fake_runtime.path.with_name("gone.sock"))
    elif fault == "slow":
        fake_runtime.delay_s = 30.0  # the client's timeout (1 s) ends the ask
    else:
        fake_runtime.fail_with = grpc.StatusCode.UNAVAILABLE
    config = {"procfs": str(root), "container_runtime_socket": socket}
    async with ConformanceReceiver() as rx:
        service = _service(tmp_path, {**config, "remote_write": [{"url": rx.url}]}, _clocked(fake))
        await _run(service)
    rx.assert_conformant()
    said = "does not exist" if fault == "missing" else "keeping the names last known"
    assert _lines(caplog, said) == 1
    # known without the runtime: the pod's uid and container id, no names
    (labels,) = [dict(c) for c in _consumers(rx, "0") if ("pod_uid", t.POD_UID) in c]
    assert labels["container_id"] == t.CONTAINER_ID
    assert "pod" not in labels
    assert "namespace" not in labels


async def test_a_failing_process_list_is_said_once_and_the_other_gpu_goes_on(
    tmp_path: Path, fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    import pynvml

    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.SLURM_V2)
    t.add_process(root, 30, t.SLURM_V1_NODE)
    fake.gpus[0].errors["nvmlDeviceGetComputeRunningProcesses_v3"] = pynvml.NVML_ERROR_UNKNOWN
    async with ConformanceReceiver() as rx:
        service = _service(tmp_path, {"procfs": str(root), "remote_write": [{"url": rx.url}]},
                           _clocked(fake))  # fmt: skip
        await _run(service)
    rx.assert_conformant()
    assert _lines(caplog, "cannot list the processes on GPU 0") == 1
    assert _consumers(rx, "1") == {(("hpc_job", t.JOB_2),)}
    # GPU 0's utilisation samples still name its processes; their memory is unknown
    assert not rx.series_named(cs.MEMORY_USED, gpu="0")
    assert rx.series_named(cs.SM_RATIO, gpu="0")

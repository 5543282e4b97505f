"""Consumer attribution end to end below the service: made-up procfs trees and a fake container
runtime name the consumers of two GPU rows; the energy counters add up to the GPUs' energy."""

from __future__ import annotations

from pathlib import Path

import procfs_trees as t
import pytest

pytest.importorskip("grpc", reason="pip install 'hfsampler[k8s]' for the CRI client")

from fake_cri import FakeContainer, FakeRuntime, FakeSandbox, fake_runtime

from hfsampler.config.loader import from_mapping
from hfsampler.consumers.split import WindowUse
from hfsampler.export import consumer_series as cs
from hfsampler.export.consumer_attribution import ConsumerAttribution
from hfsampler.export.consumer_run import ConsumerRun
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import SeriesRegistry, is_stale
from hfsampler.sources.sim.consumers import SimConsumerLists

__all__ = ["fake_runtime"]  # fixtures

GIB = float(1 << 30)
GPU0 = {"gpu": "0", "UUID": "GPU-0"}
GPU1 = {"gpu": "1", "UUID": "GPU-1"}


def test_two_gpus_shared_by_a_pod_a_job_and_a_user(
    tmp_path: Path, fake_runtime: FakeRuntime
) -> None:
    fake_runtime.sandboxes = [FakeSandbox("sb", t.POD_UID, "trainer-0", "ml", {"team": "cv"})]
    fake_runtime.containers = [FakeContainer(t.CONTAINER_ID, "sb", "train")]
    root = t.host_procfs(tmp_path)
    t.add_process(root, 10, t.K8S_SYSTEMD_CONTAINERD)
    t.add_process(root, 20, t.SLURM_V2)
    t.add_process(root, 30, t.ROOT_CGROUP, comm="notebook", uid=1001)
    registry = SeriesRegistry()
    attribution = ConsumerAttribution(registry, {"cluster": "c"}, procfs=str(root),
                                      runtime_socket=str(fake_runtime.path),
                                      pod_label_allowlist="team")  # fmt: skip
    try:
        attribution.refresh_names()
        gpu0 = WindowUse.of(200.0, [(10, 0, 60.0), (20, 0, 20.0)], [(10, 0, 4 * GIB), (20, 0, GIB)])
        gpu1 = WindowUse.of(50.0, [(30, 0, 0.0)], [(30, 0, 2 * GIB)])
        series, values = attribution.window([(GPU0, gpu0), (GPU1, gpu1)])
        got = {(s.name, tuple(sorted(s.labels))): v for s, v in zip(series, values, strict=True)}
        names = {"pod": "trainer-0", "namespace": "ml", "container": "train", "team": "cv"}
        pod = {
            **GPU0,
            "cluster": "c",
            "pod_uid": t.POD_UID,
            "container_id": t.CONTAINER_ID,
            **names,
        }
        assert got[(cs.ENERGY, tuple(sorted(pod.items())))] == pytest.approx(150.0)
        job = {**GPU0, "cluster": "c", "hpc_job": t.JOB}
        assert got[(cs.ENERGY, tuple(sorted(job.items())))] == pytest.approx(50.0)
        user = {**GPU1, "cluster": "c", "uid": "1001", "command": "notebook"}
        assert got[(cs.MEMORY_USED, tuple(sorted(user.items())))] == 2 * GIB
        assert got[(cs.UNATTRIBUTED, tuple(sorted({**GPU1, "cluster": "c"}.items())))] == 50.0
        energy = sum(v for (name, _), v in got.items() if name in (cs.ENERGY, cs.UNATTRIBUTED))
        assert energy == pytest.approx(250.0)
        series, values = attribution.end()
        assert all(is_stale(v) for v in values)
        assert len(registry) == 0
    finally:
        attribution.close()


def test_a_shutdown_right_after_a_reload_ends_the_series_the_reload_left(tmp_path: Path) -> None:
    # a reload's old series wait for the next window to end; a shutdown before it must end them

    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.SLURM_V2)
    registry = SeriesRegistry()
    config = from_mapping({"procfs": str(root), "consumers": True})
    lists = SimConsumerLists(1, 0, str(tmp_path / "sim"), lambda: 0)
    run = ConsumerRun(config, lists, registry, {"hostname": "n1"}, (), SelfMetrics())
    use = WindowUse.of(10.0, [(10, 0, 50.0)], [(10, 0, 1.0)])
    live, _ = run.attribution.window([({"gpu": "0", "UUID": "GPU-0"}, use)])
    run.reconfigure(from_mapping({"procfs": str(root), "consumers": {"max_per_gpu": 2}}), {})
    ended, values = run.end()
    assert {s.id for s in live} <= {s.id for s in ended}
    assert all(is_stale(v) for v in values)
    run.close()

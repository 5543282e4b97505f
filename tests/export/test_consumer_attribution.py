"""Consumer attribution end to end below the service: made-up procfs trees and a fake container
runtime name the consumers of two GPU rows; the energy counters add up to the GPUs' energy."""

from __future__ import annotations

from pathlib import Path

import procfs_trees as t
import pytest

pytest.importorskip("grpc", reason="pip install 'hfsampler[k8s]' for the CRI client")

from fake_cri import FakeContainer, FakeRuntime, FakeSandbox, cri_dir, fake_runtime

from hfsampler.consumers.split import WindowUse
from hfsampler.export import consumer_series as cs
from hfsampler.export.consumer_attribution import ConsumerAttribution
from hfsampler.series import SeriesRegistry, is_stale

__all__ = ["cri_dir", "fake_runtime"]  # fixtures

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

"""Pod and job attribution: a fake kubelet speaking the real pod-resources gRPC API on a Unix
socket, job-mapping files, the metric model's relabelling with stale markers, and one CLI run that
shows pod labels on /metrics."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hfsampler import fields
from hfsampler.config.loader import from_mapping
from hfsampler.config.settings import Config
from hfsampler.errors import ConfigError
from hfsampler.export import attribution
from hfsampler.export.metrics import MetricModel
from hfsampler.sampling.window import STATS, WindowStats
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import is_stale
from hfsampler.sources.sim.source import SimSource

grpc = pytest.importorskip("grpc", reason="pip install 'hfsampler[k8s]' for pod attribution")
from hfsampler.export.attribution_pb import podresources_pb2 as pb  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
POWER = fields.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]
ENERGY = fields.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]


class FakeKubelet:
    """The kubelet's PodResourcesLister on a Unix socket; ``pods`` is what List answers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pods: list[tuple[str, str, str, str, list[str]]] = []  # ns, pod, ctr, res, ids
        self.calls = 0
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list,
                    request_deserializer=pb.ListPodResourcesRequest.FromString,
                    response_serializer=pb.ListPodResourcesResponse.SerializeToString,
                )
            },
        )
        self._server.add_generic_rpc_handlers((handler,))
        assert self._server.add_insecure_port(f"unix://{path}") != 0

    def _list(self, request: Any, context: Any) -> Any:
        self.calls += 1
        resp = pb.ListPodResourcesResponse()
        for namespace, pod, container, resource, ids in self.pods:
            pr = resp.pod_resources.add(name=pod, namespace=namespace)
            c = pr.containers.add(name=container)
            c.devices.add(resource_name=resource, device_ids=ids)
        return resp

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None).wait()


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(sock_dir / "kubelet.sock")
    k.start()
    try:
        yield k
    finally:
        k.stop()


def _devices(gpus: int = 2) -> tuple[Any, ...]:
    return SimSource(gpus).open([POWER]).devices


def test_pod_labels_by_uuid_index_and_replica(kubelet: FakeKubelet) -> None:
    devs = _devices(3)
    kubelet.pods = [
        ("ml", "train-0", "trainer", "nvidia.com/gpu", [devs[0].uuid]),
        ("ml", "infer-1", "server", "nvidia.com/gpu", ["1"]),  # DEVICE_ID_STRATEGY=index
        ("dev", "notebook", "jupyter", "nvidia.com/gpu", [f"{devs[2].uuid}::3"]),  # time-slicing
        ("ml", "other", "x", "example.com/fpga", [devs[2].uuid]),  # not a GPU resource
    ]
    labeller = attribution.PodResourcesLabeller(str(kubelet.path), devs)
    try:
        got = labeller.labels()
    finally:
        labeller.close()
    assert got == [
        {"pod": "train-0", "namespace": "ml", "container": "trainer"},
        {"pod": "infer-1", "namespace": "ml", "container": "server"},
        {"pod": "notebook", "namespace": "dev", "container": "jupyter"},
    ]


def test_shared_gpu_goes_to_first_holder_stably(kubelet: FakeKubelet) -> None:
    devs = _devices(1)
    kubelet.pods = [
        ("b", "p2", "c", "nvidia.com/gpu", [f"{devs[0].uuid}::1"]),
        ("a", "p9", "c", "nvidia.com/gpu", [f"{devs[0].uuid}::0"]),
    ]
    labeller = attribution.PodResourcesLabeller(str(kubelet.path), devs)
    try:
        assert labeller.labels() == [{"pod": "p9", "namespace": "a", "container": "c"}]
    finally:
        labeller.close()


def test_free_gpu_has_no_pod_labels(kubelet: FakeKubelet) -> None:
    devs = _devices(2)
    kubelet.pods = [("ml", "train-0", "trainer", "nvidia.com/mig-1g.10gb", [devs[1].uuid])]
    labeller = attribution.PodResourcesLabeller(str(kubelet.path), devs)
    try:
        assert labeller.labels() == [{}, {"pod": "train-0", "namespace": "ml",
                                          "container": "trainer"}]  # fmt: skip
    finally:
        labeller.close()


def test_kubelet_down_keeps_last_labels_and_warns_once(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    devs = _devices(1)
    k = FakeKubelet(sock_dir / "kubelet.sock")
    k.pods = [("ml", "train-0", "t", "nvidia.com/gpu", [devs[0].uuid])]
    k.start()
    labeller = attribution.PodResourcesLabeller(str(k.path), devs, timeout_s=0.5)
    try:
        first = labeller.labels()
        k.stop()
        with caplog.at_level(logging.WARNING, "hfsampler.export.attribution"):
            assert labeller.labels() == first
            assert labeller.labels() == first
        warnings = [r for r in caplog.records if "pod-resources" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        labeller.close()
        k.stop()


def test_job_mapping_dir(tmp_path: Path) -> None:
    devs = _devices(3)
    (tmp_path / "0").write_text("4711\n")
    (tmp_path / "1").write_text("100\n\n101\n")  # two jobs share GPU 1
    (tmp_path / devs[2].uuid).write_text("")  # empty: the job ended
    labeller = attribution.JobMappingLabeller(str(tmp_path), devs)
    assert labeller.labels() == [{"hpc_job": "4711"}, {"hpc_job": "100,101"}, {}]
    (tmp_path / "0").unlink()
    (tmp_path / devs[2].uuid).write_text("999\n")
    assert labeller.labels() == [{}, {"hpc_job": "100,101"}, {"hpc_job": "999"}]


def test_build_labeller_combines(tmp_path: Path, kubelet: FakeKubelet) -> None:
    devs = _devices(1)
    (tmp_path / "0").write_text("42\n")
    kubelet.pods = [("ml", "p", "c", "nvidia.com/gpu", [devs[0].uuid])]
    assert attribution.build_labeller(devs, None, None) is None
    labeller = attribution.build_labeller(devs, str(kubelet.path), str(tmp_path))
    assert labeller is not None
    try:
        assert labeller.labels() == [
            {"pod": "p", "namespace": "ml", "container": "c", "hpc_job": "42"}
        ]
    finally:
        labeller.close()


def _stats(mean: list[list[float]]) -> WindowStats:
    m = np.array(mean, dtype=np.float64)
    c = np.full(m.shape, 10, dtype=np.int64)
    values = {**{s.name: m for s in STATS}, "min": m - 1, "max": m + 1, "p99": m + 0.5}
    return WindowStats(0, 1, (POWER, ENERGY), values, c)


def test_model_relabels_and_marks_old_series_stale() -> None:
    devs = _devices(2)
    model = MetricModel(devs, {"g": (POWER, ENERGY)}, SelfMetrics(), {"cluster": "c"}, "node")
    up = np.array([True, True])
    w = {"g": _stats([[300, 5e9], [310, 6e9]])}
    model.set_extra_labels([{"pod": "a", "namespace": "ml", "container": "t"}, {}])
    first = model.snapshot(w, up, 1_000_000_000)
    pods = {dict(s.labels).get("pod") for s in first.series if dict(s.labels).get("gpu") == "0"}
    assert pods == {"a"}
    model.set_extra_labels([{"pod": "b", "namespace": "ml", "container": "t"}, {}])
    second = model.snapshot(w, up, 2_000_000_000)
    by_pod: dict[str | None, list[float]] = {}
    for s, v in second.items():
        if dict(s.labels).get("gpu") == "0":
            by_pod.setdefault(dict(s.labels).get("pod"), []).append(v)
    # every series of pod a ends with a stale marker; pod b's carry the values, counter included
    assert all(is_stale(v) for v in by_pod["a"])
    assert len(by_pod["a"]) == len(by_pod["b"]) >= 5  # POWER + 3 siblings + ENERGY (+ refresh)
    assert not any(is_stale(v) for v in by_pod["b"])
    gpu1 = [v for s, v in second.items() if dict(s.labels).get("gpu") == "1"]
    assert gpu1
    assert not any(is_stale(v) for v in gpu1)
    # an external label is never overridden by attribution
    model.set_extra_labels([{"cluster": "pod-says-otherwise"}, {}])
    third = model.snapshot(w, up, 3_000_000_000)
    assert {dict(s.labels)["cluster"] for s in third.series if s.name == POWER.name} == {"c"}


def test_config_keys() -> None:
    c = from_mapping(
        {
            "pod_resources_socket": "/var/lib/kubelet/pod-resources/kubelet.sock",
            "hpc_job_mapping_dir": "/run/jobs",
        }
    )
    assert c.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert c.hpc_job_mapping_dir == "/run/jobs"
    with pytest.raises(ConfigError, match=r"hpc_job_mapping_dir.*absolute"):
        Config(hpc_job_mapping_dir="jobs")
    with pytest.raises(ConfigError, match="pod_resources_socket"):
        from_mapping({"pod_resources_socket": 3})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_cli_run_labels_series_with_pods(kubelet: FakeKubelet) -> None:
    """`hfsampler run --pod-resources-socket` puts the fake kubelet's pods on /metrics (a real
    process: the flag, the socket and the page as a scraper sees them). It runs until the pod is
    seen, then stops as Ctrl-C stops it, so a slow start on a busy machine only makes it longer."""
    devs = _devices(2)
    kubelet.pods = [("ml", "train-0", "trainer", "nvidia.com/gpu", [devs[1].uuid])]
    port = _free_port()
    args = [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--gpus", "2",
            "--duration", "60s", "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
            "--fields", "power_usage,gpu_util",
            "--pod-resources-socket", str(kubelet.path)]  # fmt: skip
    with subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        text = ""
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and 'pod="train-0"' not in text:
            time.sleep(0.3)
            url = f"http://127.0.0.1:{port}/metrics"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode()
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_UTIL{")]
    gpu1 = [ln for ln in lines if 'gpu="1"' in ln]
    gpu0 = [ln for ln in lines if 'gpu="0"' in ln]
    assert gpu1, text
    for ln in gpu1:
        assert 'pod="train-0"' in ln, ln
        assert 'namespace="ml"' in ln, ln
        assert 'container="trainer"' in ln, ln
    assert gpu0
    assert not any("pod=" in ln for ln in gpu0)
    assert kubelet.calls >= 1


def test_method_path_and_field_numbers_match_the_kubelet() -> None:
    svc = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert "/" + svc.methods_by_name["List"].full_name.replace(".List", "/List") == (
        attribution.LIST_METHOD
    )

    def numbers(msg: Any) -> dict[str, int]:
        return {f.name: f.number for f in msg.DESCRIPTOR.fields}

    assert numbers(pb.ListPodResourcesResponse) == {"pod_resources": 1}
    assert numbers(pb.PodResources) == {"name": 1, "namespace": 2, "containers": 3}
    assert numbers(pb.ContainerResources) == {"name": 1, "devices": 2, "cpu_ids": 3}
    assert numbers(pb.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}

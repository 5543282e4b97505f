"""Pod and job attribution: extra labels per GPU, asked once per window by the service.

In Kubernetes the kubelet's pod-resources socket says which container holds which GPU; each GPU's
series then carry ``pod``, ``namespace`` and ``container`` as dcgm-exporter's do. Outside
Kubernetes a job-mapping directory (dcgm-exporter's ``--hpc-job-mapping-dir``: one file per GPU,
named by its index, listing the job ids running on it, written by the batch system's prolog and
removed by its epilog) gives an ``hpc_job`` label. A labeller never raises: when its source fails
it logs once and keeps the labels it last knew, because dropping attribution for a window would
split every series in two.

A MIG instance is attributed on its own row: the device plugin names a MIG slice by the MIG
device's UUID (``MIG-...``, or ``MIG-GPU-<uuid>/<gi>/<ci>`` from older plugins), and a job file
for one is named ``<gpu>.<GPU_I_ID>`` as dcgm-exporter's are. The service gives a labeller the
rows' devices again when the MIG layout changes (``set_devices``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from hfsampler.sources.base import DeviceInfo

log = logging.getLogger(__name__)

Labels = Mapping[str, str]

LIST_METHOD = "/v1.PodResourcesLister/List"
HPC_JOB_LABEL = "hpc_job"
# The NVIDIA device plugin advertises whole GPUs as nvidia.com/gpu and MIG slices as
# nvidia.com/mig-<profile>; other vendors' devices on the node are not ours.
NVIDIA_RESOURCE_PREFIX = "nvidia.com/"
# Time-slicing replicas are advertised as "<id>::<n>"; the part before "::" is the GPU.
REPLICA_SEPARATOR = "::"
MAX_JOB_FILE_BYTES = 64 * 1024


class Labeller(Protocol):
    """Extra labels for each GPU, in the order of the devices it was built for."""

    def labels(self) -> list[dict[str, str]]: ...

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        """The rows' devices now (a MIG slot holds another instance)."""
        ...

    def close(self) -> None: ...


def _device_keys(devices: Sequence[DeviceInfo]) -> dict[str, int]:
    """What a device id may be (UUID or index, as the device plugin's strategy says) → position.

    A MIG instance's row answers to its MIG UUIDs only: the GPU's own ids stay the GPU's.
    """
    keys: dict[str, int] = {}
    for pos, d in enumerate(devices):
        if d.is_gpu:
            keys[d.uuid] = pos
            keys[str(d.index)] = pos
        elif d.mig is not None:
            keys[d.mig.uuid] = pos
            keys[f"MIG-{d.uuid}/{d.mig.gpu_instance_id}/{d.mig.compute_instance_id}"] = pos
    return keys


def job_file_names(device: DeviceInfo) -> tuple[str, ...]:
    """The job-mapping file names of a row, first match wins: ``0`` or the GPU's UUID; for a
    MIG instance ``0.<GPU_I_ID>`` as dcgm-exporter names them, or its MIG UUID."""
    if device.is_gpu:
        return (str(device.index), device.uuid)
    if device.mig is None:
        return ()
    return (f"{device.index}.{device.mig.gpu_instance_id}", device.mig.uuid)


def pod_labels_from_response(response: Any, devices: Sequence[DeviceInfo]) -> list[dict[str, str]]:
    """Per-GPU ``pod`` / ``namespace`` / ``container`` from a ``ListPodResourcesResponse``.

    A GPU held by several containers (time-slicing) is attributed to the first in
    (namespace, pod, container) order, so the choice is stable from one window to the next.
    """
    keys = _device_keys(devices)
    holders: list[list[tuple[str, str, str]]] = [[] for _ in devices]
    for pod in response.pod_resources:
        for container in pod.containers:
            for dev in container.devices:
                if not dev.resource_name.startswith(NVIDIA_RESOURCE_PREFIX):
                    continue
                for device_id in dev.device_ids:
                    pos = keys.get(device_id.split(REPLICA_SEPARATOR, 1)[0])
                    if pos is not None:
                        holders[pos].append((pod.namespace, pod.name, container.name))
    out: list[dict[str, str]] = []
    for found in holders:
        if not found:
            out.append({})
            continue
        namespace, pod_name, container_name = min(found)
        labels = {"pod": pod_name, "namespace": namespace, "container": container_name}
        out.append({k: v for k, v in labels.items() if v})  # empty values are not labels
    return out


class PodResourcesLabeller:
    """Asks the kubelet's pod-resources API (gRPC over a Unix socket) which pod holds each GPU."""

    def __init__(
        self, socket_path: str, devices: Sequence[DeviceInfo], timeout_s: float = 1.0
    ) -> None:
        import grpc  # the `k8s` extra; imported only when attribution is configured

        from hfsampler.export.attribution_pb import podresources_pb2 as pb

        self.socket_path = socket_path
        self.devices = tuple(devices)
        self.timeout_s = timeout_s
        self._request = pb.ListPodResourcesRequest()
        self._channel = grpc.insecure_channel(f"unix://{os.path.abspath(socket_path)}")
        self._list = self._channel.unary_unary(
            LIST_METHOD,
            request_serializer=pb.ListPodResourcesRequest.SerializeToString,
            response_deserializer=pb.ListPodResourcesResponse.FromString,
        )
        self._rpc_error: type[Exception] = grpc.RpcError
        self._last: list[dict[str, str]] = [{} for _ in self.devices]
        self._failing = False

    def labels(self) -> list[dict[str, str]]:
        try:
            response = self._list(self._request, timeout=self.timeout_s)
        except self._rpc_error as exc:
            if not self._failing:
                detail = exc.details() if hasattr(exc, "details") else str(exc)
                log.warning(
                    "pod-resources %s: %s; keeping the last known pod labels",
                    self.socket_path,
                    detail,
                )
                self._failing = True
            return self._last
        if self._failing:
            log.info("pod-resources %s answers again", self.socket_path)
            self._failing = False
        self._last = pod_labels_from_response(response, self.devices)
        return self._last

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        self.devices = tuple(devices)

    def close(self) -> None:
        self._channel.close()


def read_job_file(path: Path) -> str | None:
    """The jobs listed in one mapping file (one id per line), joined by commas; None if none."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_JOB_FILE_BYTES)
    except FileNotFoundError:
        return None
    jobs = [line.strip() for line in data.decode("utf-8", "replace").splitlines()]
    jobs = [j for j in jobs if j]
    return ",".join(jobs) if jobs else None


class JobMappingLabeller:
    """``hpc_job`` per GPU from a directory with one file per GPU index (or UUID)."""

    def __init__(self, directory: str, devices: Sequence[DeviceInfo]) -> None:
        self.directory = Path(directory)
        self.devices = tuple(devices)
        self._failing = False

    def labels(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for d in self.devices:
            job = None
            try:
                for name in job_file_names(d):
                    job = read_job_file(self.directory / name)
                    if job is not None:
                        break
            except OSError as exc:
                if not self._failing:
                    log.warning("job mapping %s: %s", self.directory, exc)
                    self._failing = True
                job = None
            out.append({HPC_JOB_LABEL: job} if job else {})
        return out

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        self.devices = tuple(devices)

    def close(self) -> None:
        pass


class CombinedLabeller:
    """Several labellers' labels merged per GPU (later ones win on a clash)."""

    def __init__(self, parts: Sequence[Labeller]) -> None:
        self.parts = tuple(parts)

    def labels(self) -> list[dict[str, str]]:
        merged: list[dict[str, str]] | None = None
        for part in self.parts:
            got = part.labels()
            if merged is None:
                merged = got
            else:
                merged = [{**a, **b} for a, b in zip(merged, got, strict=True)]
        return merged or []

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        for part in self.parts:
            part.set_devices(devices)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def build_labeller(
    devices: Sequence[DeviceInfo],
    pod_resources_socket: str | None,
    hpc_job_mapping_dir: str | None,
) -> Labeller | None:
    """The labeller the config asks for, or None when there is no attribution to do."""
    parts: list[Labeller] = []
    if pod_resources_socket:
        if not os.path.exists(pod_resources_socket):
            log.warning(
                "pod-resources socket %s does not exist (yet): pod labels appear once the "
                "kubelet creates it; mount /var/lib/kubelet/pod-resources into the pod",
                pod_resources_socket,
            )
        parts.append(PodResourcesLabeller(pod_resources_socket, devices))
    if hpc_job_mapping_dir:
        parts.append(JobMappingLabeller(hpc_job_mapping_dir, devices))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else CombinedLabeller(parts)

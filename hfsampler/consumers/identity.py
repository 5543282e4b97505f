"""The consumer a GPU process belongs to, and the labels that name it.

One frozen value per consumer, equal for every process of the same job, container, unit or
user's command, so processes sum per consumer by plain dictionary keys. Its labels never carry a
pid: a pid names a process for a few seconds and would make a new series each time one starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from hfsampler.logs import one_line

HPC_JOB_LABEL = "hpc_job"  # as dcgm-exporter and export/attribution.py name it
POD_UID_LABEL = "pod_uid"
CONTAINER_ID_LABEL = "container_id"
UNIT_LABEL = "systemd_unit"
UID_LABEL = "uid"
COMMAND_LABEL = "command"
CONSUMER_LABEL = "consumer"
UNKNOWN = "unknown"  # the value of ``consumer`` where nothing about the process is known

# The labels a consumer's identity may carry: Kubernetes pod labels never override these.
IDENTITY_LABELS = frozenset(
    {HPC_JOB_LABEL, POD_UID_LABEL, CONTAINER_ID_LABEL, UNIT_LABEL, UID_LABEL, COMMAND_LABEL,
     CONSUMER_LABEL}
)  # fmt: skip

# A GPU row's labels (export.metrics.gpu_labels: dcgm-exporter's, a MIG instance's, the host's
# by default): a pod label of one of these names would pass a whole GPU's consumer off as a MIG
# instance's (GPU_I_ID where the row has none) or as another host's, so pod labels never take them.
GPU_LABELS = frozenset(
    {"gpu", "UUID", "device", "modelName", "Hostname", "hostname", "instance", "pci_bus_id",
     "DCGM_FI_DRIVER_VERSION", "GPU_I_ID", "GPU_I_PROFILE", "MIG_UUID"}
)  # fmt: skip

MAX_VALUE_CHARS = 128  # a label value taken from the host (a unit, a command) is cut here
_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")


class Kind(Enum):
    """What a consumer is, most specific first."""

    HPC_JOB = "hpc_job"
    POD = "pod"  # a Kubernetes pod's container (container_id may be empty: the pod's own cgroup)
    CONTAINER = "container"  # a container outside Kubernetes (plain Docker, containerd)
    UNIT = "unit"  # a systemd unit; a user's session is their user@UID.service
    COMMAND = "command"  # none of those: the user and the command name
    UNKNOWN = "unknown"  # the process is not visible (another PID namespace, gone, unreadable)


@dataclass(frozen=True, slots=True)
class Consumer:
    """Who a GPU process belongs to. Only the fields its ``kind`` uses are set."""

    kind: Kind
    hpc_job: str = ""
    pod_uid: str = ""
    container_id: str = ""
    unit: str = ""
    uid: int | None = None
    command: str = ""

    def __post_init__(self) -> None:
        # Equal labels must mean an equal consumer, or two would share a series and send two
        # samples of it at one timestamp: a process may name itself "" (PR_SET_NAME).
        if self.kind is Kind.COMMAND and not self.command:
            object.__setattr__(self, "command", UNKNOWN)

    @classmethod
    def unknown(cls) -> Consumer:
        return _UNKNOWN

    def labels(self) -> dict[str, str]:
        """The labels that name this consumer (no pid, no empty value)."""
        if self.kind is Kind.HPC_JOB:
            return {HPC_JOB_LABEL: self.hpc_job}
        if self.kind in (Kind.POD, Kind.CONTAINER):
            out = {POD_UID_LABEL: self.pod_uid, CONTAINER_ID_LABEL: self.container_id}
            return {k: v for k, v in out.items() if v}
        if self.kind is Kind.UNIT:
            return {UNIT_LABEL: self.unit}
        if self.kind is Kind.COMMAND:
            out = {COMMAND_LABEL: self.command}
            if self.uid is not None:
                out[UID_LABEL] = str(self.uid)
            return out
        return {CONSUMER_LABEL: UNKNOWN}


_UNKNOWN = Consumer(Kind.UNKNOWN)


def label_value(text: str) -> str:
    """A value read from the host made fit for a label: one printable line, bounded. Cut
    before it is escaped too: a runtime's label value may be megabytes."""
    return one_line(text[:MAX_VALUE_CHARS])[:MAX_VALUE_CHARS]


def sanitize_label_name(name: str) -> str | None:
    """A Kubernetes label key as a metric label name, as dcgm-exporter's
    ``--kubernetes-enable-pod-labels`` makes it: every character outside ``[a-zA-Z0-9_]``
    becomes ``_`` and a leading digit gets a ``_`` before it. None for a name Prometheus keeps
    for itself (``__``), or that would replace or forge an identity or GPU label."""
    out = _INVALID_LABEL_CHARS.sub("_", name)
    if out[:1].isdigit():
        out = "_" + out
    if not out or out.startswith("__") or out in IDENTITY_LABELS or out in GPU_LABELS:
        return None
    return out

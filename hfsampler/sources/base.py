"""GPU sources: one interface (``Source``), four implementations (``nvml``, ``sim``, ``dcgm``,
``jetson``).

A source is opened inside the process that reads it (NVML handles do not cross processes), so the
sampler receives a picklable ``SourceSpec`` and builds the source with ``open_source``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from hfsampler.fields import Field

if TYPE_CHECKING:
    from hfsampler.consumers.split import WindowUse

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG GPU instance as NVML names it: what its series carry beside the parent's labels."""

    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # as NVML names it: "3g.71gb"
    uuid: str  # the MIG device's own UUID, "MIG-..."


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What labels a GPU's series: dcgm-exporter's ``gpu``, ``UUID``, ``device``, ``modelName``.

    A MIG-enabled GPU has, besides its own row, one row per MIG device it can hold (``mig_slot``
    0..max-1), made at open and kept: the instance in a slot (``mig``) is what is there now, None
    while the slot is empty, so instances created or destroyed at run time change the slot's
    labels, never the number of rows. A slot row has the parent's index, UUID and names.
    """

    index: int
    uuid: str
    model_name: str
    pci_bus_id: str
    driver_version: str
    minor_number: int
    mig_slot: int | None = None  # a MIG instance slot of GPU ``index``; None: the GPU itself
    mig: MigInstance | None = None  # the instance in the slot now; None: the slot is empty

    @property
    def device(self) -> str:
        return f"nvidia{self.minor_number}"

    @property
    def is_gpu(self) -> bool:
        """A physical GPU's row, not a MIG instance slot."""
        return self.mig_slot is None


def physical(devices: Sequence[DeviceInfo]) -> list[int]:
    """The rows of physical GPUs among ``devices`` (MIG instance slots left out)."""
    return [r for r, d in enumerate(devices) if d.is_gpu]


@dataclass(frozen=True, slots=True)
class Inventory:
    """The devices a source opened and, per device, which of the requested fields it supports."""

    devices: tuple[DeviceInfo, ...]
    fields: tuple[Field, ...]
    supported: BoolArray  # [gpu, field]


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """How to build a source in another process: picklable, no handles. The settings that come
    from the config are those its keys declare with ``spec=`` (``resolve_source``)."""

    kind: str  # "nvml", "sim", "dcgm" or "jetson"
    gpus: int = 2  # sim: how many GPUs
    seed: int = 0  # sim: the seed of every synthetic signal
    indices: tuple[int, ...] | None = None  # nvml: which GPUs (None: all)
    dcgm_path: str | None = None  # dcgm: where DCGM's Python bindings are (None: DCGM's places)
    dcgm_host: str = "localhost"  # dcgm: the host engine
    dcgm_interval_s: float = 0.1  # dcgm: how often DCGM samples the watched fields
    jetson_root: str = "/"  # jetson: where /sys, /proc and /etc are (another root: tests only)
    # the sampler process's open, after discovery's in the service: what open finds (a missing
    # file, a period) was logged there, and is not logged again
    reopened: bool = False
    # sim: (field name, seconds) a read that includes the field takes, asleep with the GIL
    # released as in a slow NVML query; for tests and benchmarks of slow reads
    sim_read_cost_s: tuple[tuple[str, float], ...] = ()
    sim_mig: tuple[str, ...] = ()  # sim: every GPU's MIG layout (``3g,2g,1g,1g``), () for none


class Source(Protocol):
    """Reads a set of fields from every GPU into caller-owned arrays."""

    def open(self, fields: Sequence[Field]) -> Inventory:
        """Initialise, discover devices and probe each field's support on each device.

        The inventory's fields are those asked for, except that a per-instance field
        (``Field.per``) asked for without labels becomes one field per instance found.
        """
        ...

    def read(
        self, fields: Sequence[Field], values: FloatArray, driver_ts_us: IntArray, now_ns: int
    ) -> None:
        """Fill ``values[gpu, field]`` (exported units; NaN where none) and the driver timestamps.

        ``fields`` is a subset of what ``open`` returned; a GPU that is lost is marked in
        ``gpu_up`` and its row is left NaN; reading never raises for one field or one GPU.
        """
        ...

    @property
    def gpu_up(self) -> BoolArray:
        """Per GPU: still answering (a MIG slot: holding an instance that answers)."""
        ...

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        """The rows as they are now: a new tuple whenever a MIG slot's instance changed."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process on one GPU at one moment: the memory it holds and its share of the SMs."""

    pid: int
    used_memory_bytes: int | None  # None where the driver does not say
    sm_util_pct: float | None  # mean since the last read; None where the driver gives none


class ConsumerLists(Protocol):
    """Every process on the sampled GPUs and MIG instances, for `run`'s consumers: the process
    lists (read a few times per window) and the per-process utilisation samples, gathered until
    the window takes them. Runs in the service's process, never on the sampler's lanes."""

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        """The rows now (a MIG slot's instance may have changed): a GPU without MIG is read on
        its own handle, a MIG GPU on its instances' handles."""
        ...

    def read(self) -> None:
        """One read of every row's lists and of its utilisation samples since the last."""
        ...

    def take(self) -> dict[int, WindowUse]:
        """Per row read, what was gathered since the last take (``energy_j`` 0: the window's
        energy is the caller's to add); the reads start again empty."""
        ...

    def close(self) -> None: ...


class ProcessReader(Protocol):
    """Lists the compute processes of the recorded GPUs (``record``, about once a second)."""

    def read_processes(self, job_pids: Collection[int], now_ns: int) -> dict[int, list[GpuProcess]]:
        """Per GPU index, its processes now; ``job_pids`` are the recorded job's (the sim's
        processes are the job's; a real driver knows its own)."""
        ...

    def close(self) -> None: ...

"""Which source class a ``SourceSpec`` names: built here (not opened), imported only when chosen.

The imports are inside the functions so that choosing ``sim`` never loads ``pynvml`` or DCGM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hfsampler.sources.base import ConsumerLists, DeviceInfo, ProcessReader, Source, SourceSpec


def open_consumer_lists(
    spec: SourceSpec, devices: Sequence[DeviceInfo], procfs: str, clock_ns: Callable[[], int]
) -> ConsumerLists | None:
    """The process lists `run`'s consumers read, where the source has them (NVML, with a
    reference of its own; the sim's made-up ones, their procfs tree under ``procfs``)."""
    if spec.kind == "sim":
        from hfsampler.sources.sim.consumers import SimConsumerLists

        lists = SimConsumerLists(spec.gpus, spec.seed, procfs, clock_ns)
        lists.set_devices(devices)
        return lists
    if spec.kind == "nvml":
        from hfsampler.sources.nvml.consumer_reads import NvmlConsumerLists

        return NvmlConsumerLists(devices)
    return None


def open_processes(spec: SourceSpec, indices: Sequence[int]) -> ProcessReader | None:
    """The process list for the GPUs ``indices`` of a source, where the source has one."""
    if spec.kind == "sim":
        from hfsampler.sources.sim.source import SimSource

        return SimSource(gpus=spec.gpus, seed=spec.seed)
    if spec.kind == "nvml":
        from hfsampler.sources.nvml.processes import NvmlProcesses

        return NvmlProcesses(indices)
    return None


def open_source(spec: SourceSpec) -> Source:
    """Build (not open) the source a spec names."""
    if spec.kind == "sim":
        from hfsampler.sources.sim.source import SimSource

        return SimSource(
            gpus=spec.gpus, seed=spec.seed, read_cost_s=dict(spec.sim_read_cost_s), mig=spec.sim_mig
        )
    if spec.kind == "nvml":
        from hfsampler.sources.nvml.source import NvmlSource

        return NvmlSource(indices=spec.indices, reopened=spec.reopened)
    if spec.kind == "dcgm":
        from hfsampler.sources.dcgm import DcgmSource

        return DcgmSource(spec.dcgm_path, spec.dcgm_host, spec.dcgm_interval_s)
    if spec.kind == "jetson":
        from hfsampler.sources.jetson.source import JetsonSource

        return JetsonSource(root=spec.jetson_root, reopened=spec.reopened)
    raise ValueError(f"unknown source kind {spec.kind!r}")

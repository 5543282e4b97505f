"""MIG for the nvml source: which GPUs have MIG on, their instance slots, and what is in them.

A MIG-enabled GPU gets one row per MIG device it can hold (``nvmlDeviceGetMaxMigDeviceCount``),
after every GPU's own row, so the rings' shape never changes while instances come and go. What a
slot holds is found with ``nvmlDeviceGetMigDeviceHandleByIndex``: per GPU instance (``GPU_I_ID``)
its first MIG device, whose memory is the instance's. ``place`` keeps an instance in the slot it
had (matched by MIG UUID) and puts new ones in the free slots, so a layout change ends only the
series of the instances that went and starts those of the ones that came. Its NVML calls go
through ``nvml_calls``, the only module that imports ``pynvml``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hfsampler.sources.base import DeviceInfo, MigInstance
from hfsampler.sources.nvml import calls

log = logging.getLogger("hfsampler.sources.nvml.source")

RESCAN_S = 1.0  # how often the MIG layout is looked at again, from a read of per-instance fields
RESCAN_NS = int(RESCAN_S * 1e9)  # also the least time between two rescans forced by failed reads

# what a call on the MIG device handle of an instance destroyed since answers
GONE_CODES = frozenset({calls.INVALID_ARGUMENT, calls.NOT_FOUND})

Found = tuple[Any, MigInstance]  # a MIG device handle and the instance it is


@dataclass(frozen=True, slots=True)
class MigGpu:
    """A GPU with MIG on at open: its row, handle and the rows of its instance slots."""

    row: int
    handle: Any
    slots: tuple[int, ...]


def enabled_slots(handle: Any) -> int:
    """How many instance slots a GPU gets: its MIG device maximum with MIG on, else 0."""
    try:
        if not calls.mig_enabled(handle):
            return 0
        return max(calls.max_mig_devices(handle), 0)
    except calls.NvmlError as e:
        if int(e.value) in calls.UNSUPPORTED_CODES:
            return 0  # a GPU without MIG, or a driver from before it
        raise


Unreadable = list[tuple[int, int]]  # (MIG device index, NVML code) of devices not identified


def instances(
    handle: Any, slots: int, known: Sequence[MigInstance | None] = ()
) -> tuple[list[Found], Unreadable]:
    """The GPU's instances now, one per GPU instance, by GPU instance id, and the MIG device
    indices that answered but could not be identified.

    An empty index answers NOT_FOUND (a layout with gaps is normal after instances were
    destroyed); several compute instances of one GPU instance share its memory, so the first
    one's device stands for it. A device whose UUID is one of ``known`` is that instance (a
    UUID names one GPU and compute instance for as long as they exist), so only new ones are
    asked the rest. One device that fails to say what it is is skipped, not the whole layout:
    the others' changes are still seen. A lost GPU's code is raised.
    """
    if not calls.mig_enabled(handle):
        return [], []
    by_uuid = {m.uuid: m for m in known if m is not None}
    by_gi: dict[int, Found] = {}
    unreadable: Unreadable = []
    for index in range(slots):
        try:
            mig = calls.mig_device_handle(handle, index)
        except calls.NvmlError as e:
            if int(e.value) in (calls.NOT_FOUND, *calls.UNSUPPORTED_CODES):
                continue
            raise
        try:
            instance = _identify(mig, by_uuid)
        except calls.NvmlError as e:
            if int(e.value) in calls.LOST_CODES:
                raise
            unreadable.append((index, int(e.value)))
            continue
        by_gi.setdefault(instance.gpu_instance_id, (mig, instance))
    return [by_gi[gi] for gi in sorted(by_gi)], unreadable


def _identify(mig: Any, known: dict[str, MigInstance]) -> MigInstance:
    uuid = calls.device_uuid(mig)
    if uuid in known:
        return known[uuid]
    return MigInstance(
        gpu_instance_id=calls.gpu_instance_id(mig),
        compute_instance_id=calls.compute_instance_id(mig),
        profile=calls.mig_profile(mig),
        uuid=uuid,
    )


def place(current: Sequence[MigInstance | None], found: Sequence[Found]) -> list[Found | None]:
    """Per slot, what it holds now: a found instance keeps the slot it had, new ones fill gaps."""
    out: list[Found | None] = [None] * len(current)
    where = {m.uuid: k for k, m in enumerate(current) if m is not None}
    new: list[Found] = []
    for item in found:
        k = where.get(item[1].uuid)
        if k is None:
            new.append(item)
        else:
            out[k] = item
    free = [k for k, item in enumerate(out) if item is None]
    for k, item in zip(free, new, strict=False):
        out[k] = item
    if len(new) > len(free):  # cannot happen with the driver's own maximum; said, not hidden
        log.warning("%d MIG instance(s) beyond the GPU's slots: not sampled", len(new) - len(free))
    return out


def slot_rows(
    devices: Sequence[DeviceInfo], handles: Sequence[Any]
) -> tuple[list[MigGpu], list[DeviceInfo]]:
    """The MIG GPUs among ``devices`` (rows 0..n-1) and their empty slot rows, rows n and on."""
    gpus: list[MigGpu] = []
    rows: list[DeviceInfo] = []
    for g, (device, handle) in enumerate(zip(devices, handles, strict=True)):
        n = enabled_slots(handle)
        if not n:
            continue
        first = len(devices) + len(rows)
        gpus.append(MigGpu(g, handle, tuple(range(first, first + n))))
        rows.extend(replace(device, mig_slot=k, mig=None) for k in range(n))
    return gpus, rows


def describe(device: DeviceInfo) -> str:
    m = device.mig
    where = f"GPU {device.index} MIG slot {device.mig_slot}"
    if m is None:
        return f"{where}: empty"
    return f"{where}: GPU instance {m.gpu_instance_id} ({m.profile}, {m.uuid})"

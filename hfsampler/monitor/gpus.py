"""Which GPUs a job means: CUDA's view (``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK``) to source rows.

A training script names GPUs as CUDA does, ``cuda:0`` being the first GPU that
``CUDA_VISIBLE_DEVICES`` leaves visible (given as NVML indices or as UUIDs, or UUID prefixes).
Under ``torchrun`` each process has ``LOCAL_RANK`` and uses ``cuda:LOCAL_RANK``, or the one GPU
its launcher left visible. A MIG instance (``MIG-<uuid>``, or the older
``MIG-GPU-<uuid>/<gi>/<ci>``) is measured on its GPU, the one power there is; CUDA shows a
process only the first instance listed. CUDA orders GPUs by PCI bus when
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, as NVML does; the default order (fastest first) is the same on
machines of one GPU model.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from hfsampler.errors import ConfigError
from hfsampler.sources.base import DeviceInfo

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
LOCAL_RANK = "LOCAL_RANK"


def visible(devices: Sequence[DeviceInfo], env: Mapping[str, str]) -> list[int]:
    """The rows of ``devices`` CUDA shows the job, in CUDA's order (all GPUs without the
    variable). An entry that names no GPU is a ``ConfigError``, where CUDA would hide the rest."""
    gpus = [r for r, d in enumerate(devices) if d.is_gpu]
    listed = env.get(CUDA_VISIBLE)
    if listed is None:
        return gpus
    out: list[int] = []
    mig = False
    for entry in (e.strip() for e in listed.split(",") if e.strip()):
        if entry.lstrip("-").isdigit():
            found = [r for r in gpus if devices[r].index == int(entry)]
        elif entry.startswith("MIG-"):
            found = _mig_gpu(devices, gpus, entry)
            if found and mig:  # CUDA shows one MIG instance: the first
                continue
            mig = True
        else:
            uuid = entry if entry.startswith("GPU-") else f"GPU-{entry}"
            found = [r for r in gpus if devices[r].uuid.startswith(uuid)]
        if len(found) != 1:
            known = ", ".join(f"{devices[r].index} ({devices[r].uuid})" for r in gpus)
            raise ConfigError(
                CUDA_VISIBLE,
                f"{entry!r} names {'no' if not found else 'more than one'} GPU of this source",
                f"list GPU indices or UUIDs of: {known}; or unset it to measure them all",
            )
        out.append(found[0])
    if mig:
        warnings.warn(
            f"{CUDA_VISIBLE} names a MIG instance: the Monitor measures the whole GPU it is on "
            "(power is the GPU's), other instances' work included",
            UserWarning,
            stacklevel=4,
        )
    return out


def _mig_gpu(devices: Sequence[DeviceInfo], gpus: Sequence[int], entry: str) -> list[int]:
    """The row of the GPU a MIG instance of ``CUDA_VISIBLE_DEVICES`` is on (a list as long as
    the GPUs it may be on)."""
    if entry.startswith("MIG-GPU-"):  # MIG-<the GPU's UUID>/<GPU instance>/<compute instance>
        uuid = entry.removeprefix("MIG-").split("/", 1)[0]
        return [r for r in gpus if devices[r].uuid.startswith(uuid)]
    parents = {d.index for d in devices if d.mig is not None and d.mig.uuid.startswith(entry)}
    return [r for r in gpus if devices[r].index in parents]


def choose(
    devices: Sequence[DeviceInfo], indices: Sequence[int] | None, env: Mapping[str, str]
) -> dict[int, int]:
    """CUDA index -> row of ``devices``: those of ``indices``; by default ``LOCAL_RANK``'s GPU
    where it is set (or the one GPU left visible), else every visible GPU."""
    shown = visible(devices, env)
    if not shown:
        raise ConfigError(CUDA_VISIBLE, "hides every GPU", "unset it, or name the GPUs to measure")
    key = "gpu_indices"
    if indices is None:
        rank = env.get(LOCAL_RANK)
        if rank is None or not rank.strip().isdigit():
            indices = range(len(shown))
        else:
            indices = [0] if len(shown) == 1 else [int(rank)]
            key = LOCAL_RANK
    chosen: dict[int, int] = {}
    for i in indices:
        if not 0 <= i < len(shown):
            raise ConfigError(
                key,
                f"{i} is not a GPU this job sees ({len(shown)} visible)",
                f"use 0 to {len(shown) - 1}, as cuda:N numbers them",
            )
        chosen[int(i)] = shown[i]
    return chosen

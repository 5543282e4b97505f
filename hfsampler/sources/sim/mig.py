"""MIG for the sim source: a layout such as ``3g,2g,1g,1g`` on every simulated GPU (an H200).

Each simulated GPU gets the seven instance slots a real H200 has and, in them, the instances of
the layout, with NVML's H200 profile names (``3g.71gb``) and the GPU instance ids an H100/H200
gives them. An instance's memory fields are its GPU's times its share of the eight memory
slices, and its activity (GPM) its GPU's times its share of the seven compute slices, so the
instances' memory adds up to no more than the GPU's and a full layout to exactly it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hfsampler.errors import ConfigError
from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, DeviceInfo, FloatArray, IntArray, MigInstance

SLOTS = 7  # nvmlDeviceGetMaxMigDeviceCount on an H100/H200
# profile -> (NVML's H200 name, compute slices of 7, memory slices of 8, GPU instance ids)
PROFILES: dict[str, tuple[str, int, int, tuple[int, ...]]] = {
    "1g": ("1g.18gb", 1, 1, (7, 8, 9, 10, 11, 12, 13)),
    "2g": ("2g.35gb", 2, 2, (3, 4, 5)),
    "3g": ("3g.71gb", 3, 4, (1, 2)),
    "4g": ("4g.71gb", 4, 4, (1,)),
    "7g": ("7g.141gb", 7, 8, (0,)),
}
FLAG = "--sim-mig"


def parse_layout(text: str, key: str = FLAG) -> tuple[str, ...]:
    """``3g,2g,1g,1g`` (or NVML's names, ``3g.71gb``) as profile keys, checked to fit a GPU."""
    items = tuple(t.strip().split(".")[0] for t in text.split(",") if t.strip())
    unknown = [t for t in items if t not in PROFILES]
    if not items or unknown:
        raise ConfigError(
            key,
            f"unknown MIG profile {unknown[0]!r}" if unknown else "names no instance",
            "give H200 profiles such as 3g,2g,1g,1g (1g, 2g, 3g, 4g or 7g)",
        )
    compute = sum(PROFILES[t][1] for t in items)
    memory = sum(PROFILES[t][2] for t in items)
    if compute > 7 or memory > 8:
        raise ConfigError(
            key,
            f"{text!r} needs {compute}/7 compute and {memory}/8 memory slices",
            "give instances that fit one GPU, e.g. 3g,2g,1g,1g",
        )
    instances(items, 0, 0)  # placed on a GPU, or a ConfigError naming the flag
    return items


def instances(layout: Sequence[str], seed: int, gpu: int) -> list[MigInstance]:
    """The layout's instances on one GPU: GPU instance ids from each profile's own pool."""
    used: set[int] = set()
    # the largest first, as the driver places them: a 4g has one place, a 3g two
    order = sorted(range(len(layout)), key=lambda k: -PROFILES[layout[k]][1])
    ids: dict[int, int] = {}
    for k in order:
        _, _, _, pool = PROFILES[layout[k]]
        gi = next((i for i in pool if i not in used and not (used and i == 0)), None)
        if gi is None:
            raise ConfigError(
                FLAG,
                f"{','.join(layout)!r} has no free place for a {layout[k]} instance",
                "give a layout a GPU can hold, e.g. 4g,3g or 3g,2g,1g,1g",
            )
        used.add(gi)
        ids[k] = gi
    out = []
    for k, profile in enumerate(layout):
        gi = ids[k]
        mig_uuid = uuid.uuid5(uuid.NAMESPACE_OID, f"hfsampler-sim/{seed}/{gpu}/mig/{gi}")
        out.append(MigInstance(gi, 0, PROFILES[profile][0], f"MIG-{mig_uuid}"))
    return out


def slot_rows(devices: Sequence[DeviceInfo], layout: Sequence[str], seed: int) -> list[DeviceInfo]:
    """Every GPU's seven slots, the layout's instances in the first ones, the rest empty."""
    rows = []
    for d in devices:
        found = instances(layout, seed, d.index)
        for k in range(SLOTS):
            rows.append(replace(d, mig_slot=k, mig=found[k] if k < len(found) else None))
    return rows


@dataclass(frozen=True, slots=True)
class Spread:
    """How one field tuple's per-instance cells follow their GPU's: rows, columns, factors."""

    twins: IntArray  # columns of per-instance fields
    others: IntArray  # columns of the GPU's own fields
    slots: IntArray  # slot rows holding an instance
    parents: IntArray  # their GPU's row
    factor: FloatArray  # [slots, twins]: the instance's share of its GPU's value


def plan(fields: Sequence[Field], devices: Sequence[DeviceInfo]) -> Spread:
    twins = np.array([k for k, f in enumerate(fields) if f.mig_instance], dtype=np.int64)
    others = np.array([k for k, f in enumerate(fields) if not f.mig_instance], dtype=np.int64)
    held = [(r, d) for r, d in enumerate(devices) if d.mig is not None]
    slots = np.array([r for r, _ in held], dtype=np.int64)
    parents = np.array([d.index for _, d in held], dtype=np.int64)  # sim GPU rows are indices
    factor = np.ones((len(held), len(twins)))
    for i, (_, d) in enumerate(held):
        assert d.mig is not None
        _, compute, memory, _ = PROFILES[d.mig.profile.split(".")[0]]
        for j, k in enumerate(twins):
            factor[i, j] = compute / 7 if fields[k].gpm_metric else memory / 8
    return Spread(twins, others, slots, parents, factor)


def spread(s: Spread, gpus: int, values: FloatArray, driver_ts_us: IntArray) -> None:
    """Fill the instances' cells from their GPU's (rows 0..gpus-1 already read)."""
    if s.twins.size:
        cells = np.ix_(s.slots, s.twins)
        from_gpu = np.ix_(s.parents, s.twins)
        values[cells] = values[from_gpu] * s.factor
        driver_ts_us[cells] = driver_ts_us[from_gpu]
        values[:gpus, s.twins] = np.nan  # a GPU has no per-instance cells
        driver_ts_us[:gpus, s.twins] = 0


# What NVML refuses on a GPU in MIG mode (nvmlDeviceGetUtilizationRates: NOT_SUPPORTED there)
MIG_GPU_UNSUPPORTED = frozenset({"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL"})


def supported(fields: Sequence[Field], devices: Sequence[DeviceInfo]) -> BoolArray:
    """[row, field]: a GPU its own fields, a slot its per-instance ones; a MIG GPU not what the
    driver refuses in MIG mode."""
    readable = np.array([f.nvml_readable for f in fields], dtype=np.bool_)
    twin = np.array([f.mig_instance for f in fields], dtype=np.bool_)
    gpu = np.array([d.is_gpu for d in devices], dtype=np.bool_)
    out: BoolArray = readable & np.where(gpu[:, None], ~twin, twin)
    mig_gpus = {d.index for d in devices if d.mig_slot is not None}
    refused = np.array([f.name in MIG_GPU_UNSUPPORTED for f in fields], dtype=np.bool_)
    for row, d in enumerate(devices):
        if d.is_gpu and d.index in mig_gpus:
            out[row] &= ~refused
    return out

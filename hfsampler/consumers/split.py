"""One window's GPU energy split among the consumers present, by their share of the SMs.

The slow lane fills a ``WindowUse`` per GPU (or MIG instance) and window: the GPU's energy over
the window, NVML's per-process utilisation samples (``nvmlDeviceGetProcessUtilization``) and the
entries of its process lists (compute, graphics, MPS) read during the window. ``split`` gives
each consumer its SM ratio (the window's mean), its memory (the window's highest) and its part of
the energy; what no consumer drew (no process, or none using the SMs: idle with memory held) is
``unattributed_j``. The parts and ``unattributed_j`` add up to ``energy_j`` to the rounding of the
last part (the last part is the energy less the others, so nothing is lost or invented).

A process's SM mean is over the window's sampling instants (the distinct timestamps of the
driver's samples of that GPU in the window), so a process that ran for a sixth of the window at
60 % counts 10 %, not 60 %. Consumers' SM ratios are clipped to 1: the driver's per-process
numbers may add to more than 100 % under MPS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.consumers.identity import Consumer

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def _ints(values: object) -> IntArray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _floats(values: object) -> FloatArray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


@dataclass(frozen=True, slots=True)
class WindowUse:
    """What the slow lane saw of one GPU (or MIG instance) over one window.

    ``util_*`` are parallel arrays, one entry per utilisation sample; ``mem_*`` one entry per
    process-list entry (a process in two lists at one read, compute and graphics, is one process:
    its larger number counts). ``mem_used_bytes`` is NaN where the driver does not say.
    """

    energy_j: float
    util_pid: IntArray
    util_timestamp_us: IntArray
    util_sm_pct: FloatArray
    mem_pid: IntArray
    mem_read: IntArray  # which read of the lists the entry came from (any id, equal per read)
    mem_used_bytes: FloatArray

    def __post_init__(self) -> None:
        if not math.isfinite(self.energy_j) or self.energy_j < 0:
            raise ValueError(f"a window's energy must be finite and >= 0, not {self.energy_j}")
        if not len(self.util_pid) == len(self.util_timestamp_us) == len(self.util_sm_pct):
            raise ValueError("util_pid, util_timestamp_us and util_sm_pct differ in length")
        if not len(self.mem_pid) == len(self.mem_read) == len(self.mem_used_bytes):
            raise ValueError("mem_pid, mem_read and mem_used_bytes differ in length")

    @classmethod
    def of(
        cls,
        energy_j: float,
        samples: list[tuple[int, int, float]] | None = None,
        entries: list[tuple[int, int, float | None]] | None = None,
    ) -> WindowUse:
        """From plain tuples: samples ``(pid, timestamp_us, sm_pct)``, list entries ``(pid,
        read, used_bytes or None)``."""
        s = samples or []
        e = entries or []
        return cls(
            float(energy_j),
            _ints([x[0] for x in s]), _ints([x[1] for x in s]), _floats([x[2] for x in s]),
            _ints([x[0] for x in e]), _ints([x[1] for x in e]),
            _floats([math.nan if x[2] is None else x[2] for x in e]),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ConsumerShare:
    """One consumer's part of one GPU's window."""

    consumer: Consumer
    energy_j: float
    sm_ratio: float  # 0-1, the window's mean
    memory_used_bytes: float  # the window's highest; NaN where the driver never said


@dataclass(frozen=True, slots=True)
class WindowSplit:
    shares: tuple[ConsumerShare, ...]  # in the order consumers were first seen in the window
    unattributed_j: float

    @property
    def total_j(self) -> float:
        return math.fsum([s.energy_j for s in self.shares] + [self.unattributed_j])


def split(use: WindowUse, consumers: Mapping[int, Consumer]) -> WindowSplit:
    """Each consumer's SM ratio, memory and energy in the window; a pid without a consumer in
    ``consumers`` is ``Consumer.unknown()``."""
    # Each distinct pid is looked up once (a consumer hashes slowly); consumers are numbered in
    # the order their first process appears, and every array maps to them through its pids.
    pids, first = np.unique(np.concatenate([use.mem_pid, use.util_pid]), return_index=True)
    if not len(pids):
        return WindowSplit((), use.energy_j)
    unknown = Consumer.unknown()
    order: dict[Consumer, int] = {}
    number = {pid: order.setdefault(consumers.get(pid, unknown), len(order))
              for pid in pids[np.argsort(first, kind="stable")].tolist()}  # fmt: skip
    of_pid = _ints([number[pid] for pid in pids.tolist()])
    n = len(order)

    def index(some: IntArray) -> IntArray:
        found: IntArray = of_pid[np.searchsorted(pids, some)]
        return found

    sm = np.zeros(n)
    if len(use.util_pid):
        instants = len(np.unique(use.util_timestamp_us))
        pct = np.clip(np.nan_to_num(use.util_sm_pct, nan=0.0), 0.0, 100.0)
        np.add.at(sm, index(use.util_pid), pct)
        sm /= instants * 100.0
    sm = np.minimum(sm, 1.0)

    memory = np.full(n, np.nan)
    if len(use.mem_pid):
        # one number per (read, pid), then summed per (read, consumer), then the highest read
        # (read, pid) as one key: a pid is below 2**32 (the kernel's pid_max is 2**22)
        keys = (use.mem_read << 32) | (use.mem_pid & 0xFFFFFFFF)
        uniq, where = np.unique(keys, return_inverse=True)
        per_proc = np.full(len(uniq), np.nan)
        np.fmax.at(per_proc, where.reshape(-1), use.mem_used_bytes)
        reads, read_of = np.unique(uniq >> 32, return_inverse=True)
        per_read = np.zeros((len(reads), n))
        known = np.zeros((len(reads), n), dtype=bool)
        who = index(uniq & 0xFFFFFFFF)
        np.add.at(per_read, (read_of.reshape(-1), who), np.nan_to_num(per_proc, nan=0.0))
        np.logical_or.at(known, (read_of.reshape(-1), who), ~np.isnan(per_proc))
        memory = np.where(known.any(axis=0), np.where(known, per_read, -np.inf).max(axis=0),
                          np.nan)  # fmt: skip

    energy = np.zeros(n)
    total_sm = float(sm.sum())
    unattributed = use.energy_j
    if total_sm > 0.0 and use.energy_j > 0.0:
        energy = use.energy_j * (sm / total_sm)
        # The last consumer that drew anything takes the rest, so the parts add up.
        last = int(np.flatnonzero(sm)[-1])
        energy[last] = 0.0
        energy[last] = max(use.energy_j - math.fsum(energy.tolist()), 0.0)
        unattributed = 0.0
    shares = tuple(
        ConsumerShare(c, float(energy[i]), float(sm[i]), float(memory[i])) for c, i in order.items()
    )
    return WindowSplit(shares, unattributed)


def split_instances(
    parts: Sequence[tuple[WindowUse, float]], energy_j: float, consumers: Mapping[int, Consumer]
) -> tuple[list[WindowSplit], float]:
    """A MIG GPU's window: NVML has no energy per instance, so the GPU's ``energy_j`` is split
    over the consumers of all its instances at once. ``parts`` are each instance's use (its own
    ``energy_j`` is not read) with its share of the GPU's SMs (its compute slices of 7): a
    consumer's weight is its SM ratio of its instance times that share. Returns each instance's
    split (its consumers' parts; ``unattributed_j`` 0) and the GPU's unattributed energy, which
    together add up to ``energy_j`` as ``split``'s do."""
    splits = [split(use, consumers) for use, _ in parts]
    weights = [s.sm_ratio * share for (_, share), one in zip(parts, splits, strict=True)
               for s in one.shares]  # fmt: skip
    total = math.fsum(weights)
    if not (total > 0.0 and energy_j > 0.0):
        zeroed = [WindowSplit(tuple(_with_energy(s, 0.0) for s in one.shares), 0.0)
                  for one in splits]  # fmt: skip
        return zeroed, energy_j
    parts_j = [energy_j * w / total for w in weights]
    # the last consumer that drew anything takes the rest, so the parts add up
    last = max(i for i, w in enumerate(weights) if w > 0.0)
    parts_j[last] = 0.0
    parts_j[last] = max(energy_j - math.fsum(parts_j), 0.0)
    out, k = [], 0
    for one in splits:
        shares = []
        for s in one.shares:
            shares.append(_with_energy(s, parts_j[k]))
            k += 1
        out.append(WindowSplit(tuple(shares), 0.0))
    return out, 0.0


def _with_energy(share: ConsumerShare, energy_j: float) -> ConsumerShare:
    return ConsumerShare(share.consumer, energy_j, share.sm_ratio, share.memory_used_bytes)

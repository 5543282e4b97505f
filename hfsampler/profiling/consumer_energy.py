"""Each consumer's energy in a recording, per GPU, overall and per phase: every window's GPU energy
(from the millisecond power, as the report integrates it) split among the consumers the window
saw by their SM share with ``consumers.split``, the same split `run` makes.

The windows' energies are read off the power stream's running integral (a ``Readout``) at the
windows' edges and the phases' edges together, so a window that straddles a phase edge gives each
side its own energy, split by the window's shares: per phase, as overall, the consumers' energy
and the unattributed energy add up to the GPU's. Energy no consumer drew is unattributed: in a
window with processes but none using the SMs, in a window without any process (no ``CONS``
chunk), before the first look or after the last. A consumer's peak power is the highest mean
power it drew over one window (or the part of one inside a phase): its share of the GPU's power
is known per window, not per millisecond.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from hfsampler.consumers.identity import Consumer
from hfsampler.consumers.split import WindowSplit, split
from hfsampler.profiling.phases import Timeline
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.streams import Readout

IntArray = npt.NDArray[np.int64]


def consumer_edges_us(rec: Recording, phase_edges_ns: IntArray) -> IntArray:
    """The times a consumer energy readout needs: every consumer window's edges and every
    phase's, µs, sorted and distinct (empty where the recording has no consumer window)."""
    times = [t for span in rec.consumer_spans_ns() for t in span]
    if not times:
        return np.empty(0, np.int64)
    out: IntArray = np.unique(np.concatenate([np.array(times, np.int64), phase_edges_ns]) // 1000)
    return out


def consumer_key(consumer: Consumer) -> str:
    """A consumer's identity in words, as its labels say it (``hpc_job=4242``): what the report
    shows and what a comparison pairs on."""
    return ",".join(f"{k}={v}" for k, v in sorted(consumer.labels().items()))


@dataclass(slots=True)
class ConsumerUse:
    """One consumer's use of one GPU (or, in ``ConsumerEnergy.totals``, its energy and peak
    power on all of them together; SM and memory are per GPU only)."""

    consumer: Consumer
    phases: int
    energy_j: float = 0.0
    peak_power_w: float = math.nan
    sm_seconds: float = 0.0  # SM ratio x seconds of the windows it was in
    seconds: float = 0.0  # the windows it was in
    memory_high_water_bytes: float = math.nan
    phase_energy_j: list[float] = field(init=False)
    phase_peak_power_w: list[float] = field(init=False)
    phase_seen: list[bool] = field(init=False)  # in a window that overlaps the phase

    def __post_init__(self) -> None:
        self.phase_energy_j = [0.0] * self.phases
        self.phase_peak_power_w = [math.nan] * self.phases
        self.phase_seen = [False] * self.phases

    @property
    def mean_sm_ratio(self) -> float:
        return self.sm_seconds / self.seconds if self.seconds > 0 else math.nan


@dataclass(slots=True)
class GpuConsumers:
    """One GPU's consumers, and the energy in the windows they were seen in."""

    row: int  # position in the recording's devices
    consumers: dict[Consumer, ConsumerUse] = field(default_factory=dict)
    windows: int = 0
    windows_energy_j: float = 0.0  # the windows with consumers: consumers + unattributed there


@dataclass(slots=True)
class ConsumerEnergy:
    """Every GPU's consumers, and each consumer's use of all of them together (energy summed,
    peak power the highest window of their sum)."""

    gpus: list[GpuConsumers]
    totals: dict[Consumer, ConsumerUse]
    windows: int  # consumer windows in the recording


def _use(found: dict[Consumer, ConsumerUse], consumer: Consumer, phases: int) -> ConsumerUse:
    use = found.get(consumer)
    if use is None:
        use = found[consumer] = ConsumerUse(consumer, phases)
    return use


def consumer_energy(
    rec: Recording, readouts: Sequence[Readout], timeline: Timeline, at_us: IntArray
) -> ConsumerEnergy | None:
    """Split every consumer window's energy (``readouts``: per device row, the power's integral
    read at ``at_us``, from ``consumer_edges_us``); None where no window was recorded."""
    if not len(at_us):
        return None
    phases = timeline.phases
    starts = np.array([p.start_ns // 1000 for p in phases], np.int64)
    ends = np.array([p.end_ns // 1000 for p in phases], np.int64)
    gpus = [GpuConsumers(row) for row in range(len(readouts))]
    totals: dict[Consumer, ConsumerUse] = {}
    count = 0

    def energy(row: int, a_us: int, b_us: int) -> float:
        a, b = np.searchsorted(at_us, [a_us, b_us])
        return max(float(readouts[row].between(int(a), int(b))[0]), 0.0)

    for w in rec.consumer_windows():
        count += 1
        t0, t1 = w.t0_ns // 1000, w.t1_ns // 1000
        seconds = (t1 - t0) / 1e6
        if seconds <= 0:
            continue
        inside = np.nonzero((starts < t1) & (ends > t0))[0]
        # all GPUs together: per consumer, the window's joules, and each phase's part's
        window_total: dict[Consumer, float] = {}
        phase_total: dict[tuple[Consumer, int], float] = {}
        for row, use in w.uses.items():
            if row >= len(gpus):
                continue
            g = gpus[row]
            result = split(replace(use, energy_j=energy(row, t0, t1)), w.consumers)
            g.windows += 1
            g.windows_energy_j += result.total_j
            for share in result.shares:
                u = _use(g.consumers, share.consumer, len(phases))
                u.energy_j += share.energy_j
                u.peak_power_w = float(np.fmax(u.peak_power_w, share.energy_j / seconds))
                u.sm_seconds += share.sm_ratio * seconds
                u.seconds += seconds
                u.memory_high_water_bytes = float(np.fmax(u.memory_high_water_bytes,
                                                          share.memory_used_bytes))  # fmt: skip
                joules = window_total.get(share.consumer, 0.0) + share.energy_j
                window_total[share.consumer] = joules
            for p in inside.tolist():
                a, b = max(t0, int(starts[p])), min(t1, int(ends[p]))
                part: WindowSplit = split(replace(use, energy_j=energy(row, a, b)), w.consumers)
                for share in part.shares:
                    _add_part(g.consumers[share.consumer], p, share.energy_j, b - a)
                    key = (share.consumer, p)
                    phase_total[key] = phase_total.get(key, 0.0) + share.energy_j
        for consumer, joules in window_total.items():
            u = _use(totals, consumer, len(phases))
            u.energy_j += joules
            u.peak_power_w = float(np.fmax(u.peak_power_w, joules / seconds))
        for (consumer, p), joules in phase_total.items():
            span = min(t1, int(ends[p])) - max(t0, int(starts[p]))
            _add_part(totals[consumer], p, joules, span)
    return ConsumerEnergy(gpus, totals, count)


def _add_part(use: ConsumerUse, phase: int, energy_j: float, span_us: int) -> None:
    """A window's part inside a phase: its energy, and its mean power as a peak candidate."""
    use.phase_energy_j[phase] += energy_j
    use.phase_seen[phase] = True
    if span_us > 0:
        peak = energy_j / (span_us / 1e6)
        use.phase_peak_power_w[phase] = float(np.fmax(use.phase_peak_power_w[phase], peak))

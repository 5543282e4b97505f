"""What a recording says about a job, per GPU and per phase: energy, peaks, throttling, memory.

One streaming pass over the file's chunks in time order, with state bounded up front (see
``profiling.streams``): the markers are read first, so the phases' and steps' edges are known
before any sample; then each raw chunk and window is reduced and dropped. Energy is the trapezoid
over the raw power samples (and, where recorded, the driver's energy counter for the whole run,
from its first raw sample to its last); time above the power limit compares each power sample
with the limit in force at its time (the limit's own samples); it, throttled time by reason and
activity means hold each sample until the next; the p99 comes from a histogram of
``HISTOGRAM_BIN_W`` bins. The scrape comparison samples the driver's 1 s-averaged power every
15 s, as a Prometheus scrape of dcgm-exporter would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from hfsampler.fields import (
    CLOCK_EVENT_REASONS,
    CLOCK_EVENTS,
    ENERGY,
    FB_USED,
    GPU_TEMP,
    GPU_UTIL,
    POWER,
    POWER_AVERAGE,
    POWER_LIMIT,
    SM_CLOCK,
    Role,
)
from hfsampler.profiling.consumer_energy import ConsumerEnergy, consumer_edges_us, consumer_energy
from hfsampler.profiling.phases import Timeline, read_timeline
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import RawChunk, WindowChunk
from hfsampler.profiling.streams import (
    HISTOGRAM_BIN_W,
    HISTOGRAM_BINS,
    Buckets,
    Envelope,
    Held,
    Intervals,
    Readout,
    SegmentMax,
    WindowSeries,
    histogram_bins,
    histogram_count,
    histogram_quantile,
)
from hfsampler.sampling.window import LAST, MAX, MEAN, MIN, Stat
from hfsampler.sources.base import physical

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SCRAPE_INTERVAL_S = 15.0
REFRESH_CHUNKS = 10  # chunks per group used to measure each field's refresh period
BATCH_SAMPLES = 1 << 14  # a stream's samples gathered before they are reduced at once
SM_ACTIVE = Role(("DCGM_FI_PROF_SM_ACTIVE",))
TENSOR_ACTIVE = Role(("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",))
# The window statistics the report plots below power, each reduced to plot buckets as it streams.
PANELS: tuple[tuple[Role, Stat, str], ...] = (
    (GPU_UTIL, MEAN, "Utilization (%)"),
    (FB_USED, MAX, "Memory used (MiB)"),
    (GPU_TEMP, MEAN, "Temperature (C)"),
    (SM_CLOCK, MIN, "SM clock (MHz)"),
)

_BITS = np.array(list(CLOCK_EVENT_REASONS), np.int64)


def _num(value: float | None, digits: int = 6) -> float | None:
    return None if value is None or not np.isfinite(value) else round(float(value), digits)


@dataclass(slots=True)
class GpuSummary:
    """What the report says about one GPU, and the bounded state it is reduced in."""

    index: int
    uuid: str
    model: str
    envelope: Envelope
    phase_edges_us: IntArray
    step_edges_us: IntArray
    phases: int
    power_field: str | None = None
    samples: int = 0
    energy_first_mj: float = np.nan  # the counter's first window's last value
    energy_last_mj: float = np.nan
    energy_raw_first_mj: float = np.nan  # the counter's first raw sample, where raw is recorded
    energy_raw_last_mj: float = np.nan
    energy_integrated_j: float = 0.0
    peak_w: float = np.nan
    peak_at_s: float = np.nan
    power_limit_w: float = np.nan  # the highest in force at any time
    # the power limit's changes (time µs, W), from its raw samples: few, however long the run
    limit_change_us: list[int] = field(default_factory=list)
    limit_change_w: list[float] = field(default_factory=list)
    limit_known_us: int = -(2**62)  # the limit's samples have been read up to here
    memory_high_water_mib: float = np.nan
    throttle_spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    scrape_t_s: list[float] = field(default_factory=list)
    scrape_w: list[float] = field(default_factory=list)
    used_by_job: bool | None = None
    last_average_w: float = np.nan
    histogram: IntArray = field(default_factory=lambda: np.zeros(HISTOGRAM_BINS, np.int64))
    # per phase edge: energy J, s above the limit, s with power; throttled s per reason;
    # activity integral and covered s, of SM and of tensor activity
    power_at: Readout = field(init=False)
    reasons_at: Readout = field(init=False)
    activity_at: tuple[Readout, Readout] = field(init=False)  # SM, tensor: a Readout per stream
    step_energy_at: Readout = field(init=False)
    # the power's integral at the consumer windows' and phases' edges (``consumer_energy``)
    consumer_at_us: IntArray = field(default_factory=lambda: np.empty(0, np.int64))
    consumer_energy_at: Readout = field(init=False)
    power_top: SegmentMax = field(init=False)
    memory_top: SegmentMax = field(init=False)
    phase_histograms: IntArray = field(init=False)
    power_held: Held = field(default_factory=Held)
    reasons_held: Held = field(default_factory=Held)
    activity_held: tuple[Held, Held] = field(default_factory=lambda: (Held(), Held()))

    def __post_init__(self) -> None:
        self.power_at = Readout(self.phase_edges_us, 3)
        self.reasons_at = Readout(self.phase_edges_us, len(CLOCK_EVENT_REASONS))
        self.activity_at = (Readout(self.phase_edges_us, 2), Readout(self.phase_edges_us, 2))
        self.step_energy_at = Readout(self.step_edges_us, 1)
        self.consumer_energy_at = Readout(self.consumer_at_us, 1)
        self.power_top = SegmentMax(self.phase_edges_us)
        self.memory_top = SegmentMax(self.phase_edges_us)
        self.phase_histograms = np.zeros((self.phases, HISTOGRAM_BINS), np.int64)

    @property
    def energy_j(self) -> float:
        """From the driver's energy counter (NaN where not recorded): from its first raw sample,
        so the first window counts too, else from its first window's last value."""
        first = self.energy_raw_first_mj
        if not np.isfinite(first):
            first = self.energy_first_mj
        last = float(np.fmax(self.energy_last_mj, self.energy_raw_last_mj))
        return (last - first) / 1e3

    def limit_at(self, t_us: IntArray, fallback_w: float) -> FloatArray:
        """The power limit in force at each time: its latest sample by then (before the first,
        the first); ``fallback_w`` where the limit has no raw samples."""
        if not self.limit_change_us:
            return np.full(len(t_us), fallback_w)
        at = np.searchsorted(np.array(self.limit_change_us, np.int64), t_us, side="right") - 1
        limits: FloatArray = np.array(self.limit_change_w)[at.clip(min=0)]
        return limits

    @property
    def above_limit_s(self) -> float:
        return float(self.power_at.total[1])

    @property
    def throttled_s(self) -> dict[str, float]:
        totals = self.reasons_at.total
        names = CLOCK_EVENT_REASONS.values()
        return {name: float(totals[k]) for k, name in enumerate(names) if totals[k]}

    def activity(self, which: int, a: int | None = None, b: int | None = None) -> float | None:
        """Mean SM (0) or tensor (1) activity, over the run or between two phase edges."""
        at = self.activity_at[which]
        q = at.total if a is None or b is None else at.between(a, b)
        return _num(q[0] / q[1]) if q[1] > 0 else None

    def as_dict(self, duration_s: float) -> dict[str, Any]:
        scrape = np.array(self.scrape_w)
        powered = self.samples > 0  # without power samples, no integral is 0: it is unknown
        return {
            "gpu": self.index,
            "uuid": self.uuid,
            "model": self.model,
            "used_by_job": self.used_by_job,
            "power_field": self.power_field,
            "power_samples": self.samples,
            "energy_j": _num(self.energy_j),
            "energy_wh": _num(self.energy_j / 3600),
            "energy_integrated_j": _num(self.energy_integrated_j) if powered else None,
            "mean_power_w": _num(self.energy_integrated_j / duration_s)
            if powered and duration_s
            else None,
            "peak_power_w": _num(self.peak_w),
            "peak_power_at_s": _num(self.peak_at_s),
            "p99_power_w": _num(histogram_quantile(self.histogram, 0.99), 3),
            "p99_resolution_w": HISTOGRAM_BIN_W,
            "power_limit_w": _num(self.power_limit_w),
            "time_above_power_limit_s": _num(self.above_limit_s) if powered else None,
            "memory_high_water_mib": _num(self.memory_high_water_mib),
            "mean_sm_active": self.activity(0),
            "mean_tensor_active": self.activity(1),
            "throttled_s": {k: round(v, 6) for k, v in sorted(self.throttled_s.items())},
            "scrape_15s": {
                "scrapes": len(scrape),
                "peak_w": _num(float(scrape.max())) if len(scrape) else None,
                "energy_j": _num(float(scrape.mean()) * duration_s) if len(scrape) else None,
            },
        }


@dataclass(slots=True)
class Summary:
    """The whole recording's summary: context, duration, per-GPU and per-phase results."""

    recording: Recording
    start_ns: int
    end_ns: int
    gpus: list[GpuSummary]
    refresh_s: dict[str, float]
    timeline: Timeline
    buckets: Buckets
    windows: dict[tuple[str, str], WindowSeries]  # (field name, stat name): per plot bucket
    consumers: ConsumerEnergy | None = None  # None: the recording kept no consumers

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def window_series(self, role: Role, stat: Stat) -> tuple[str, WindowSeries] | None:
        """The plotted window statistic of the role's recorded field, with the field's name."""
        where = self.recording.locate_role(role)
        if where is None:
            return None
        name = self.recording.groups[where[0]].fields[where[1]].name
        series = self.windows.get((name, stat.name))
        return None if series is None else (name, series)


def summarize(rec: Recording) -> Summary:
    """Read the markers, then every chunk once in time order, and build the summary."""
    start_ns, end_ns = rec.time_range_ns()
    tl = read_timeline(rec, start_ns, end_ns)
    phase_ns, step_ns = tl.edges_ns()
    buckets = Buckets(start_ns // 1000, (end_ns - start_ns) / 1e3)
    at_us = consumer_edges_us(rec, phase_ns)
    gpus = [GpuSummary(d.index, d.uuid, d.model_name, Envelope(buckets), phase_ns // 1000,
                       step_ns // 1000, len(tl.phases), consumer_at_us=at_us)
            for d in rec.devices]  # fmt: skip
    reducer = _Pass(rec, gpus, tl, buckets, start_ns, end_ns)
    for chunk in rec.stream():
        if isinstance(chunk, RawChunk):
            reducer.raw(chunk)
        else:
            reducer.window(chunk)
    reducer.finish()
    for g in gpus:
        for r in (g.power_at, g.reasons_at, *g.activity_at, g.step_energy_at,
                  g.consumer_energy_at):  # fmt: skip
            r.finish()
    consumers = consumer_energy(rec, [g.consumer_energy_at for g in gpus], tl, at_us)
    # one per GPU: a MIG instance's slot row (after every GPU's) shares its GPU's power, clocks
    # and throttling, so the GPUs' rows keep their positions in the streams
    gpus = gpus[: len(physical(rec.devices))]
    _job_gpus(rec, gpus)
    periods = {k: float(np.median(v)) / 1e6 for k, v in reducer.refresh.items()}
    return Summary(rec, start_ns, end_ns, gpus, periods, tl, buckets, reducer.series, consumers)


class _Pass:
    """The state of one pass that only the pass needs: where each role's field is, the scrape
    times, the power limit in force, refresh-period samples."""

    def __init__(self, rec: Recording, gpus: list[GpuSummary], tl: Timeline, buckets: Buckets,
                 start_ns: int, end_ns: int) -> None:  # fmt: skip
        self.rec, self.gpus, self.start_ns, self.end_ns = rec, gpus, start_ns, end_ns
        self.gap_us = buckets.width_us  # throttle spans closer than a bucket draw as one
        self.phase_us = np.array([[p.start_ns // 1000, p.end_ns // 1000] for p in tl.phases],
                                 np.int64).reshape(-1, 2)  # fmt: skip
        self.scrape_at_us = np.arange(start_ns, end_ns + 1, int(SCRAPE_INTERVAL_S * 1e9)) // 1000
        self.scraped = [0] * len(gpus)
        self.refresh: dict[str, list[float]] = {}
        self._seen = [0] * len(rec.groups)
        self.handlers: dict[tuple[int, int], Any] = {}
        for role, handler in ((POWER, self._power), (CLOCK_EVENTS, self._reasons),
                              (POWER_AVERAGE, self._average), (FB_USED, self._memory),
                              (SM_ACTIVE, self._sm), (TENSOR_ACTIVE, self._tensor),
                              (POWER_LIMIT, self._limit), (ENERGY, self._energy)):  # fmt: skip
            where = rec.locate_role(role)
            if where is not None:
                self.handlers.setdefault(where, handler)
        self._pending: dict[tuple[int, int, int], list[tuple[IntArray, FloatArray]]] = {}
        self._pending_n: dict[tuple[int, int, int], int] = {}
        self._handled: dict[int, IntArray] = {}
        for group, j in self.handlers:
            self._handled[group] = np.append(self._handled.get(group, []), j).astype(np.int64)
        power = rec.locate_role(POWER)
        self.power_name = rec.groups[power[0]].fields[power[1]].name if power else None
        self.limit_at, self.energy_at = rec.locate_role(POWER_LIMIT), rec.locate_role(ENERGY)
        self.power_at = power
        self.memory_at = rec.locate_role(FB_USED)
        self.limit_w = np.full(len(gpus), np.nan)
        if self.limit_at is not None:  # the limit in force from the start: its first window's
            first = next(rec.window_chunks(self.limit_at[0]), None)
            if first is not None:
                self.limit_w = first.stats[MAX][:, self.limit_at[1]].copy()
        self.series: dict[tuple[str, str], WindowSeries] = {}
        self.plotted: dict[int, list[tuple[int, Stat, WindowSeries]]] = {}
        wanted = [(POWER, MIN), (POWER, MAX), (POWER, MEAN), *((r, s) for r, s, _ in PANELS)]
        for role, stat in wanted:
            where = rec.locate_role(role)
            if where is None:
                continue
            name = rec.groups[where[0]].fields[where[1]].name
            series = self.series.setdefault((name, stat.name), WindowSeries(buckets, len(gpus)))
            self.plotted.setdefault(where[0], []).append((where[1], stat, series))

    # -- windows ---------------------------------------------------------------------------------

    def window(self, chunk: WindowChunk) -> None:
        w, group = chunk.stats, chunk.group
        for j, stat, series in self.plotted.get(group, ()):
            series.add(w.t0_ns, w[stat][:, j])
        with np.errstate(all="ignore"):
            if self.limit_at is not None and group == self.limit_at[0]:
                top = w[MAX][:, self.limit_at[1]]
                self.limit_w = np.fmax(self.limit_w, top)
                for i, g in enumerate(self.gpus):
                    g.power_limit_w = float(np.fmax(g.power_limit_w, top[i]))
            if self.memory_at is not None and group == self.memory_at[0]:
                top = w[MAX][:, self.memory_at[1]]
                for i, g in enumerate(self.gpus):
                    g.memory_high_water_mib = float(np.fmax(g.memory_high_water_mib, top[i]))
            if self.energy_at is not None and group == self.energy_at[0]:
                last = w[LAST][:, self.energy_at[1]]
                for i, g in enumerate(self.gpus):
                    if np.isfinite(last[i]):
                        if not np.isfinite(g.energy_first_mj):
                            g.energy_first_mj = float(last[i])
                        g.energy_last_mj = float(last[i])

    # -- raw samples -----------------------------------------------------------------------------

    def raw(self, chunk: RawChunk) -> None:
        group = chunk.group
        measure = self._seen[group] < REFRESH_CHUNKS
        self._seen[group] += measure
        fields = self.rec.groups[group].fields
        offsets, ts = chunk.offsets, chunk.ts_us
        if measure:
            for c in range(len(chunk.gpu)):
                a, b = int(offsets[c]), int(offsets[c + 1])
                if b - a > 1:
                    period = float(np.median(ts[a + 1 : b] - ts[a : b - 1]))
                    self.refresh.setdefault(fields[int(chunk.field[c])].name, []).append(period)
        handled = self._handled.get(group)
        if handled is None:
            return
        limits = self.limit_at is not None and group == self.limit_at[0]
        for cell in np.nonzero(np.isin(chunk.field, handled))[0]:
            c = int(cell)
            a, b = int(offsets[c]), int(offsets[c + 1])
            if b > a:
                key = (group, int(chunk.field[c]), int(chunk.gpu[c]))
                parts = self._pending.setdefault(key, [])
                # copies: a view would keep the whole chunk alive while a slow stream gathers
                parts.append((ts[a:b].copy(), chunk.values[a:b].copy()))
                self._pending_n[key] = self._pending_n.get(key, 0) + b - a
                # the limit at once: power waits for the limit in force at its samples' times
                if limits or self._pending_n[key] >= BATCH_SAMPLES:
                    self._flush(key)
        if limits and len(ts):
            for g in self.gpus:  # a change would be among this chunk's samples
                g.limit_known_us = max(g.limit_known_us, int(ts.max()))

    def _flush(self, key: tuple[int, int, int], final: bool = False) -> None:
        """Hand a stream's pending samples to its handler at once: one call per some thousand
        samples rather than per chunk, since a call's cost is mostly numpy's per-call overhead.
        Power samples later than the power limit's samples read so far wait (unless ``final``, or
        too many wait), so each is compared with the limit in force at its time."""
        parts = self._pending.pop(key, [])
        self._pending_n.pop(key, None)
        if not parts:
            return
        ts = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        v = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        g = self.gpus[key[2]]
        if key[:2] == self.power_at and g.limit_change_us and not final:
            cut = int(np.searchsorted(ts, g.limit_known_us, side="right"))
            if cut < len(ts) and len(ts) < 4 * BATCH_SAMPLES:
                self._pending[key] = [(ts[cut:], v[cut:])]
                self._pending_n[key] = len(ts) - cut
                ts, v = ts[:cut], v[:cut]
        if len(ts):
            self.handlers[key[:2]](key[2], ts, v)

    def _power(self, i: int, ts: IntArray, v: FloatArray) -> None:
        g = self.gpus[i]
        g.power_field = self.power_name
        g.samples += len(v)
        g.envelope.add(ts, v)
        k = int(np.argmax(v))
        if not v[k] <= g.peak_w:  # also when peak is still NaN
            g.peak_w, g.peak_at_s = float(v[k]), (ts[k] * 1e3 - self.start_ns) / 1e9
        bins = histogram_bins(v)
        g.histogram += histogram_count(bins)
        g.power_top.add(ts, v)
        if len(self.phase_us):
            inside = (self.phase_us[:, 0] <= ts[-1]) & (self.phase_us[:, 1] > ts[0])
            for p in np.nonzero(inside)[0]:
                s, e = self.phase_us[p]
                g.phase_histograms[p] += histogram_count(bins[(ts >= s) & (ts < e)])
        iv = g.power_held.intervals(ts, v)
        if not len(iv.held_us):
            return
        energy = (iv.value + iv.following) / 2 * iv.held_us / 1e6
        limit = g.limit_at(iv.start_us, float(self.limit_w[i]))
        above = np.where(iv.value > limit, iv.held_us, 0.0) / 1e6
        g.power_at.add(iv.start_us, iv.held_us, np.stack([energy, above, iv.held_us / 1e6]))
        g.step_energy_at.add(iv.start_us, iv.held_us, energy[None])
        g.consumer_energy_at.add(iv.start_us, iv.held_us, energy[None])
        g.energy_integrated_j += float(energy.sum())

    def _reasons(self, i: int, ts: IntArray, v: FloatArray) -> None:
        g = self.gpus[i]
        iv = g.reasons_held.intervals(ts, v)
        if not len(iv.held_us):
            return
        on = (iv.value.astype(np.int64)[None, :] & _BITS[:, None]) != 0  # [reason, interval]
        g.reasons_at.add(iv.start_us, iv.held_us, np.where(on, iv.held_us, 0.0) / 1e6)
        starts = (iv.start_us * 1e3 - self.start_ns) / 1e9
        ends = starts + iv.held_us / 1e6
        gap = self.gap_us / 1e6
        for k in np.nonzero(on.any(axis=1))[0]:
            name = CLOCK_EVENT_REASONS[int(_BITS[k])]
            s, e = starts[on[k]], ends[on[k]]
            # runs closer than a plot bucket merge: at most one span per bucket is drawn
            breaks = np.nonzero(s[1:] - e[:-1] > gap)[0]
            first = np.concatenate([[0], breaks + 1])
            last = np.concatenate([breaks, [len(s) - 1]])
            spans = self.gpus[i].throttle_spans.setdefault(name, [])
            for a, b in zip(s[first], e[last], strict=True):
                if spans and a - spans[-1][1] <= gap:
                    spans[-1] = (spans[-1][0], float(b))
                else:
                    spans.append((float(a), float(b)))

    def _activity(self, which: int, i: int, ts: IntArray, v: FloatArray) -> None:
        g = self.gpus[i]
        self._add_activity(g, which, g.activity_held[which].intervals(ts, v))

    @staticmethod
    def _add_activity(g: GpuSummary, which: int, iv: Intervals) -> None:
        if not len(iv.held_us):
            return
        q = np.stack([iv.value * iv.held_us, iv.held_us]) / 1e6
        g.activity_at[which].add(iv.start_us, iv.held_us, q)

    def _sm(self, i: int, ts: IntArray, v: FloatArray) -> None:
        self._activity(0, i, ts, v)

    def _tensor(self, i: int, ts: IntArray, v: FloatArray) -> None:
        self._activity(1, i, ts, v)

    def _limit(self, i: int, ts: IntArray, v: FloatArray) -> None:
        """Keep the limit's changes only: a few, however long the run."""
        g = self.gpus[i]
        last = g.limit_change_w[-1] if g.limit_change_w else np.nan
        changed = np.flatnonzero(v != np.concatenate([[last], v[:-1]]))
        g.limit_change_us += ts[changed].tolist()
        g.limit_change_w += v[changed].tolist()

    def _energy(self, i: int, ts: IntArray, v: FloatArray) -> None:
        g = self.gpus[i]
        if not np.isfinite(g.energy_raw_first_mj):
            g.energy_raw_first_mj = float(v[0])
        g.energy_raw_last_mj = float(v[-1])

    def _memory(self, i: int, ts: IntArray, v: FloatArray) -> None:
        self.gpus[i].memory_top.add(ts, v)

    def _average(self, i: int, ts: IntArray, v: FloatArray) -> None:
        """Scrapes due by this chunk's last sample see the newest sample at their time; the first
        scrape, at the start, sees the first value the driver gives."""
        g, done = self.gpus[i], self.scraped[i]
        due = int(np.searchsorted(self.scrape_at_us, ts[-1], side="right"))
        if due > done:
            at = self.scrape_at_us[done:due]
            idx = np.searchsorted(ts, at, side="right") - 1
            prev = g.last_average_w if np.isfinite(g.last_average_w) else float(v[0])
            g.scrape_w += np.where(idx >= 0, v[idx.clip(min=0)], prev).tolist()
            self.scraped[i] = due
        g.last_average_w = float(v[-1])

    def finish(self) -> None:
        """The pending samples, then: each activity's last sample holds on for its period, and
        scrapes after the last sample see it."""
        for key in list(self._pending):
            self._flush(key, final=True)
        for g in self.gpus:
            for which, held in enumerate(g.activity_held):
                self._add_activity(g, which, held.tail(self.end_ns // 1000))
        for i, g in enumerate(self.gpus):
            if np.isfinite(g.last_average_w):
                g.scrape_w += [g.last_average_w] * (len(self.scrape_at_us) - self.scraped[i])
            g.scrape_t_s = ((self.scrape_at_us[: len(g.scrape_w)] * 1e3 - self.start_ns)
                            / 1e9).tolist()  # fmt: skip


def _job_gpus(rec: Recording, gpus: list[GpuSummary]) -> None:
    used: set[int] = set()
    seen = False
    for snapshot in rec.process_snapshots():
        seen = True
        used |= {int(k) for k, procs in snapshot["gpus"].items()
                 if any(p.get("in_job") for p in procs)}  # fmt: skip
    if seen:
        for g in gpus:
            g.used_by_job = g.index in used

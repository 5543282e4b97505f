"""What a recording says about a job, per GPU: energy, peaks, throttling, memory, refresh periods.

One pass over the raw chunks, streaming: nothing keeps every sample but the float32 power values
(for the p99) and the decimated min/max envelope the report plots. The scrape comparison samples
the driver's 1 s-averaged power every 15 s, as a Prometheus scrape of dcgm-exporter would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from hfsampler.fields import (
    CLOCK_EVENTS,
    ENERGY,
    FB_USED,
    POWER,
    POWER_AVERAGE,
    POWER_LIMIT,
)
from hfsampler.recording import Recording
from hfsampler.window import LAST, MAX

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SCRAPE_INTERVAL_S = 15.0
ENVELOPE_BUCKETS = 4000
REFRESH_CHUNKS = 10  # chunks per group used to measure each field's refresh period

# NVML's clock event (throttle) reason bits, nvmlClocksEventReason*
REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass(slots=True)
class Envelope:
    """Per time bucket, the lowest and highest raw sample: what the report draws."""

    t0_us: int
    width_us: float
    lo: FloatArray = field(default_factory=lambda: np.full(ENVELOPE_BUCKETS, np.inf))
    hi: FloatArray = field(default_factory=lambda: np.full(ENVELOPE_BUCKETS, -np.inf))

    def add(self, ts_us: IntArray, values: FloatArray) -> None:
        b = ((ts_us - self.t0_us) / self.width_us).astype(np.int64).clip(0, ENVELOPE_BUCKETS - 1)
        np.minimum.at(self.lo, b, values)
        np.maximum.at(self.hi, b, values)

    def points(self) -> tuple[FloatArray, FloatArray]:
        """(seconds from start, value), min then max per bucket with data."""
        have = np.nonzero(np.isfinite(self.lo))[0]
        t = (have + 0.5) * self.width_us / 1e6
        return np.repeat(t, 2), np.column_stack([self.lo[have], self.hi[have]]).ravel()


@dataclass(slots=True)
class _Steps:
    """A step signal over raw samples: each sample holds until the next (per GPU)."""

    last_ts: int | None = None
    last_v: float = np.nan

    def durations(self, ts: IntArray, v: FloatArray) -> tuple[IntArray, FloatArray, FloatArray]:
        """(start µs, value, held µs) for each sample before the newest one."""
        if self.last_ts is not None:
            ts = np.concatenate([[self.last_ts], ts])
            v = np.concatenate([[self.last_v], v])
        if len(ts) == 0:
            return ts, v, np.empty(0)
        self.last_ts, self.last_v = int(ts[-1]), float(v[-1])
        return ts[:-1], v[:-1], np.diff(ts).astype(np.float64)


@dataclass(slots=True)
class GpuSummary:
    """What the report says about one GPU."""

    index: int
    uuid: str
    model: str
    row: int = 0  # its position in the recording's devices (MIG instance slots come after GPUs)
    power_field: str | None = None
    samples: int = 0
    energy_j: float = np.nan  # from the driver's energy counter when recorded
    energy_integrated_j: float = 0.0  # trapezoid over the raw power samples
    peak_w: float = np.nan
    peak_at_s: float = np.nan
    power_limit_w: float = np.nan
    above_limit_s: float = 0.0
    memory_high_water_mib: float = np.nan
    throttled_s: dict[str, float] = field(default_factory=dict)
    throttle_spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    power_f32: list[npt.NDArray[np.float32]] = field(default_factory=list)
    envelope: Envelope | None = None
    scrape_t_s: list[float] = field(default_factory=list)
    scrape_w: list[float] = field(default_factory=list)
    used_by_job: bool | None = None

    def as_dict(self, duration_s: float) -> dict[str, Any]:
        power = np.concatenate(self.power_f32) if self.power_f32 else np.empty(0, np.float32)
        scrape = np.array(self.scrape_w)
        return {
            "gpu": self.index,
            "uuid": self.uuid,
            "model": self.model,
            "used_by_job": self.used_by_job,
            "power_field": self.power_field,
            "power_samples": self.samples,
            "energy_j": _num(self.energy_j),
            "energy_wh": _num(self.energy_j / 3600),
            "energy_integrated_j": _num(self.energy_integrated_j),
            "mean_power_w": _num(self.energy_integrated_j / duration_s) if duration_s else None,
            "peak_power_w": _num(self.peak_w),
            "peak_power_at_s": _num(self.peak_at_s),
            "p99_power_w": _num(float(np.percentile(power, 99))) if len(power) else None,
            "power_limit_w": _num(self.power_limit_w),
            "time_above_power_limit_s": _num(self.above_limit_s),
            "memory_high_water_mib": _num(self.memory_high_water_mib),
            "throttled_s": {k: round(v, 6) for k, v in sorted(self.throttled_s.items())},
            "scrape_15s": {
                "scrapes": len(scrape),
                "peak_w": _num(float(scrape.max())) if len(scrape) else None,
                "energy_j": _num(float(scrape.mean()) * duration_s) if len(scrape) else None,
            },
        }


def _num(value: float) -> float | None:
    return None if value is None or not np.isfinite(value) else round(float(value), 6)


@dataclass(slots=True)
class Summary:
    """The whole recording's summary: context, duration, per-GPU results, refresh periods."""

    recording: Recording
    start_ns: int
    end_ns: int
    gpus: list[GpuSummary]
    refresh_s: dict[str, float]

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def as_dict(self) -> dict[str, Any]:
        h = self.recording.header
        return {
            "command": h.get("command_line"),
            "host": h.get("host"),
            "source": h.get("source"),
            "driver_version": h.get("driver_version"),
            "labels": h.get("labels", {}),
            "job": h.get("job", {}),
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "duration_s": round(self.duration_s, 6),
            "exit_code": self.recording.end.get("exit_code") if self.recording.end else None,
            "complete": self.recording.complete,
            "torn_tail": self.recording.torn,
            "field_refresh_s": {k: round(v, 6) for k, v in sorted(self.refresh_s.items())},
            "gpus": [g.as_dict(self.duration_s) for g in self.gpus],
        }


def summarize(rec: Recording) -> Summary:
    """Read every chunk once and build the summary."""
    start_ns, end_ns = rec.time_range_ns()
    duration_us = max(1.0, (end_ns - start_ns) / 1e3)
    # one per GPU: a MIG instance's slot shares its GPU's power, clocks and throttling
    gpus = [GpuSummary(d.index, d.uuid, d.model_name, r) for r, d in enumerate(rec.devices)
            if d.is_gpu]  # fmt: skip
    for g in gpus:
        g.envelope = Envelope(start_ns // 1000, duration_us / ENVELOPE_BUCKETS)
    _windows(rec, gpus)
    power_at, reasons_at = rec.locate_role(POWER), rec.locate_role(CLOCK_EVENTS)
    power = rec.groups[power_at[0]].fields[power_at[1]].name if power_at else None
    avg_at = rec.locate_role(POWER_AVERAGE)
    steps = [_Steps() for _ in gpus]
    reason_steps = [_Steps() for _ in gpus]
    avg_parts: list[list[tuple[IntArray, FloatArray]]] = [[] for _ in gpus]
    refresh: dict[str, list[float]] = {}
    seen_chunks = [0] * len(rec.groups)
    for chunk in rec.raw_chunks():
        if seen_chunks[chunk.group] < REFRESH_CHUNKS:
            seen_chunks[chunk.group] += 1
            for c in range(len(chunk.gpu)):
                a, b = chunk.offsets[c], chunk.offsets[c + 1]
                if b - a > 1:
                    name = rec.groups[chunk.group].fields[chunk.field[c]].name
                    refresh.setdefault(name, []).append(float(np.median(np.diff(chunk.ts_us[a:b]))))
        for i, g in enumerate(gpus):
            if power_at and chunk.group == power_at[0]:
                ts, v = chunk.cell(g.row, power_at[1])
                if len(ts):
                    g.power_field = power
                    _power(g, steps[i], ts, v, start_ns)
            if reasons_at and chunk.group == reasons_at[0]:
                ts, v = chunk.cell(g.row, reasons_at[1])
                _reasons(g, reason_steps[i], ts, v, start_ns)
            if avg_at and chunk.group == avg_at[0]:
                avg_parts[i].append(chunk.cell(g.row, avg_at[1]))
    for i, g in enumerate(gpus):
        _scrape(g, avg_parts[i], start_ns, end_ns)
    _job_gpus(rec, gpus)
    periods = {k: float(np.median(v)) / 1e6 for k, v in refresh.items()}
    return Summary(rec, start_ns, end_ns, gpus, periods)


def _windows(rec: Recording, gpus: list[GpuSummary]) -> None:
    for role, attr in ((FB_USED, "memory_high_water_mib"), (POWER_LIMIT, "power_limit_w")):
        where = rec.locate_role(role)
        if where is None:
            continue
        w = rec.windows(where[0])
        if len(w.t1_ns) == 0:
            continue
        with np.errstate(all="ignore"):
            top = np.nanmax(w[MAX][:, [g.row for g in gpus], where[1]], axis=0)
        for k, g in enumerate(gpus):
            setattr(g, attr, float(top[k]))
    where = rec.locate_role(ENERGY)
    if where is not None:
        w = rec.windows(where[0])
        for g in gpus:
            last = w[LAST][:, g.row, where[1]]
            last = last[np.isfinite(last)]
            if len(last) > 1:
                g.energy_j = float(last[-1] - last[0]) / 1e3  # mJ


def _power(g: GpuSummary, steps: _Steps, ts: IntArray, v: FloatArray, start_ns: int) -> None:
    g.samples += len(v)
    g.power_f32.append(v.astype(np.float32))
    assert g.envelope is not None
    g.envelope.add(ts, v)
    k = int(np.argmax(v))
    if not v[k] <= g.peak_w:  # also when peak is still NaN
        g.peak_w, g.peak_at_s = float(v[k]), (ts[k] * 1e3 - start_ns) / 1e9
    _, held_v, held_us = steps.durations(ts, v)
    if len(held_us):
        nxt = np.append(held_v[1:], v[-1])  # each held sample's successor
        g.energy_integrated_j += float(((held_v + nxt) / 2 * held_us).sum()) / 1e6
        if np.isfinite(g.power_limit_w):
            g.above_limit_s += float(held_us[held_v > g.power_limit_w].sum()) / 1e6


def _reasons(g: GpuSummary, steps: _Steps, ts: IntArray, v: FloatArray, start_ns: int) -> None:
    t, held_v, held_us = steps.durations(ts, v)
    if not len(t):
        return
    bits = held_v.astype(np.int64)
    for bit, name in REASONS.items():
        on = (bits & bit) != 0
        if not on.any():
            continue
        g.throttled_s[name] = g.throttled_s.get(name, 0.0) + float(held_us[on].sum()) / 1e6
        spans = g.throttle_spans.setdefault(name, [])
        rel = (t * 1e3 - start_ns) / 1e9
        ends = rel + held_us / 1e6
        for s, e in zip(rel[on], ends[on], strict=True):
            if spans and abs(spans[-1][1] - s) < 1e-9:  # extends the previous span
                spans[-1] = (spans[-1][0], float(e))
            else:
                spans.append((float(s), float(e)))


def _scrape(g: GpuSummary, parts: list[tuple[IntArray, FloatArray]], start_ns: int,
            end_ns: int) -> None:  # fmt: skip
    if not parts:
        return
    ts = np.concatenate([p[0] for p in parts])
    v = np.concatenate([p[1] for p in parts])
    if not len(ts):
        return
    at = np.arange(start_ns, end_ns + 1, int(SCRAPE_INTERVAL_S * 1e9))
    # the first scrape, at the start, sees the first value the driver gives
    idx = (np.searchsorted(ts, at // 1000, side="right") - 1).clip(min=0)
    g.scrape_t_s = ((at - start_ns) / 1e9).tolist()
    g.scrape_w = v[idx].tolist()


def _job_gpus(rec: Recording, gpus: list[GpuSummary]) -> None:
    snapshots = rec.processes()
    if not snapshots:
        return
    used = {int(k) for s in snapshots for k, procs in s["gpus"].items()
            if any(p.get("in_job") for p in procs)}  # fmt: skip
    for g in gpus:
        g.used_by_job = g.index in used

"""`hfsampler probe`: measure what the GPUs here really give, and recommend sampling groups.

Through the same ``Source`` the sampler reads (so the real code paths are timed), it measures per
catalogue field the latency of a read and the true refresh period: the median gap between
distinct driver timestamps, or, where the source has none for the field (per-device calls, GPM),
between value changes, while reading every field back to back for a few seconds. It also times
one batched field-value read per GPU and one full tick, which bounds the tick rate. From those it
recommends groups: each field sampled at the largest step of a 1-2-5 ladder that does not exceed
its refresh period (sampling faster than the driver refreshes only reads repeats), never faster
than the tick cost allows. ``hfsampler run --intervals auto`` applies the recommendation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from hfsampler import fields as catalogue
from hfsampler.config.settings import MIN_INTERVAL_S, Config
from hfsampler.fields import Field
from hfsampler.sources.base import Source, SourceSpec, physical
from hfsampler.sources.registry import open_source

log = logging.getLogger(__name__)

LADDER_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
TICK_BUDGET = 0.5  # a group's read may take at most this share of its interval
LATENCY_READS = 20
DURATION_S = 3.0  # how long refresh periods are measured unless --duration says
SNAP = 1.05

Clock = Callable[[], int]


@dataclass(frozen=True, slots=True)
class FieldProbe:
    """One field's measurements (refresh per GPU; None where no refresh was seen)."""

    name: str
    group: str  # the catalogue's default group
    supported: bool
    latency_p50_us: float | None
    latency_p99_us: float | None
    refresh_s: tuple[float | None, ...]  # per GPU
    method: str  # "timestamps", "values" or "none"
    updates: int  # distinct samples seen on the first GPU
    labels: tuple[tuple[str, str], ...] = ()  # one instance of a per-rail or per-zone field

    @property
    def display(self) -> str:
        own = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{own}}}" if own else self.name

    @property
    def refresh_first_s(self) -> float | None:
        return next((r for r in self.refresh_s if r is not None), None)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Everything a probe measured, and the groups it recommends."""

    source: str
    gpus: tuple[str, ...]
    duration_s: float
    fields: tuple[FieldProbe, ...]
    batched_read_us: tuple[float, ...]  # per GPU: p50 of one read of every field-id field
    tick_p50_us: float
    tick_p99_us: float
    max_tick_hz: float
    intervals_s: dict[str, float] = field(default_factory=dict)  # recommended group -> interval
    field_groups: dict[str, str] = field(default_factory=dict)  # field -> recommended group

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["fields"] = [asdict(f) for f in self.fields]
        return out


def _percentiles_us(took_ns: Sequence[int]) -> tuple[float, float]:
    a = np.asarray(took_ns, dtype=np.float64) / 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _arrays(source_gpus: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.empty((source_gpus, n)), np.zeros((source_gpus, n), dtype=np.int64)


def time_reads(
    source: Source, fields: tuple[Field, ...], gpus: int, clock_ns: Clock, reads: int
) -> list[int]:
    """Wall time (ns) of ``reads`` back-to-back reads of ``fields``."""
    values, ts = _arrays(gpus, len(fields))
    took = []
    for _ in range(reads):
        t0 = time.perf_counter_ns()
        source.read(fields, values, ts, clock_ns())
        took.append(time.perf_counter_ns() - t0)
    return took


def refresh_periods(
    source: Source,
    fields: tuple[Field, ...],
    gpus: int,
    duration_s: float,
    clock_ns: Clock,
    pace: Callable[[], None],
) -> list[tuple[list[float | None], str, int]]:
    """Per field: (refresh period per GPU, method, distinct samples on GPU 0).

    Reads every field back to back for ``duration_s`` of ``clock_ns``. A column whose driver
    timestamp is the read time itself has none of its own, so value changes count instead.
    """
    n = len(fields)
    values, ts = _arrays(gpus, n)
    stamps: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(gpus)]
    changes: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(gpus)]
    last = np.full((gpus, n), np.nan)
    own_ts = np.zeros(n, dtype=np.bool_)
    start = clock_ns()
    end = start + int(duration_s * 1e9)
    now = start
    while now < end:
        source.read(fields, values, ts, now)
        now_us = now // 1000
        own_ts |= ((ts != 0) & (ts != now_us)).any(axis=0)
        fresh = ~np.isnan(values)
        changed = fresh & (values != last) & ~np.isnan(last)
        for g, k in zip(*np.nonzero(changed), strict=True):
            changes[g][k].append(now)
        for g, k in zip(*np.nonzero(fresh & (ts != 0)), strict=True):
            row = stamps[g][k]
            if not row or row[-1] != ts[g, k]:
                row.append(int(ts[g, k]) * 1000)
        last = np.where(fresh, values, last)
        pace()
        now = clock_ns()
    out: list[tuple[list[float | None], str, int]] = []
    for k in range(n):
        method = "timestamps" if own_ts[k] else "values"
        per_gpu: list[float | None] = []
        for g in range(gpus):
            times = sorted(set(stamps[g][k])) if own_ts[k] else changes[g][k]
            gaps = np.diff(np.asarray(times, dtype=np.int64))
            per_gpu.append(float(np.median(gaps)) / 1e9 if gaps.size else None)
        seen = len(set(stamps[0][k])) if own_ts[k] else len(changes[0][k])
        if all(r is None for r in per_gpu):
            method = "none"
        out.append((per_gpu, method, seen))
    return out


def _ladder_floor(seconds: float) -> float:
    """The largest ladder step not above ``seconds`` (the smallest step if none is).

    5% of slack: a period measured by value changes reads up to one read short (99.7 ms for
    100 ms), and must still land on 100 ms.
    """
    below = [s for s in LADDER_S if s <= seconds * SNAP]
    return below[-1] if below else LADDER_S[0]


def _ladder_ceil(seconds: float) -> float:
    above = [s for s in LADDER_S if s >= seconds]
    return above[0] if above else LADDER_S[-1]


def group_name(interval_s: float) -> str:
    ms = interval_s * 1e3
    return f"every_{ms:g}ms" if ms >= 1 else f"every_{interval_s * 1e6:g}us"


def recommend(
    probes: Sequence[FieldProbe], tick_us: float, window_s: float = 1.0
) -> tuple[dict[str, float], dict[str, str]]:
    """Groups (name -> interval) and each supported field's group, from the measurements.

    ``tick_us`` is the typical (p50) cost of reading every field once: no group is faster than
    twice that, so a tick leaves the loop time to sleep. The p50, not the p99: one preempted read
    on a busy machine must not slow every field down for the whole run.
    """
    floor_s = max(MIN_INTERVAL_S, _ladder_ceil(tick_us / 1e6 / TICK_BUDGET))
    intervals: dict[str, float] = {}
    groups: dict[str, str] = {}
    for p in probes:
        if not p.supported:
            continue
        measured = [r for r in p.refresh_s if r is not None]
        if measured:
            # the fastest GPU decides: a slower one then shows repeats, never a missed refresh
            interval = _ladder_floor(min(measured))
        else:  # no refresh seen: the catalogue's default for the field
            interval = catalogue.DEFAULT_GROUP_INTERVALS_S.get(p.group, 0.1)
        interval = min(max(interval, floor_s), window_s)
        if getattr(catalogue.BY_NAME.get(p.name), "per", None) == "link":  # off the fast lane
            interval = max(interval, catalogue.DEFAULT_GROUP_INTERVALS_S[catalogue.SLOW])
        if p.name in groups:  # another instance of the field (a Jetson's rails): the faster wins
            interval = min(interval, intervals[groups[p.name]])
        name = catalogue.GPM if p.group == catalogue.GPM else group_name(interval)
        if name == catalogue.GPM and name in intervals:
            interval = min(interval, intervals[name])
        intervals[name] = interval
        groups[p.name] = name
    return intervals, groups


def probe(
    spec: SourceSpec,
    fields: Sequence[Field] | None = None,
    duration_s: float = DURATION_S,
    *,
    clock_ns: Clock = time.time_ns,
    pace: Callable[[], None] = lambda: None,
    window_s: float = 1.0,
) -> ProbeResult:
    """Open the source in this process, measure, close it. ``pace`` runs between refresh reads
    (tests advance a fake clock there; for real GPUs reads go back to back)."""
    wanted = tuple(fields) if fields is not None else catalogue.select(None)
    source = open_source(spec)
    inventory = source.open(wanted)
    try:
        gpus = len(inventory.devices)
        supported = [bool(inventory.supported[:, c].any()) for c in range(len(inventory.fields))]
        live = tuple(f for f, ok in zip(inventory.fields, supported, strict=True) if ok)
        latency: dict[Field, tuple[float, float]] = {}
        for f in live:
            latency[f] = _percentiles_us(time_reads(source, (f,), gpus, clock_ns, LATENCY_READS))
        refresh = refresh_periods(source, live, gpus, duration_s, clock_ns, pace)
        tick = time_reads(source, live, gpus, clock_ns, 200) if live else [0]
    finally:
        source.close()
    batched = _batched_per_gpu(spec, wanted, len(physical(inventory.devices)), clock_ns)
    by_field = dict(zip(live, refresh, strict=True))
    gpu_rows = physical(inventory.devices)
    probes = []
    for f in inventory.fields:
        if f not in by_field:
            probes.append(FieldProbe(f.name, f.group, False, None, None, (), "none", 0, f.labels))
            continue
        per_gpu, method, seen = by_field[f]
        p50, p99 = latency[f]
        per_gpu = [per_gpu[r] for r in gpu_rows]  # a MIG instance slot is no GPU to report
        probes.append(
            FieldProbe(f.name, f.group, True, p50, p99, tuple(per_gpu), method, seen, f.labels)
        )
    tick_p50, tick_p99 = _percentiles_us(tick)
    intervals, groups = recommend(probes, tick_p50, window_s)
    return ProbeResult(
        source=spec.kind,
        gpus=tuple(inventory.devices[r].model_name for r in gpu_rows),
        duration_s=duration_s,
        fields=tuple(probes),
        batched_read_us=batched,
        tick_p50_us=tick_p50,
        tick_p99_us=tick_p99,
        max_tick_hz=1e6 / tick_p99 if tick_p99 > 0 else 0.0,
        intervals_s=intervals,
        field_groups=groups,
    )


def _batched_per_gpu(
    spec: SourceSpec, wanted: tuple[Field, ...], gpus: int, clock_ns: Clock
) -> tuple[float, ...]:
    """Per GPU, p50 of one read of every field-id field (one ``nvmlDeviceGetFieldValues``)."""
    ids = tuple(f for f in wanted if f.nvml_field and not f.nvml_call)
    if not ids or spec.kind != "nvml":
        return ()
    out = []
    indices = spec.indices if spec.indices is not None else tuple(range(gpus))
    for i in indices:
        source = open_source(replace(spec, indices=(i,)))
        inv = source.open(ids)
        try:
            ok = tuple(f for f, s in zip(inv.fields, inv.supported[0].tolist(), strict=True) if s)
            rows = len(inv.devices)  # one GPU, and a MIG GPU's instance slots after it
            out.append(
                _percentiles_us(time_reads(source, ok, rows, clock_ns, 200))[0] if ok else 0.0
            )
        finally:
            source.close()
    return tuple(out)


# -- output ---------------------------------------------------------------------------------------


# -- the subcommand -------------------------------------------------------------------------------


def apply_recommendation(config: Config, result: ProbeResult) -> Config:
    """``config`` with the probe's groups in place of its intervals and field groups.

    A selected field the probe found unsupported has no recommended group, and no GPU gives it:
    it leaves ``fields`` rather than need an interval. Where the probe placed no field at all,
    ``config`` stays as it is (discovery then finds nothing to sample and says so).
    """
    if not result.field_groups:
        return config
    kept = {n: min(s, config.window_s) for n, s in result.intervals_s.items()}
    names = [f.name for f in config.selected_fields()]
    fields, counters = config.fields, config.fields_csv
    if any(n not in result.field_groups for n in names):
        fields = tuple(n for n in dict.fromkeys(names) if n in result.field_groups)
        # the counters file's fields are added to `fields`: it must leave out the same ones
        counters = counters.only(fields) if counters is not None else None
    groups = dict(result.field_groups)
    return replace(
        config, intervals_s=kept, field_groups=groups, fields=fields, fields_csv=counters
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def format_table(r: ProbeResult) -> str:
    """The probe's table: per field latency, refresh, method and recommended group."""
    width = max(len(f.display) for f in r.fields) if r.fields else 10
    lines = [
        f"hfsampler probe: {r.source}, {len(r.gpus)} GPU(s) {', '.join(sorted(set(r.gpus)))}; "
        f"refresh over {r.duration_s:g}s",
        "",
        f"{'FIELD':<{width}}  {'read p50 us':>11}  {'p99 us':>8}  {'refresh ms':>10}  "
        f"{'method':<10}  {'seen':>5}  GROUP",
    ]
    for f in r.fields:
        if not f.supported:
            lines.append(f"{f.display:<{width}}  {'unsupported':>11}")
            continue
        lines.append(
            f"{f.display:<{width}}  {f.latency_p50_us or 0:>11.1f}  {f.latency_p99_us or 0:>8.1f}  "
            f"{_ms(f.refresh_first_s):>10}  {f.method:<10}  {f.updates:>5}  "
            f"{r.field_groups.get(f.name, '-')}"
        )
    lines.append("")
    if r.batched_read_us:
        per = ", ".join(f"GPU{i} {us:.1f} us" for i, us in enumerate(r.batched_read_us))
        lines.append(f"one batched field-value read: {per}")
    lines.append(
        f"one tick of every field, all GPUs: p50 {r.tick_p50_us:.1f} us, p99 "
        f"{r.tick_p99_us:.1f} us -> at most {r.max_tick_hz:.0f} ticks/s"
    )
    lines.append("recommended groups (hfsampler run --intervals auto):")
    for name, interval in sorted(r.intervals_s.items(), key=lambda kv: kv[1]):
        members = sorted(f for f, g in r.field_groups.items() if g == name)
        lines.append(f"  {name}: every {interval * 1e3:g} ms, {len(members)} fields")
    return "\n".join(lines)

"""The summary as data: its per-GPU table, and per phase and per step what its streamed state says.

Reads the integrals and maxima a ``Summary`` kept at the phases' and steps' edges; nothing here
touches the recording again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hfsampler.fields import CLOCK_EVENT_REASONS
from hfsampler.profiling.recording_format import Marker
from hfsampler.profiling.report_consumers import consumers_dict
from hfsampler.profiling.streams import HISTOGRAM_BIN_W, Held, histogram_quantile
from hfsampler.profiling.summary import Summary

REASON_NAMES = tuple(CLOCK_EVENT_REASONS.values())


def _num(value: float | None, digits: int = 6) -> float | None:
    return None if value is None or not np.isfinite(value) else round(float(value), digits)


def phase_tables(summary: Summary) -> list[dict[str, Any]]:
    """One entry per tabled phase: its span, then per GPU and for all GPUs together its energy,
    power, time above the limit, throttling, activity and memory high-water mark."""
    out = []
    for k, p in enumerate(summary.timeline.phases):
        gpus: list[dict[str, Any]] = []
        duration_s = (p.end_ns - p.start_ns) / 1e9
        for g in summary.gpus:
            edges = g.phase_edges_us
            a = int(np.searchsorted(edges, p.start_ns // 1000))
            b = int(np.searchsorted(edges, p.end_ns // 1000))
            energy, above, covered = g.power_at.between(a, b)
            throttled = g.reasons_at.between(a, b)
            gpus.append({
                "gpu": g.index,
                "energy_j": _num(energy) if covered else None,
                "energy_wh": _num(energy / 3600, 9) if covered else None,
                "mean_power_w": _num(energy / covered) if covered else None,
                "p99_power_w": _num(histogram_quantile(g.phase_histograms[k], 0.99), 3),
                "peak_power_w": _num(g.power_top.between(a, b)),
                "time_above_power_limit_s": _num(above) if covered else None,
                "throttled_s": {name: round(float(throttled[r]), 6)
                                for r, name in enumerate(REASON_NAMES) if throttled[r]},
                "mean_sm_active": g.activity(0, a, b),
                "mean_tensor_active": g.activity(1, a, b),
                "memory_high_water_mib": _num(g.memory_top.between(a, b)),
            })  # fmt: skip
        energies = [float(x["energy_j"]) for x in gpus if x["energy_j"] is not None]
        total = sum(energies) if energies else None
        out.append({
            "name": p.name,
            "label": p.label,
            "occurrence": p.occurrence,
            "start_s": round((p.start_ns - summary.start_ns) / 1e9, 6),
            "end_s": round((p.end_ns - summary.start_ns) / 1e9, 6),
            "duration_s": round(duration_s, 6),
            "ended": p.ended,
            "depth": p.depth,
            "energy_j": _num(total),
            "energy_wh": _num(total / 3600, 9) if total is not None else None,
            "p99_resolution_w": HISTOGRAM_BIN_W,
            "gpus": gpus,
        })  # fmt: skip
    return out


def _spread(values: np.ndarray) -> dict[str, float | None]:
    if not len(values):
        return {"mean": None, "std": None, "min": None, "median": None, "max": None, "cv": None}
    mean = float(values.mean())
    std = float(values.std())
    return {"mean": _num(mean), "std": _num(std), "min": _num(float(values.min())),
            "median": _num(float(np.median(values))), "max": _num(float(values.max())),
            "cv": _num(std / mean) if mean else None}  # fmt: skip


def step_tables(summary: Summary) -> list[dict[str, Any]]:
    """One entry per step series: how many steps, their duration, and the energy per step of all
    GPUs together (mean, spread, each step's value) and of each GPU (mean)."""
    out = []
    for series in summary.timeline.steps:
        per_gpu = []
        for g in summary.gpus:
            edges = g.step_edges_us
            a = np.searchsorted(edges, series.start_ns // 1000)
            b = np.searchsorted(edges, series.end_ns // 1000)
            per_gpu.append(g.step_energy_at.values[0, b] - g.step_energy_at.values[0, a])
        energy = np.sum(per_gpu, axis=0) if per_gpu else np.zeros(len(series.numbers))
        durations = (series.end_ns - series.start_ns) / 1e9
        out.append({
            "name": series.name,
            "steps": len(series.numbers),
            "first_step": int(series.numbers[0]),
            "last_step": int(series.numbers[-1]),
            "duration_s": _spread(durations),
            "energy_per_step_j": _spread(energy),
            "energy_per_step_j_by_gpu": [_num(float(e.mean())) for e in per_gpu],
            "step_energy_j": np.round(energy, 3).tolist(),
            "step_numbers": series.numbers.tolist(),
            "step_start_s": np.round((series.start_ns - summary.start_ns) / 1e9, 6).tolist(),
        })  # fmt: skip
    return out


def _mark(summary: Summary, m: Marker) -> dict[str, Any]:
    return {"t_s": round((m.t_ns - summary.start_ns) / 1e9, 6), "name": m.name, "source": m.source}


def summary_dict(summary: Summary) -> dict[str, Any]:
    """The whole summary as JSON-ready data: the report's and the comparison's one input."""
    h = summary.recording.header
    tl = summary.timeline
    clocks = [Held(), *(g.power_held for g in summary.gpus)]  # Held(): none stepped back
    return {
        "command": h.get("command_line"),
        "host": h.get("host"),
        "source": h.get("source"),
        "driver_version": h.get("driver_version"),
        "labels": h.get("labels", {}),
        "job": h.get("job", {}),
        "start_ns": summary.start_ns,
        "end_ns": summary.end_ns,
        "duration_s": round(summary.duration_s, 6),
        "exit_code": summary.recording.end.get("exit_code") if summary.recording.end else None,
        "complete": summary.recording.complete,
        "torn_tail": summary.recording.torn,
        "stopped_early": summary.recording.stopped_early,
        "damaged_parts": summary.recording.damaged_parts,
        "damaged_bytes": summary.recording.damaged_bytes,
        "file_problem": summary.recording.problem,  # one line, None when the file is whole
        "field_refresh_s": {k: round(v, 6) for k, v in sorted(summary.refresh_s.items())},
        "gpus": [g.as_dict(summary.duration_s) for g in summary.gpus],
        "phases": phase_tables(summary),
        "steps": step_tables(summary),
        "marks": [_mark(summary, m) for m in tl.marks],
        "marker_problems": list(tl.problems),
        "marker_problems_not_listed": tl.problems_not_listed,
        "clock_steps_back": max(held.steps_back for held in clocks),
        "clock_stepped_back_s": max(held.stepped_back_us for held in clocks) / 1e6,
        "phases_not_tabled": tl.phases_not_tabled,
        "steps_not_tabled": tl.steps_not_tabled,
        "consumers": consumers_dict(summary),
    }

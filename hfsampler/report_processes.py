"""The report's per-process part: each GPU's compute processes over time, memory and SM share.

From the recording's process snapshots (``PROC``, about once a second): per GPU, one plot of
each process's memory and one of its SM utilisation (where the driver gives it), the job's own
processes (the child's descendants) drawn solid, others dotted; and a JSON section with each
process's first and last sighting, memory high-water mark and mean SM utilisation. A trace keeps
at most ``MAX_POINTS`` points (the highest value of each time bucket), whatever the length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hfsampler.recording import Recording

MAX_POINTS = 2000
MIB = float(1 << 20)


@dataclass(slots=True)
class ProcessTrack:
    """One process on one GPU across the snapshots that saw it."""

    pid: int
    in_job: bool = False
    t_s: list[float] = field(default_factory=list)
    memory_mib: list[float] = field(default_factory=list)  # NaN where the driver gave none
    sm_util_pct: list[float] = field(default_factory=list)  # NaN where the driver gave none

    def as_dict(self) -> dict[str, Any]:
        mem, sm = np.array(self.memory_mib), np.array(self.sm_util_pct)
        return {
            "pid": self.pid,
            "in_job": self.in_job,
            "first_seen_s": self.t_s[0],
            "last_seen_s": self.t_s[-1],
            "snapshots": len(self.t_s),
            "memory_high_water_mib": _finite(np.nanmax(mem) if np.isfinite(mem).any() else None),
            "mean_sm_util_pct": _finite(np.nanmean(sm) if np.isfinite(sm).any() else None),
        }


def _finite(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


def tracks(rec: Recording) -> dict[int, list[ProcessTrack]]:
    """Per recorded GPU index, its processes in pid order (none for a GPU without any)."""
    start = int(rec.header["start_ns"])
    by_gpu: dict[int, dict[int, ProcessTrack]] = {d.index: {} for d in rec.devices}
    for snap in rec.processes():
        t = (int(snap["t_ns"]) - start) / 1e9
        for gpu, procs in snap["gpus"].items():
            seen = by_gpu.setdefault(int(gpu), {})
            for p in procs:
                track = seen.setdefault(int(p["pid"]), ProcessTrack(int(p["pid"])))
                track.in_job = track.in_job or bool(p.get("in_job"))
                track.t_s.append(t)
                track.memory_mib.append(_number(p.get("used_memory_bytes")) / MIB)
                track.sm_util_pct.append(_number(p.get("sm_util_pct")))
    return {g: [seen[pid] for pid in sorted(seen)] for g, seen in sorted(by_gpu.items())}


def processes_json(rec: Recording) -> dict[str, list[dict[str, Any]]]:
    """The JSON section: per GPU index (a string, as JSON keys are), its processes."""
    return {str(g): [t.as_dict() for t in ts] for g, ts in tracks(rec).items()}


def _thin(t: list[float], y: list[float]) -> tuple[list[float], list[float | None]]:
    """At most MAX_POINTS points: the highest of each bucket, at that bucket's first time."""
    ta, ya = np.asarray(t), np.asarray(y)
    if len(ta) > MAX_POINTS:
        edges = np.linspace(0, len(ta), MAX_POINTS + 1).astype(np.int64)
        starts = edges[:-1]
        filled = np.where(np.isnan(ya), -np.inf, ya)
        peak = np.maximum.reduceat(filled, starts)
        ta, ya = ta[starts], np.where(np.isneginf(peak), np.nan, peak)
    return ta.tolist(), [None if np.isnan(v) else float(v) for v in ya]


def processes_figure(rec: Recording, gpu: int, procs: list[ProcessTrack]) -> Any:
    """One GPU's figure: memory per process above, SM utilisation per process below."""
    import plotly.graph_objects as go  # type: ignore[import-untyped]
    from plotly.subplots import make_subplots  # type: ignore[import-untyped]

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["Memory per process (MiB)",
                                        "SM utilisation per process (%)"])  # fmt: skip
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    for k, track in enumerate(procs):
        name = f"pid {track.pid}" + ("" if track.in_job else " (not the job)")
        line = {"color": palette[k % len(palette)], "dash": "solid" if track.in_job else "dot"}
        for row, values in ((1, track.memory_mib), (2, track.sm_util_pct)):
            x, y = _thin(track.t_s, values)
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", line_shape="hv", line=line,
                                     marker={"size": 3}, name=name, legendgroup=name,
                                     showlegend=row == 1), row=row, col=1)  # fmt: skip
    fig.update_xaxes(title_text="seconds since start", row=2, col=1)
    fig.update_layout(height=520, template="plotly_white", title=f"GPU {gpu}: processes",
                      margin={"t": 80, "l": 60, "r": 20, "b": 40})  # fmt: skip
    return fig


def processes_html(rec: Recording) -> str:
    """The page's section: a heading, then a figure per GPU with processes (plotly.js is on the
    page already, from the figures before)."""
    parts = ["<h2>GPU processes</h2>"]
    found = {g: ts for g, ts in tracks(rec).items() if ts}
    if not found:
        parts.append("<p>No GPU process was recorded (the source gives none, or the job used "
                     "no GPU).</p>")  # fmt: skip
    for gpu, procs in found.items():
        fig = processes_figure(rec, gpu, procs)
        div = f"processes-gpu{gpu}"
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False,
                                 config={"responsive": True}, div_id=div))  # fmt: skip
    return "".join(parts)

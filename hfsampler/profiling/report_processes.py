"""The report's per-process part: each GPU's compute processes over time, memory and SM share.

From the recording's process snapshots (``PROC``: written when the processes or their numbers
change, and every 10 s at least): per GPU, one plot of each process's memory and one of its SM
utilisation (where the driver gives it), the job's own processes (the child's descendants) drawn
solid, others dotted; and a JSON section with each process's first and last sighting, memory
high-water mark and mean SM utilisation (weighted by time: a snapshot's numbers hold until the
next). The snapshots are read one at a time and folded into ``MAX_POINTS`` time buckets per
process (the highest value of each), so the state is fixed per process whatever the length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hfsampler.profiling.recording import Recording

MAX_POINTS = 2000  # time buckets per process: the points a trace can have
MIB = float(1 << 20)
NAN = float("nan")


class ProcessTrack:
    """One process on one GPU across the snapshots that saw it, folded into time buckets."""

    __slots__ = ("_sm_sum", "_sm_weight", "bucket_t_s", "first_seen_s", "in_job",
                 "last_seen_s", "memory_mib", "pid", "sm_util_pct", "snapshots")  # fmt: skip

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.in_job = False
        self.first_seen_s = float("nan")
        self.last_seen_s = float("nan")
        self.snapshots = 0
        # per bucket: the first time the process was seen in it, its highest memory and SM
        # utilisation there (NaN where the driver gave none, or the process was not seen)
        # (plain lists: one float stored per snapshot is cheaper than numpy's scalar indexing)
        self.bucket_t_s = [NAN] * MAX_POINTS
        self.memory_mib = [NAN] * MAX_POINTS
        self.sm_util_pct = [NAN] * MAX_POINTS
        self._sm_sum = 0.0  # SM utilisation x seconds it held
        self._sm_weight = 0.0

    def add(self, bucket: int, t_s: float, memory_mib: float, sm_util_pct: float) -> None:
        if self.snapshots == 0:
            self.first_seen_s = t_s
        self.snapshots += 1
        self.last_seen_s = t_s
        if self.bucket_t_s[bucket] != self.bucket_t_s[bucket]:  # NaN: first time in it
            self.bucket_t_s[bucket] = t_s
        self.memory_mib[bucket] = _fmax(self.memory_mib[bucket], memory_mib)
        self.sm_util_pct[bucket] = _fmax(self.sm_util_pct[bucket], sm_util_pct)

    def held(self, sm_util_pct: float, seconds: float) -> None:
        """A snapshot's SM utilisation held for ``seconds`` (until the next snapshot)."""
        if math.isfinite(sm_util_pct):
            self._sm_sum += sm_util_pct * seconds
            self._sm_weight += seconds

    def points(self, values: list[float]) -> tuple[list[float], list[float | None]]:
        """The buckets the process was seen in: their times and values (None for no value)."""
        seen = [i for i, t in enumerate(self.bucket_t_s) if not math.isnan(t)]
        return [self.bucket_t_s[i] for i in seen], [
            None if math.isnan(values[i]) else values[i] for i in seen
        ]

    def as_dict(self) -> dict[str, Any]:
        mem = np.array(self.memory_mib)
        return {
            "pid": self.pid,
            "in_job": self.in_job,
            "first_seen_s": self.first_seen_s,
            "last_seen_s": self.last_seen_s,
            "snapshots": self.snapshots,
            "memory_high_water_mib": _finite(np.nanmax(mem) if np.isfinite(mem).any() else None),
            "mean_sm_util_pct": _finite(
                self._sm_sum / self._sm_weight if self._sm_weight > 0 else self._last_sm()
            ),
        }

    def _last_sm(self) -> float | None:
        """A process seen for no time at all (one snapshot at the end): its highest SM value."""
        sm = np.array(self.sm_util_pct)
        return float(np.nanmax(sm)) if np.isfinite(sm).any() else None


def _fmax(old: float, new: float) -> float:
    """The larger, a NaN on either side left out (``np.fmax`` for two floats, without numpy's
    per-call cost: this runs once per process per snapshot)."""
    return old if new != new or old >= new else new


def _finite(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


def tracks(rec: Recording) -> dict[int, list[ProcessTrack]]:
    """Per recorded GPU index, its processes in pid order (none for a GPU without any)."""
    start, end = rec.time_range_ns()
    span = max(end - start, 1)
    by_gpu: dict[int, dict[int, ProcessTrack]] = {d.index: {} for d in rec.devices}
    held: list[tuple[ProcessTrack, float]] = []  # the last snapshot's SM values, until the next
    last_t = 0.0
    for snap in rec.process_snapshots():  # one chunk decoded at a time
        t_ns = int(snap["t_ns"])
        t = (t_ns - start) / 1e9
        for track, sm in held:
            track.held(sm, t - last_t)
        held, last_t = [], t
        bucket = min(MAX_POINTS - 1, max(0, (t_ns - start) * MAX_POINTS // span))
        for gpu, procs in snap["gpus"].items():
            seen = by_gpu.setdefault(int(gpu), {})
            for p in procs:
                pid = int(p["pid"])
                track = seen.get(pid) or seen.setdefault(pid, ProcessTrack(pid))
                track.in_job = track.in_job or bool(p.get("in_job"))
                sm = _number(p.get("sm_util_pct"))
                track.add(bucket, t, _number(p.get("used_memory_bytes")) / MIB, sm)
                held.append((track, sm))
    for track, sm in held:  # the last snapshot holds until the recording's end
        track.held(sm, (end - start) / 1e9 - last_t)
    return {g: [seen[pid] for pid in sorted(seen)] for g, seen in sorted(by_gpu.items())}


def processes_json(rec: Recording) -> dict[str, list[dict[str, Any]]]:
    """The JSON section: per GPU index (a string, as JSON keys are), its processes."""
    return {str(g): [t.as_dict() for t in ts] for g, ts in tracks(rec).items()}


def processes_figure(
    rec: Recording, gpu: int, procs: list[ProcessTrack], shapes: Sequence[Mapping[str, Any]] = ()
) -> Any:
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
            x, y = track.points(values)
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", line_shape="hv", line=line,
                                     marker={"size": 3}, name=name, legendgroup=name,
                                     showlegend=row == 1), row=row, col=1)  # fmt: skip
    fig.update_xaxes(title_text="seconds since start", row=2, col=1)
    fig.update_layout(height=520, template="plotly_white", title=f"GPU {gpu}: processes",
                      shapes=list(shapes),
                      margin={"t": 80, "l": 60, "r": 20, "b": 40})  # fmt: skip
    return fig


def processes_html(rec: Recording, shapes: Sequence[Mapping[str, Any]] = ()) -> str:
    """The page's section: a heading, then a figure per GPU with processes (plotly.js is on the
    page already, from the figures before), the job's phases shaded as on the others
    (``shapes``: the report's)."""
    parts = ["<h2>GPU processes</h2>"]
    found = {g: ts for g, ts in tracks(rec).items() if ts}
    if not found:
        parts.append("<p>No GPU process was recorded (the source gives none, or the job used "
                     "no GPU).</p>")  # fmt: skip
    for gpu, procs in found.items():
        fig = processes_figure(rec, gpu, procs, shapes)
        div = f"processes-gpu{gpu}"
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False,
                                 config={"responsive": True}, div_id=div))  # fmt: skip
    return "".join(parts)

"""`hfsampler report`: a recording as one self-contained HTML page of plots, or its summary as JSON.

The page embeds plotly.js once (no network needed to view it): the context and summary, the
job's phases and steps (from its markers), then per GPU: power (the raw samples as a min/max
envelope per plot bucket, the window min-max band and the window mean), utilization, memory used,
temperature, SM clock, and throttle reasons as a timeline, every phase shaded across them; then
what a 15 s scrape of the 1 s-averaged power would have shown beside the truth; last, a table per
phase and each field's observed refresh period. Every series is reduced to a fixed number of plot
buckets while the file streams (``profiling.summary``), so the page's size does not grow with the
recording. Plots use SVG traces, not WebGL, so the page renders anywhere, headless browsers
included. Two recordings make a comparison page instead (``profiling.compare``). A missing file,
one that is not a recording or cannot be read, more than two, an output that cannot be written
(checked before the long pass), a closed stdout: one line naming it, exit 2.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from hfsampler.errors import HfsamplerError
from hfsampler.fields import CLOCK_EVENT_REASONS, POWER
from hfsampler.profiling.pages import (
    figure_html,
    fmt,
    html_table,
    page,
    plotly_modules,
    summary_html,
)
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import RecordingError
from hfsampler.profiling.report_consumers import consumers_html
from hfsampler.profiling.report_processes import processes_html
from hfsampler.profiling.summary import PANELS, Summary
from hfsampler.profiling.tables import summary_dict
from hfsampler.sampling.window import MAX, MEAN, MIN

PHASE_COLOURS = (
    "rgba(44,160,44,0.13)",
    "rgba(255,127,14,0.13)",
    "rgba(148,103,189,0.13)",
    "rgba(140,86,75,0.13)",
    "rgba(23,190,207,0.13)",
    "rgba(188,189,34,0.13)",
)
STEP_COLOUR = "rgba(127,127,127,0.10)"
MAX_SHADED_STEPS = 200  # more steps than this are tabled, not shaded: the bands would be hairs


def phase_shapes(summary: Summary) -> list[dict[str, Any]]:
    """Every phase as a band over the figure's whole height, labelled at the top; steps as
    alternating grey bands (a few hundred at most); instant marks as dotted lines."""
    start, tl = summary.start_ns, summary.timeline
    shapes: list[dict[str, Any]] = []
    for k, p in enumerate(tl.phases):
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "y0": 0, "y1": 1,
                       "x0": (p.start_ns - start) / 1e9, "x1": (p.end_ns - start) / 1e9,
                       "fillcolor": PHASE_COLOURS[k % len(PHASE_COLOURS)], "line": {"width": 0},
                       "layer": "below", "name": f"phase {p.label}",
                       "label": {"text": p.label, "textposition": "top left",
                                 "font": {"size": 11}}})  # fmt: skip
    for series in tl.steps:
        if len(series.numbers) > MAX_SHADED_STEPS:
            continue
        for k in range(0, len(series.numbers), 2):
            shapes.append({"type": "rect", "xref": "x", "yref": "paper", "y0": 0, "y1": 1,
                           "x0": (int(series.start_ns[k]) - start) / 1e9,
                           "x1": (int(series.end_ns[k]) - start) / 1e9, "fillcolor": STEP_COLOUR,
                           "line": {"width": 0}, "layer": "below",
                           "name": f"{series.name} {series.numbers[k]}"})  # fmt: skip
    for m in tl.marks:
        x = (m.t_ns - start) / 1e9
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "y0": 0, "y1": 1, "x0": x,
                       "x1": x, "line": {"width": 1, "dash": "dot", "color": "#555"},
                       "name": f"mark {m.name}",
                       "label": {"text": m.name, "textposition": "end"}})  # fmt: skip
    return shapes


def gpu_figure(summary: Summary, i: int) -> Any:
    """One GPU's figure: power, the other panels, and the throttle timeline, sharing the x axis,
    every phase shaded across all of them."""
    go, make_subplots = plotly_modules()
    g = summary.gpus[i]
    titles = ["Power (W)", *(p[2] for p in PANELS), "Throttle reasons"]
    fig = make_subplots(rows=len(titles), cols=1, shared_xaxes=True, vertical_spacing=0.03,
                        subplot_titles=titles, row_heights=[3, 1, 1, 1, 1, 1])  # fmt: skip
    fig.update_layout(shapes=phase_shapes(summary))  # first: add_hline appends to them
    band = [summary.window_series(POWER, s) for s in (MIN, MAX, MEAN)]
    if all(b is not None for b in band):
        (_, lo), (_, hi), (_, mean) = band  # type: ignore[misc]
        t, y_hi = hi.series(i, "max")
        _, y_lo = lo.series(i, "min")
        tm, y_mean = mean.series(i, "mean")
        fig.add_trace(go.Scatter(x=t, y=y_hi, mode="lines", line={"width": 0}, showlegend=False,
                                 hoverinfo="skip", line_shape="hv"), row=1, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=t, y=y_lo, mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor="rgba(99,110,250,0.25)", line_shape="hv",
                                 name="window min-max"), row=1, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=tm, y=y_mean, mode="lines", line_shape="hv",
                                 line={"color": "rgb(99,110,250)"}, name="window mean"),
                      row=1, col=1)  # fmt: skip
    tx, ty = g.envelope.points()
    if len(tx):
        fig.add_trace(go.Scatter(x=tx, y=ty, mode="lines", line={"width": 1, "color": "#d62728"},
                                 name=f"raw samples ({g.power_field})"), row=1, col=1)  # fmt: skip
    if np.isfinite(g.power_limit_w):
        fig.add_hline(y=g.power_limit_w, line_dash="dash", line_color="black", row=1, col=1,
                      annotation_text="power limit")  # fmt: skip
    for row, (role, stat, label) in enumerate(PANELS, start=2):
        found = summary.window_series(role, stat)
        if found is None:
            continue
        t, y = found[1].series(i, stat.name)
        fig.add_trace(go.Scatter(x=t, y=y, mode="lines", line_shape="hv",
                                 name=f"{label.split(' (')[0]} (window {stat.name})"),
                      row=row, col=1)  # fmt: skip
    names = sorted(g.throttle_spans)
    for reason in names:
        xs: list[float | None] = []
        for s, e in g.throttle_spans[reason]:
            xs += [s, e, None]
        fig.add_trace(go.Scatter(x=xs, y=[reason if x is not None else None for x in xs],
                                 mode="lines", line={"width": 10}, name=reason,
                                 connectgaps=False), row=len(titles), col=1)  # fmt: skip
    if not names:
        fig.add_annotation(text="no throttling recorded", showarrow=False, row=len(titles), col=1,
                           x=summary.duration_s / 2, y=0)  # fmt: skip
    fig.update_xaxes(title_text="seconds since start", row=len(titles), col=1)
    fig.update_layout(height=1100, title=f"GPU {g.index}: {g.model} ({g.uuid})",
                      template="plotly_white",
                      margin={"t": 80, "l": 60, "r": 20, "b": 40})  # fmt: skip
    return fig


def scrape_figure(summary: Summary) -> Any:
    """What a 15 s scrape of the 1 s-averaged power reported, beside the millisecond truth."""
    go, make_subplots = plotly_modules()
    n = len(summary.gpus)
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[f"GPU {g.index}" for g in summary.gpus])  # fmt: skip
    for row, g in enumerate(summary.gpus, start=1):
        tx, ty = g.envelope.points()
        if len(tx):
            fig.add_trace(go.Scatter(x=tx, y=ty, mode="lines",
                                     line={"width": 1, "color": "#d62728"},
                                     name="truth: raw samples", showlegend=row == 1),
                          row=row, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=g.scrape_t_s, y=g.scrape_w, mode="lines+markers",
                                 line_shape="hv", line={"color": "black", "width": 2},
                                 name="15 s scrape of the 1 s average", showlegend=row == 1),
                      row=row, col=1)  # fmt: skip
    fig.update_xaxes(title_text="seconds since start", row=n, col=1)
    fig.update_layout(height=260 * n + 120, template="plotly_white", shapes=phase_shapes(summary),
                      title="What a 15 s scrape of dcgm-exporter's power "
                            "would have shown")  # fmt: skip
    return fig


def phase_rows(phase: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """One phase's table: a row per measure, a column per GPU."""
    gpus = phase["gpus"]
    order = list(CLOCK_EVENT_REASONS.values())
    reasons = sorted({r for g in gpus for r in g["throttled_s"]}, key=order.index)
    return [
        ("energy", [f"{fmt(g['energy_j'], ' J', 1)} ({fmt(g['energy_wh'], ' Wh', 4)})"
                    for g in gpus]),
        ("mean power", [fmt(g["mean_power_w"], " W") for g in gpus]),
        ("p99 power", [fmt(g["p99_power_w"], " W") for g in gpus]),
        ("peak power", [fmt(g["peak_power_w"], " W") for g in gpus]),
        ("time above power limit", [fmt(g["time_above_power_limit_s"], " s", 3) for g in gpus]),
        *((f"throttled: {r}", [fmt(g["throttled_s"].get(r, 0.0), " s", 3) for g in gpus])
          for r in reasons),
        ("mean SM activity", [fmt(_pct(g["mean_sm_active"]), " %") for g in gpus]),
        ("mean tensor activity", [fmt(_pct(g["mean_tensor_active"]), " %") for g in gpus]),
        ("memory high-water mark", [fmt(g["memory_high_water_mib"], " MiB", 0) for g in gpus]),
    ]  # fmt: skip


def _pct(ratio: float | None) -> float | None:
    return None if ratio is None else ratio * 100


def phases_html(d: dict[str, Any]) -> str:
    """An overview of the phases, the step series, and what the markers got wrong."""
    phases, steps = d["phases"], d["steps"]
    if not phases and not steps and not d["marks"]:
        return "<h2>Phases</h2><p>no markers recorded (see hfsampler.markers)</p>"
    out = ["<h2>Phases</h2>"]
    overview = [(p["label"],
                 [fmt(p["start_s"], " s", 3), fmt(p["duration_s"], " s", 3),
                  f"{fmt(p['energy_j'], ' J', 1)} ({fmt(p['energy_wh'], ' Wh', 4)})",
                  "yes" if p["ended"] else "NO: runs to the end of the recording"])
                for p in phases]  # fmt: skip
    if phases:
        head = ["phase", "start", "duration", "energy, all GPUs", "ended"]
        out.append(html_table(overview, head, [p["depth"] for p in phases]))
    if d["phases_not_tabled"]:
        out.append(f"<p>{d['phases_not_tabled']} more phases were recorded but not tabled</p>")
    if steps:
        rows = []
        for s in steps:
            e, t = s["energy_per_step_j"], s["duration_s"]
            rows.append((s["name"], [
                str(s["steps"]), f"{s['first_step']} to {s['last_step']}",
                f"{fmt(t['mean'], ' s', 4)} ± {fmt(t['std'], ' s', 4)}",
                f"{fmt(e['mean'], ' J', 2)} ± {fmt(e['std'], ' J', 2)}",
                " / ".join(fmt(e[k], "", 2) for k in ("min", "median", "max")) + " J",
                fmt(_pct(e["cv"]), " %", 2),
                ", ".join(fmt(x, " J", 2) for x in s["energy_per_step_j_by_gpu"]),
            ]))  # fmt: skip
        out.append("<h3>Steps</h3>")
        out.append(html_table(rows, ["steps", "count", "numbers", "duration", "energy per step "
                                 "(all GPUs)", "min / median / max", "spread (CV)",
                                 "per GPU (mean)"]))  # fmt: skip
        if d["steps_not_tabled"]:
            out.append(f"<p>{d['steps_not_tabled']} more steps were recorded but not tabled</p>")
    if d["marker_problems"]:
        items = "".join(f"<li>{html.escape(m)}</li>" for m in d["marker_problems"])
        out.append(f"<p>Markers:</p><ul>{items}</ul>")
    if d["marker_problems_not_listed"]:
        out.append(f"<p>{d['marker_problems_not_listed']} more problems with the markers, "
                   "not listed</p>")  # fmt: skip
    return "".join(out)


def phase_details_html(d: dict[str, Any]) -> str:
    """A table per phase, GPU by GPU (after the plots: there may be a hundred)."""
    heads = ["", *(f"GPU {g['gpu']}" for g in d["gpus"])]
    out = ["<h2>Phases, GPU by GPU</h2>"] if d["phases"] else []
    for p in d["phases"]:
        span = f"{p['start_s']:.3f} s to {p['end_s']:.3f} s ({p['duration_s']:.3f} s)"
        out.append(f"<h3 class='phase'>{html.escape(p['label'])}: {span}</h3>")
        out.append(html_table(phase_rows(p), heads))
    return "".join(out)


def fields_html(d: dict[str, Any]) -> str:
    """Every recorded field's observed refresh period: a reference, one row a field."""
    rows = [(k, [f"{v * 1e3:g} ms"]) for k, v in d["field_refresh_s"].items()]
    return "<h2>Fields</h2>" + html_table(rows, ["field", "observed refresh period"])


def render_html(summary: Summary) -> str:
    """The whole page: context, summary table, phases, one figure per GPU, the scrape
    comparison, the phases GPU by GPU, the consumers, the processes, then the fields' refresh
    periods (after the plots: some 40 rows, the activity fields among them, would push the first
    figure off the first screen)."""
    d = summary_dict(summary)
    figures = [gpu_figure(summary, i) for i in range(len(summary.gpus))]
    figures.append(scrape_figure(summary))
    processes = processes_html(summary.recording, phase_shapes(summary))
    body = (summary_html(d) + phases_html(d) + "".join(figure_html(figures))
            + phase_details_html(d) + consumers_html(d["consumers"]) + processes
            + fields_html(d))  # fmt: skip
    return page(f"hfsampler report: {summary.recording.path.name}", body)


class ReportInputError(HfsamplerError, ValueError):
    """A report's input is missing, not a recording, or there are too many (exit 2)."""


def open_recording(path: str) -> Recording:
    """A recording to report on, or a ``ReportInputError`` that says what is wrong with it."""
    if not Path(path).is_file():
        raise ReportInputError(f"{path}: no such recording (give the .hfs file that "
                               "`hfsampler record -o` wrote)")  # fmt: skip
    try:
        return Recording(path)
    except RecordingError as exc:
        raise ReportInputError(f"{exc} (give a .hfs file that `hfsampler record` wrote)") from None
    except OSError as exc:
        raise ReportInputError(f"{path}: cannot read it: {exc.strerror or exc}") from None

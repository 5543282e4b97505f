"""`hfsampler report`: a recording as one self-contained HTML page of plots, or its summary as JSON.

The page embeds plotly.js once (no network needed to view it) and draws, per GPU: power (the raw
samples as a min/max envelope per time bucket, the window min-max band and the window mean),
utilization, memory used, temperature, SM clock, and throttle reasons as a timeline; then what a
15 s scrape of the 1 s-averaged power would have shown beside the truth; last, each field's
observed refresh period. Plots use SVG traces, not WebGL, so the page renders anywhere, headless
browsers included; the envelope keeps every peak while bounding the points per trace.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hfsampler.errors import HfsamplerError
from hfsampler.fields import FB_USED, GPU_TEMP, GPU_UTIL, POWER, SM_CLOCK
from hfsampler.recording import Recording
from hfsampler.report_processes import processes_html, processes_json
from hfsampler.summary import REASONS, Summary, summarize
from hfsampler.window import MAX, MEAN, MIN

PANELS = (
    (GPU_UTIL, MEAN, "Utilization (%)"),
    (FB_USED, MAX, "Memory used (MiB)"),
    (GPU_TEMP, MEAN, "Temperature (C)"),
    (SM_CLOCK, MIN, "SM clock (MHz)"),
)


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go  # type: ignore[import-untyped]
        from plotly.subplots import make_subplots  # type: ignore[import-untyped]
    except ImportError:
        raise HfsamplerError("the report needs plotly: pip install 'hfsampler[report]'") from None
    return go, make_subplots


def gpu_figure(rec: Recording, summary: Summary, i: int) -> Any:
    """One GPU's figure: power, the other panels, and the throttle timeline, sharing the x axis."""
    go, make_subplots = _plotly()
    g = summary.gpus[i]
    titles = ["Power (W)", *(p[2] for p in PANELS), "Throttle reasons"]
    fig = make_subplots(rows=len(titles), cols=1, shared_xaxes=True, vertical_spacing=0.03,
                        subplot_titles=titles, row_heights=[3, 1, 1, 1, 1, 1])  # fmt: skip
    start = summary.start_ns
    # the power role's first field with windows for this GPU (not only the first recorded)
    for name in POWER.names:
        where = rec.locate(name)
        if where is None:
            continue
        w = rec.windows(where[0])
        if not len(w.t1_ns) or not np.isfinite(w[MAX][:, g.row, where[1]]).any():
            continue
        t = (w.t0_ns - start) / 1e9  # a window's value holds over [t0, t1)
        lo, hi, mean = (w[s][:, g.row, where[1]] for s in (MIN, MAX, MEAN))
        fig.add_trace(go.Scatter(x=t, y=hi, mode="lines", line={"width": 0}, showlegend=False,
                                 hoverinfo="skip", line_shape="hv"), row=1, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=t, y=lo, mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor="rgba(99,110,250,0.25)", line_shape="hv",
                                 name="window min-max"), row=1, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=t, y=mean, mode="lines", line_shape="hv",
                                 line={"color": "rgb(99,110,250)"}, name="window mean"),
                      row=1, col=1)  # fmt: skip
        break
    if g.envelope is not None:
        tx, ty = g.envelope.points()
        fig.add_trace(go.Scatter(x=tx, y=ty, mode="lines", line={"width": 1, "color": "#d62728"},
                                 name=f"raw samples ({g.power_field})"), row=1, col=1)  # fmt: skip
    if np.isfinite(g.power_limit_w):
        fig.add_hline(y=g.power_limit_w, line_dash="dash", line_color="black", row=1, col=1,
                      annotation_text="power limit")  # fmt: skip
    for row, (role, stat, label) in enumerate(PANELS, start=2):
        where = rec.locate_role(role)
        if where is None:
            continue
        w = rec.windows(where[0])
        y = w[stat][:, g.row, where[1]]
        fig.add_trace(go.Scatter(x=(w.t0_ns - start) / 1e9, y=y, mode="lines", line_shape="hv",
                                 name=f"{label.split(' (')[0]} (window {stat.name})"),
                      row=row, col=1)  # fmt: skip
    names = sorted(g.throttle_spans)
    for k, reason in enumerate(names):
        xs: list[float | None] = []
        for s, e in g.throttle_spans[reason]:
            xs += [s, e, None]
        fig.add_trace(go.Scatter(x=xs, y=[reason if x is not None else None for x in xs],
                                 mode="lines", line={"width": 10}, name=reason,
                                 connectgaps=False), row=len(titles), col=1)  # fmt: skip
        del k
    if not names:
        fig.add_annotation(text="no throttling recorded", showarrow=False, row=len(titles), col=1,
                           x=summary.duration_s / 2, y=0)  # fmt: skip
    fig.update_xaxes(title_text="seconds since start", row=len(titles), col=1)
    fig.update_layout(height=1100, title=f"GPU {g.index}: {g.model} ({g.uuid})",
                      template="plotly_white",
                      margin={"t": 80, "l": 60, "r": 20, "b": 40})  # fmt: skip
    return fig


def scrape_figure(rec: Recording, summary: Summary) -> Any:
    """What a 15 s scrape of the 1 s-averaged power reported, beside the millisecond truth."""
    go, make_subplots = _plotly()
    n = len(summary.gpus)
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[f"GPU {g.index}" for g in summary.gpus])  # fmt: skip
    for row, g in enumerate(summary.gpus, start=1):
        if g.envelope is not None:
            tx, ty = g.envelope.points()
            fig.add_trace(go.Scatter(x=tx, y=ty, mode="lines",
                                     line={"width": 1, "color": "#d62728"},
                                     name="truth: raw samples", showlegend=row == 1),
                          row=row, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=g.scrape_t_s, y=g.scrape_w, mode="lines+markers",
                                 line_shape="hv", line={"color": "black", "width": 2},
                                 name="15 s scrape of the 1 s average", showlegend=row == 1),
                      row=row, col=1)  # fmt: skip
    fig.update_xaxes(title_text="seconds since start", row=n, col=1)
    fig.update_layout(height=260 * n + 120, template="plotly_white",
                      title="What a 15 s scrape of dcgm-exporter's power "
                            "would have shown")  # fmt: skip
    return fig


def _table(rows: list[tuple[str, list[str]]], head: list[str]) -> str:
    out = ["<table><tr>", *(f"<th>{html.escape(h)}</th>" for h in head), "</tr>"]
    for name, cells in rows:
        out.append(f"<tr><th>{html.escape(name)}</th>")
        out.extend(f"<td>{html.escape(c)}</td>" for c in cells)
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _f(value: Any, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def summary_html(summary: Summary) -> str:
    d = summary.as_dict()
    gpus = d["gpus"]
    reasons = sorted({r for g in gpus for r in g["throttled_s"]}, key=list(REASONS.values()).index)
    rows: list[tuple[str, list[str]]] = [
        ("used by the job", ["-" if g["used_by_job"] is None else str(g["used_by_job"])
                             for g in gpus]),
        ("energy", [f"{_f(g['energy_j'], ' J', 0)} ({_f(g['energy_wh'], ' Wh', 3)})"
                    for g in gpus]),
        ("energy, integrated", [_f(g["energy_integrated_j"], " J", 0) for g in gpus]),
        ("mean power", [_f(g["mean_power_w"], " W") for g in gpus]),
        ("peak power", [f"{_f(g['peak_power_w'], ' W')} at {_f(g['peak_power_at_s'], ' s', 3)}"
                        for g in gpus]),
        ("p99 power", [_f(g["p99_power_w"], " W") for g in gpus]),
        ("time above power limit", [f"{_f(g['time_above_power_limit_s'], ' s', 3)} "
                                    f"(limit {_f(g['power_limit_w'], ' W', 0)})" for g in gpus]),
        ("memory high-water mark", [_f(g["memory_high_water_mib"], " MiB", 0) for g in gpus]),
        *((f"throttled: {r}", [_f(g["throttled_s"].get(r, 0.0), " s", 3) for g in gpus])
          for r in reasons),
        ("15 s scrape: peak", [_f(g["scrape_15s"]["peak_w"], " W") for g in gpus]),
        ("15 s scrape: energy", [_f(g["scrape_15s"]["energy_j"], " J", 0) for g in gpus]),
    ]  # fmt: skip
    table = _table(rows, ["", *(f"GPU {g['gpu']}" for g in gpus)])
    job = {**d["labels"], **d["job"]}
    facts = [
        ("command", d["command"] or "(none: --duration)"),
        ("host", d["host"]),
        ("duration", f"{d['duration_s']:.3f} s"),
        ("exit code", str(d["exit_code"])),
        ("driver", d["driver_version"]),
        ("labels", ", ".join(f"{k}={v}" for k, v in job.items()) or "-"),
        ("file", "complete" if d["complete"] else "INCOMPLETE (the recorder did not finish)"),
    ]
    ctx = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                  for k, v in facts)  # fmt: skip
    return f"<table>{ctx}</table><h2>Summary</h2>{table}"


def fields_html(summary: Summary) -> str:
    """Every recorded field's observed refresh period: a reference, one row a field."""
    rows = [(k, [f"{v * 1e3:g} ms"]) for k, v in summary.as_dict()["field_refresh_s"].items()]
    return "<h2>Fields</h2>" + _table(rows, ["field", "observed refresh period"])


STYLE = """body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;
margin:8px 0 16px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{text-align:left;
background:#f5f5f5}"""


def render_html(rec: Recording, summary: Summary) -> str:
    """The whole page: context, summary table, one figure per GPU, the scrape comparison, then
    the fields' refresh periods (after the plots: some 40 rows, the activity fields among them,
    would push the first figure off the first screen)."""
    figures = [gpu_figure(rec, summary, i) for i in range(len(summary.gpus))]
    figures.append(scrape_figure(rec, summary))
    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(k == 0), config={"responsive": True})
        for k, fig in enumerate(figures)
    ]
    title = html.escape(f"hfsampler report: {rec.path.name}")
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{STYLE}</style></head><body><h1>{title}</h1>{summary_html(summary)}"
        + "".join(parts)
        + processes_html(rec)
        + fields_html(summary)
        + "</body></html>"
    )


def register(sub: Any) -> dict[str, Any]:
    p = sub.add_parser("report", help="turn a recording into an HTML page or a JSON summary")
    p.add_argument("recording", metavar="RUN.hfs")
    p.add_argument("-o", "--output", metavar="FILE", help="default: RUN.html (json: stdout)")
    p.add_argument("--format", choices=("html", "json"), default="html")
    return {"report": cmd_report}


def cmd_report(args: argparse.Namespace) -> int:
    rec = Recording(args.recording)
    summary = summarize(rec)
    if args.format == "json":
        text = json.dumps({**summary.as_dict(), "processes": processes_json(rec)}, indent=2)
        if args.output:
            Path(args.output).write_text(text + "\n")
        else:
            print(text)
        return 0
    out = Path(args.output) if args.output else Path(args.recording).with_suffix(".html")
    out.write_text(render_html(rec, summary), encoding="utf-8")
    if rec.torn or not rec.complete:
        print(f"hfsampler: note: {args.recording} is incomplete (the recorder did not finish); "
              "the report covers what was written", file=sys.stderr)  # fmt: skip
    print(f"wrote {out}", file=sys.stderr)
    return 0

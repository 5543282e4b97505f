"""The HTML both pages share (the report and the comparison): tables, numbers, figures, the page.

Plotly is imported only when a figure is made, so JSON output never needs the report extra.
"""

from __future__ import annotations

import html
from typing import Any

from hfsampler.errors import HfsamplerError
from hfsampler.fields import CLOCK_EVENT_REASONS


def plotly_modules() -> Any:
    try:
        import plotly.graph_objects as go  # type: ignore[import-untyped]
        from plotly.subplots import make_subplots  # type: ignore[import-untyped]
    except ImportError:
        raise HfsamplerError(
            "the report needs plotly: pip install 'hfsampler[report]' (from a checkout: "
            "pip install '.[report]')"
        ) from None
    return go, make_subplots


def html_table(rows: list[tuple[str, list[str]]], head: list[str],
               depths: list[int] | None = None) -> str:  # fmt: skip
    """A table with a header row; ``depths`` indents each row's name (a nested phase) with CSS
    padding, which HTML keeps where it collapses leading spaces."""
    out = ["<table><tr>", *(f"<th>{html.escape(h)}</th>" for h in head), "</tr>"]
    for k, (name, cells) in enumerate(rows):
        depth = depths[k] if depths else 0
        indent = f" style='padding-left:{0.5 + 1.5 * depth:g}em'" if depth else ""
        out.append(f"<tr><th{indent}>{html.escape(name)}</th>")
        out.extend(f"<td>{html.escape(c)}</td>" for c in cells)
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def summary_html(d: dict[str, Any]) -> str:
    """The context and the per-GPU summary table, from ``summary_dict``."""
    gpus = d["gpus"]
    order = list(CLOCK_EVENT_REASONS.values())
    reasons = sorted({r for g in gpus for r in g["throttled_s"]}, key=order.index)
    rows: list[tuple[str, list[str]]] = [
        ("used by the job", [{None: "-", True: "yes", False: "no"}[g["used_by_job"]]
                             for g in gpus]),
        ("energy", [f"{fmt(g['energy_j'], ' J', 0)} ({fmt(g['energy_wh'], ' Wh', 3)})"
                    for g in gpus]),
        ("energy, integrated", [fmt(g["energy_integrated_j"], " J", 0) for g in gpus]),
        ("mean power", [fmt(g["mean_power_w"], " W") for g in gpus]),
        ("peak power", [f"{fmt(g['peak_power_w'], ' W')} at {fmt(g['peak_power_at_s'], ' s', 3)}"
                        for g in gpus]),
        ("p99 power", [fmt(g["p99_power_w"], " W") for g in gpus]),
        ("time above power limit", [f"{fmt(g['time_above_power_limit_s'], ' s', 3)} "
                                    f"(limit {fmt(g['power_limit_w'], ' W', 0)})" for g in gpus]),
        ("memory high-water mark", [fmt(g["memory_high_water_mib"], " MiB", 0) for g in gpus]),
        *((f"throttled: {r}", [fmt(g["throttled_s"].get(r, 0.0), " s", 3) for g in gpus])
          for r in reasons),
        ("15 s scrape: peak", [fmt(g["scrape_15s"]["peak_w"], " W") for g in gpus]),
        ("15 s scrape: energy", [fmt(g["scrape_15s"]["energy_j"], " J", 0) for g in gpus]),
    ]  # fmt: skip
    table = html_table(rows, ["", *(f"GPU {g['gpu']}" for g in gpus)])
    job = {**d["labels"], **d["job"]}
    facts = [
        ("command", d["command"] or "(none: --duration)"),
        ("host", d["host"]),
        ("duration", f"{d['duration_s']:.3f} s"),
        ("exit code", str(d["exit_code"])),
        ("driver", d["driver_version"]),
        ("labels", ", ".join(f"{k}={v}" for k, v in job.items()) or "-"),
        ("file", "complete" if d["file_problem"] is None else _shout(d["file_problem"])),
    ]
    if d["clock_steps_back"]:
        back = f"steps: {d['clock_steps_back']}, {d['clock_stepped_back_s']:.3f} s in all"
        facts.append(
            ("clock", f"the wall clock stepped back ({back}): those intervals count as 0 s")
        )
    ctx = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                  for k, v in facts)  # fmt: skip
    return f"<table>{ctx}</table><h2>Summary</h2>{table}"


def _shout(problem: str) -> str:
    """A file's problem line with its verdicts in capitals, to be seen on the page."""
    return problem.replace("damaged:", "DAMAGED:").replace("incomplete:", "INCOMPLETE:")


STYLE = """body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;
margin:8px 0 16px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{text-align:left;
background:#f5f5f5}"""


def figure_html(figures: list[Any]) -> list[str]:
    """Figures as page fragments, plotly.js embedded once, with the first."""
    return [fig.to_html(full_html=False, include_plotlyjs=(k == 0), config={"responsive": True})
            for k, fig in enumerate(figures)]  # fmt: skip


def page(title: str, body: str) -> str:
    title = html.escape(title)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<style>{STYLE}</style></head><body><h1>{title}</h1>{body}</body></html>")  # fmt: skip

"""`hfsampler report BASE.hfs NEW.hfs`: two runs side by side, with what changed.

Both runs are summarised as a single report would (``summarize``); GPUs pair by position (the
first recorded GPU of each, then the second, ...), phases by label (name and occurrence), step
series by name, consumers by identity (their labels: ``hpc_job=4242``, a pod's uid and container
id, a unit, a user's command), all GPUs together. Each compared number carries base, new, the
difference and the relative change.
Power is overlaid per GPU on one time axis: seconds since each job's own start.
"""

from __future__ import annotations

import html
from typing import Any

from hfsampler.profiling import pages
from hfsampler.profiling.summary import Summary
from hfsampler.profiling.tables import summary_dict

# (label, key in a GPU's summary, unit, digits): what the per-GPU comparison shows
GPU_MEASURES = (
    ("energy, integrated", "energy_integrated_j", " J", 0),
    ("mean power", "mean_power_w", " W", 1),
    ("peak power", "peak_power_w", " W", 1),
    ("p99 power", "p99_power_w", " W", 1),
    ("time above power limit", "time_above_power_limit_s", " s", 3),
    ("throttled, all reasons", "throttled_total_s", " s", 3),
    ("memory high-water mark", "memory_high_water_mib", " MiB", 0),
    ("mean SM activity", "mean_sm_active", "", 3),
    ("mean tensor activity", "mean_tensor_active", "", 3),
)
JOB_MEASURES = (
    ("duration", "duration_s", " s", 3),
    ("energy, integrated, all GPUs", "energy_integrated_j", " J", 0),
    ("peak power, any GPU", "peak_power_w", " W", 1),
    ("time above power limit, all GPUs", "time_above_power_limit_s", " s", 3),
    ("throttled, all GPUs and reasons", "throttled_total_s", " s", 3),
)
PHASE_MEASURES = (
    ("duration", "duration_s", " s", 3),
    ("energy, all GPUs", "energy_j", " J", 1),
    ("peak power, any GPU", "peak_power_w", " W", 1),
    ("throttled, all GPUs and reasons", "throttled_total_s", " s", 3),
)
CONSUMER_MEASURES = (
    ("energy", "energy_j", " J", 1),
    ("peak power (window mean)", "peak_power_w", " W", 1),
)
STEP_MEASURES = (
    ("steps", "steps", "", 0),
    ("energy per step (mean)", "energy_mean_j", " J", 2),
    ("energy per step (std)", "energy_std_j", " J", 2),
    ("step duration (mean)", "duration_mean_s", " s", 4),
)


def delta(base: float | None, new: float | None) -> dict[str, float | None]:
    """Base, new, their difference and the relative change (None where either is missing)."""
    diff = None if base is None or new is None else round(new - base, 6)
    change = None if diff is None or not base else round(diff / base, 6)
    return {"base": base, "new": new, "delta": diff, "change": change}


def _gpu_values(g: dict[str, Any]) -> dict[str, Any]:
    return {**g, "throttled_total_s": round(sum(g["throttled_s"].values()), 6)}


def _job_values(d: dict[str, Any]) -> dict[str, Any]:
    """The whole job: sums over its GPUs (the largest for peak power)."""
    gpus = [_gpu_values(g) for g in d["gpus"]]

    def total(key: str) -> float | None:
        have = [g[key] for g in gpus if g[key] is not None]
        return round(sum(have), 6) if have else None

    peaks = [g["peak_power_w"] for g in gpus if g["peak_power_w"] is not None]
    return {"duration_s": d["duration_s"], "energy_integrated_j": total("energy_integrated_j"),
            "peak_power_w": max(peaks) if peaks else None,
            "time_above_power_limit_s": total("time_above_power_limit_s"),
            "throttled_total_s": total("throttled_total_s")}  # fmt: skip


def _phase_values(p: dict[str, Any]) -> dict[str, Any]:
    peaks = [g["peak_power_w"] for g in p["gpus"] if g["peak_power_w"] is not None]
    throttled = sum(sum(g["throttled_s"].values()) for g in p["gpus"])
    return {**p, "peak_power_w": max(peaks) if peaks else None,
            "throttled_total_s": round(throttled, 6)}  # fmt: skip


def _step_values(s: dict[str, Any]) -> dict[str, Any]:
    return {"steps": s["steps"], "energy_mean_j": s["energy_per_step_j"]["mean"],
            "energy_std_j": s["energy_per_step_j"]["std"],
            "duration_mean_s": s["duration_s"]["mean"]}  # fmt: skip


def _paired(
    base: list[dict[str, Any]], new: list[dict[str, Any]], key: str, measures: Any, values: Any
) -> list[dict[str, Any]]:
    """Entries of both runs matched on ``key`` (base's order, then new's unmatched)."""
    b = {e[key]: values(e) for e in base}
    n = {e[key]: values(e) for e in new}
    names = list(b) + [k for k in n if k not in b]
    return [{key: name, "in_base": name in b, "in_new": name in n,
             **{m[1]: delta(b.get(name, {}).get(m[1]), n.get(name, {}).get(m[1]))
                for m in measures}}
            for name in names]  # fmt: skip


def _consumers(d: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's consumers on all its GPUs together (none where it kept none)."""
    found = d["consumers"]
    return [] if found is None else list(found["consumers"])


def compare_dict(base: Summary, new: Summary) -> dict[str, Any]:
    """Both summaries whole, and the compared numbers (``delta``)."""
    b, n = summary_dict(base), summary_dict(new)
    gpus = [{"gpu_base": gb["gpu"], "gpu_new": gn["gpu"],
             **{m[1]: delta(_gpu_values(gb)[m[1]], _gpu_values(gn)[m[1]]) for m in GPU_MEASURES}}
            for gb, gn in zip(b["gpus"], n["gpus"], strict=False)]  # fmt: skip
    paired = min(len(b["gpus"]), len(n["gpus"]))
    return {
        "base": b,
        "new": n,
        # GPUs past the shorter run's count have nothing to pair with: said, not dropped silently
        "gpus_not_compared": {
            "base": [g["gpu"] for g in b["gpus"][paired:]],
            "new": [g["gpu"] for g in n["gpus"][paired:]],
        },
        # a damaged or incomplete input makes its numbers smaller than the run's: said up front
        "inputs_with_problems": {
            run: d["file_problem"] for run, d in (("base", b), ("new", n)) if d["file_problem"]
        },
        "delta": {
            "job": {m[1]: delta(_job_values(b)[m[1]], _job_values(n)[m[1]]) for m in JOB_MEASURES},
            "gpus": gpus,
            "phases": _paired(b["phases"], n["phases"], "label", PHASE_MEASURES, _phase_values),
            "steps": _paired(b["steps"], n["steps"], "name", STEP_MEASURES, _step_values),
            "consumers": _paired(_consumers(b), _consumers(n), "consumer", CONSUMER_MEASURES, dict),
        },
    }


def _rows(entries: list[tuple[str, dict[str, Any]]], measures: Any) -> list[tuple[str, list[str]]]:
    rows = []
    for prefix, entry in entries:
        for label, key, unit, digits in measures:
            d = entry[key]
            change = "-" if d["change"] is None else f"{d['change'] * 100:+.1f} %"
            sign = "" if d["delta"] is None or d["delta"] < 0 else "+"
            cells = [pages.fmt(d["base"], unit, digits), pages.fmt(d["new"], unit, digits),
                     sign + pages.fmt(d["delta"], unit, digits), change]  # fmt: skip
            rows.append((f"{prefix}{label}", cells))
    return rows


def power_overlay(base: Summary, new: Summary) -> Any:
    """Per GPU pair, both runs' raw power envelopes on one axis from each job's start."""
    go, make_subplots = pages.plotly_modules()
    pairs = list(zip(base.gpus, new.gpus, strict=False))
    fig = make_subplots(rows=max(1, len(pairs)), cols=1, shared_xaxes=True,
                        vertical_spacing=0.06,
                        subplot_titles=[f"GPU {gb.index} (base) / GPU {gn.index} (new)"
                                        for gb, gn in pairs])  # fmt: skip
    for row, (gb, gn) in enumerate(pairs, start=1):
        for g, name, colour in ((gb, "base", "rgba(31,119,180,0.8)"),
                                (gn, "new", "rgba(255,127,14,0.8)")):  # fmt: skip
            tx, ty = g.envelope.points()
            trace = go.Scatter(x=tx, y=ty, mode="lines", name=name, showlegend=row == 1,
                               line={"width": 1, "color": colour})  # fmt: skip
            fig.add_trace(trace, row=row, col=1)
    fig.update_xaxes(title_text="seconds since the job's start", row=max(1, len(pairs)), col=1)
    fig.update_layout(height=280 * max(1, len(pairs)) + 120, template="plotly_white",
                      title="Power, raw samples: base and new overlaid")  # fmt: skip
    return fig


def compare_html(base: Summary, new: Summary) -> str:
    """The comparison page: both contexts, the compared tables, then the power overlay."""
    d = compare_dict(base, new)
    delta_ = d["delta"]
    heads = ["", "base", "new", "difference", "change"]
    gpu_entries = [(f"GPU {g['gpu_base']}/{g['gpu_new']}: ", g) for g in delta_["gpus"]]
    body = [
        *(
            f"<p class='note'><b>The {run} recording is {html.escape(problem)}</b>: its numbers "
            "cover only what was readable</p>"
            for run, problem in d["inputs_with_problems"].items()
        ),
        "<h2>Compared</h2>",
        pages.html_table(_rows([("", delta_["job"])], JOB_MEASURES), heads),
        "<h3>Per GPU</h3>",
        pages.html_table(_rows(gpu_entries, GPU_MEASURES), heads),
    ]
    for run, unpaired in d["gpus_not_compared"].items():
        if unpaired:
            names = ", ".join(f"GPU {i}" for i in unpaired)
            body.append(f"<p class='note'>Not compared: {run}'s {names} (the other run has "
                        "fewer GPUs; GPUs pair by position)</p>")  # fmt: skip
    if delta_["phases"]:
        entries = [(f"{p['label']}: ", p) for p in delta_["phases"]]
        table = pages.html_table(_rows(entries, PHASE_MEASURES), heads)
        body += ["<h3 class='phase'>Phases</h3>", table]
    if delta_["steps"]:
        entries = [(f"{s['name']}: ", s) for s in delta_["steps"]]
        body += ["<h3>Steps</h3>", pages.html_table(_rows(entries, STEP_MEASURES), heads)]
    if delta_["consumers"]:
        entries = [(f"{c['consumer']}: ", c) for c in delta_["consumers"]]  # html_table escapes
        body += ["<h3>Consumers, all GPUs</h3>",
                 pages.html_table(_rows(entries, CONSUMER_MEASURES), heads)]  # fmt: skip
    body += pages.figure_html([power_overlay(base, new)])
    for name, s in (("Base", d["base"]), ("New", d["new"])):
        body.append(f"<h2>{name}: {html.escape(str(s['command']))}</h2>{pages.summary_html(s)}")
    title = f"hfsampler compare: {base.recording.path.name} vs {new.recording.path.name}"
    return pages.page(title, "".join(body))

"""The report's consumers: who used each GPU and the energy each drew (J and Wh), their peak power,
overall and per phase, with the energy no consumer drew, so consumers and unattributed add up to
the GPU's energy; as JSON data (``consumers_dict``, part of ``summary_dict``) and as the page's
tables (``consumers_html``). The numbers come from ``Summary.consumers`` (``consumer_energy``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hfsampler.consumers.identity import CONTAINER_ID_LABEL
from hfsampler.profiling.consumer_energy import ConsumerUse, consumer_key
from hfsampler.profiling.pages import fmt, html_table
from hfsampler.profiling.summary import Summary

NO_CONSUMERS = ("No consumers were recorded (a recording made before `record` kept them, a "
                "source without process lists, or no process on the GPUs).")  # fmt: skip


def _num(value: float, digits: int = 6) -> float | None:
    return round(float(value), digits) if math.isfinite(value) else None


def _entry(use: ConsumerUse, phase: int | None = None, per_gpu: bool = True) -> dict[str, Any]:
    energy = use.energy_j if phase is None else use.phase_energy_j[phase]
    peak = use.peak_power_w if phase is None else use.phase_peak_power_w[phase]
    out = {"consumer": consumer_key(use.consumer), "kind": use.consumer.kind.value,
           "labels": use.consumer.labels(), "energy_j": _num(energy),
           "energy_wh": _num(energy / 3600, 9), "peak_power_w": _num(peak, 3)}  # fmt: skip
    if per_gpu and phase is None:
        out["mean_sm_ratio"] = _num(use.mean_sm_ratio, 4)
        out["memory_high_water_bytes"] = _num(use.memory_high_water_bytes, 0)
    return out


def _entries(
    uses: Mapping[Any, ConsumerUse], phase: int | None = None, per_gpu: bool = True
) -> list[dict[str, Any]]:
    """Largest energy first."""
    found = [_entry(u, phase, per_gpu) for u in uses.values()
             if phase is None or u.phase_seen[phase]]  # fmt: skip
    return sorted(found, key=lambda e: (-(e["energy_j"] or 0.0), e["consumer"]))


def _gpu_part(index: int, energy_j: float, consumers: list[dict[str, Any]]) -> dict[str, Any]:
    drawn = math.fsum(c["energy_j"] or 0.0 for c in consumers)
    rest = energy_j - drawn
    return {"gpu": index, "energy_j": _num(energy_j), "consumers_energy_j": _num(drawn),
            "unattributed_j": _num(rest), "unattributed_wh": _num(rest / 3600, 9),
            "consumers": consumers}  # fmt: skip


def consumers_dict(summary: Summary) -> dict[str, Any] | None:
    """Per GPU and for all GPUs together, overall and per phase: each consumer's energy and
    peak power, and the GPU's energy no consumer drew. None where none was recorded."""
    found = summary.consumers
    if found is None:
        return None
    gpus = []
    for g, c in zip(summary.gpus, found.gpus, strict=False):
        gpus.append(_gpu_part(g.index, g.energy_integrated_j, _entries(c.consumers)))
    phases = []
    for k, p in enumerate(summary.timeline.phases):
        parts = []
        for g, c in zip(summary.gpus, found.gpus, strict=False):
            a, b = np.searchsorted(g.phase_edges_us, [p.start_ns // 1000, p.end_ns // 1000])
            energy = float(g.power_at.between(int(a), int(b))[0])
            parts.append(_gpu_part(g.index, energy, _entries(c.consumers, k)))
        phases.append({"label": p.label, "gpus": parts,
                       "consumers": _entries(found.totals, k, per_gpu=False)})  # fmt: skip
    return {
        "windows": found.windows,
        "gpus": gpus,
        "consumers": _entries(found.totals, per_gpu=False),
        "phases": phases,
    }


def _energy(entry: Mapping[str, Any]) -> str:
    return f"{fmt(entry['energy_j'], ' J', 1)} ({fmt(entry['energy_wh'], ' Wh', 4)})"


def _share(part: float | None, whole: float | None) -> str:
    if part is None or not whole:
        return "-"
    return f"{part / whole * 100:.1f} %"


def _gpu_rows(gpu: Mapping[str, Any], per_gpu: bool = True) -> list[tuple[str, list[str]]]:
    rows = []
    for c in gpu["consumers"]:
        cells = [_energy(c), _share(c["energy_j"], gpu["energy_j"]), fmt(c["peak_power_w"], " W")]
        if per_gpu:
            sm = c.get("mean_sm_ratio")
            memory = c.get("memory_high_water_bytes")
            cells += [fmt(None if sm is None else sm * 100, " %"),
                      fmt(None if memory is None else memory / 2**20, " MiB", 0)]  # fmt: skip
        rows.append((_display(c["labels"]), cells))  # html_table escapes it
    rest = [f"{fmt(gpu['unattributed_j'], ' J', 1)} ({fmt(gpu['unattributed_wh'], ' Wh', 4)})",
            _share(gpu["unattributed_j"], gpu["energy_j"]), "-"]  # fmt: skip
    if per_gpu:
        rest += ["-", "-"]
    rows.append(("unattributed (no process, or none using the SMs)", rest))
    return rows


HEAD = ["consumer", "energy", "share of the GPU's", "peak power (window mean)"]


def consumers_html(d: Mapping[str, Any] | None) -> str:
    """The page's section: per GPU a table of its consumers, then per phase."""
    out = ["<h2>Consumers</h2>"]
    if d is None:
        return out[0] + f"<p>{html.escape(NO_CONSUMERS)}</p>"
    out.append("<p>Each window's GPU energy split among the processes' consumers by their SM "
               "share; what no consumer drew is unattributed, so each table adds up to the "
               "GPU's energy.</p>")  # fmt: skip
    for gpu in d["gpus"]:
        whole = {"energy_j": gpu["energy_j"], "energy_wh": _wh(gpu["energy_j"])}
        title = f"GPU {gpu['gpu']}: {_energy(whole)}"
        out.append(f"<h3>{html.escape(title)}</h3>")
        out.append(html_table(_gpu_rows(gpu), [*HEAD, "mean SM share", "memory high-water"]))
    if len(d["gpus"]) > 1:
        rows = [(_display(c["labels"]), [_energy(c), fmt(c["peak_power_w"], " W")])
                for c in d["consumers"]]  # fmt: skip
        out.append("<h3>All GPUs</h3>")
        out.append(html_table(rows, ["consumer", "energy", "peak power (window mean, summed)"]))
    for phase in d["phases"]:
        out.append(f"<h3 class='phase'>Consumers in {html.escape(phase['label'])}</h3>")
        for gpu in phase["gpus"]:
            if gpu["consumers"]:
                out.append(f"<p>GPU {gpu['gpu']}</p>")
                out.append(html_table(_gpu_rows(gpu, per_gpu=False), HEAD))
        if not any(gpu["consumers"] for gpu in phase["gpus"]):
            out.append("<p>No consumer: all its energy is unattributed.</p>")
    return "".join(out)


def _display(labels: Mapping[str, str]) -> str:
    """A consumer's labels for the page: a container id cut to 12 characters, as ``docker ps``
    shows it (the JSON keeps it whole)."""
    return " ".join(f"{k}={v[:12] if k == CONTAINER_ID_LABEL else v}" for k, v in labels.items())


def _wh(joules: float | None) -> float | None:
    return None if joules is None else joules / 3600

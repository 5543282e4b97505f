"""Prometheus text exposition (format 0.0.4) of the latest snapshot, as dcgm-exporter serves it."""

from __future__ import annotations

import math
from collections import defaultdict

from hfsampler.series import Series, Snapshot, is_stale

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Labels pushes carry because no scrape adds them; a scrape of /metrics adds its own (and a
# second one would come back as exported_instance), so /metrics leaves them off.
SCRAPE_ADDED_LABELS = frozenset({"instance"})


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _series_text(s: Series) -> str:
    labels = [(k, v) for k, v in s.labels if k not in SCRAPE_ADDED_LABELS]
    if not labels:
        return s.name
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
    return f"{s.name}{{{inner}}}"


def render(snapshot: Snapshot | None) -> str:
    """The snapshot's series grouped by family with HELP and TYPE; stale markers left out, and
    the labels a scrape adds itself (``instance``)."""
    if snapshot is None:
        return ""
    by_name: dict[str, list[tuple[Series, float]]] = defaultdict(list)
    for s, v in snapshot.items():
        if not is_stale(v):
            by_name[s.name].append((s, v))
    lines: list[str] = []
    for name in sorted(by_name):
        family = snapshot.families.get(name)
        if family is not None:
            lines.append(f"# HELP {name} {_escape_help(family.help)}")
            lines.append(f"# TYPE {name} {family.type}")
        for s, v in by_name[name]:
            lines.append(f"{_series_text(s)} {format_value(v)}")
    return "\n".join(lines) + "\n" if lines else ""

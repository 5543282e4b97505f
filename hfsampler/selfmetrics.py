"""hfsampler's own health counters and gauges, shared by every stage that has something to count.

Stages increment ``SelfMetrics`` in place; each window the metric model turns the current values
into ``hfsampler_*`` series beside the GPU data, so they reach /metrics and every receiver alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str
    help: str
    type: str  # "counter" or "gauge"


class SelfMetrics:
    """A small registry of named counters and gauges keyed by sorted label tuples."""

    def __init__(self) -> None:
        self._defs: dict[str, MetricDef] = {}
        self._values: dict[str, dict[LabelKey, float]] = {}

    def define(self, name: str, help_text: str, type_: str) -> None:
        if type_ not in ("counter", "gauge"):
            raise ValueError(f"unknown metric type {type_!r}")
        if type_ == "counter" and not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        self._defs.setdefault(name, MetricDef(name, help_text, type_))
        self._values.setdefault(name, {})

    def inc(self, name: str, amount: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        self._check(name, "counter")
        series = self._values[name]
        key = _key(labels)
        series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        self._check(name, "gauge")
        self._values[name][_key(labels)] = value

    def get(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        return self._values.get(name, {}).get(_key(labels), 0.0)

    def total(self, name: str) -> float:
        """Sum over every label set of ``name``."""
        return sum(self._values.get(name, {}).values())

    def definitions(self) -> Iterator[MetricDef]:
        return iter(self._defs.values())

    def samples(self) -> Iterator[tuple[MetricDef, LabelKey, float]]:
        for name, series in self._values.items():
            d = self._defs[name]
            for key, value in series.items():
                yield d, key, value

    def _check(self, name: str, type_: str) -> None:
        d = self._defs.get(name)
        if d is None:
            raise KeyError(f"self-metric {name} is not defined")
        if d.type != type_:
            raise TypeError(f"self-metric {name} is a {d.type}, not a {type_}")


def _key(labels: Mapping[str, str] | None) -> LabelKey:
    return tuple(sorted(labels.items())) if labels else ()

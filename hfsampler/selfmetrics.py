"""hfsampler's own health counters and gauges: each defined once here, counted by every stage.

Every self-metric is a ``MetricDef`` constant below; stages import the constant and increment
``SelfMetrics`` in place; each window the metric model turns the current values into
``hfsampler_*`` series beside the GPU data, so they reach /metrics and every receiver alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

LabelKey = tuple[tuple[str, str], ...]
# When this process started (near enough: when hfsampler was imported), for counters' start.
PROCESS_START_MS = time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str
    help: str
    type: str  # "counter" or "gauge"

    def __post_init__(self) -> None:
        if self.type not in ("counter", "gauge"):
            raise ValueError(f"unknown metric type {self.type!r}")
        if self.type == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name} must end in _total")


# -- the sampler and the windows (service.py) ---------------------------------------------------
TICKS = MetricDef("hfsampler_ticks_total", "Sampler ticks per group.", "counter")
LATE_TICKS = MetricDef(
    "hfsampler_late_ticks_total", "Ticks that started later than the threshold.", "counter"
)
MISSED_TICKS = MetricDef(
    "hfsampler_missed_ticks_total", "Ticks skipped because the loop fell behind.", "counter"
)
TICK_LATENESS_P99 = MetricDef(
    "hfsampler_tick_lateness_p99_seconds", "99th percentile tick lateness.", "gauge"
)
TICK_LATENESS_MAX = MetricDef(
    "hfsampler_tick_lateness_max_seconds", "Largest tick lateness in the window.", "gauge"
)
SAMPLES = MetricDef(
    "hfsampler_samples_total", "Field readings taken (GPUs x fields x ticks).", "counter"
)
DISTINCT_SAMPLES = MetricDef(
    "hfsampler_distinct_samples_total", "Readings with a new driver timestamp.", "counter"
)
RING_OVERWRITTEN = MetricDef(
    "hfsampler_ring_overwritten_rows_total", "Rows lost to a lagging reader.", "counter"
)
GROUP_STALLED = MetricDef(
    "hfsampler_group_stalled",
    "1 while a sampling group has not ticked for 20 of its intervals (3 s at least): a read "
    "stuck in the driver, or the sampler process stopped.",
    "gauge",
)
GPU_UP = MetricDef("hfsampler_gpu_up", "1 while the GPU answers, 0 once it is lost.", "gauge")
WINDOWS = MetricDef("hfsampler_windows_total", "Windows reduced and exported.", "counter")

CONFIG_RELOAD_OK = MetricDef(
    "hfsampler_config_last_reload_successful",
    "1 if the last configuration reload (SIGHUP) was applied, 0 if it was refused.",
    "gauge",
)
CONFIG_RELOAD_TIME = MetricDef(
    "hfsampler_config_last_reload_success_timestamp_seconds",
    "When the configuration was last reloaded successfully.",
    "gauge",
)
CONSUMER_PROCFS_FAULTS = MetricDef(
    "hfsampler_consumer_procfs_faults_total",
    "Faults reading a GPU process's consumer from the host's procfs, by kind (procfs, "
    "namespace, hidden, gone, reused, unreadable, odd): each degrades that process's consumer.",
    "counter",
)

# -- Remote-Write, per endpoint (remote_write/) -------------------------------------------------
RW_SAMPLES = MetricDef(
    "hfsampler_remote_write_samples_total", "Samples accepted by the receiver.", "counter"
)
RW_BYTES = MetricDef(
    "hfsampler_remote_write_bytes_total",
    "Uncompressed protobuf bytes accepted by the receiver.",
    "counter",
)
RW_COMPRESSED_BYTES = MetricDef(
    "hfsampler_remote_write_compressed_bytes_total",
    "Snappy-compressed bytes accepted by the receiver.",
    "counter",
)
RW_REQUESTS = MetricDef(
    "hfsampler_remote_write_requests_total", "Requests by HTTP status, or error/timeout.", "counter"
)
RW_RETRIES = MetricDef(
    "hfsampler_remote_write_retries_total",
    "Requests retried after a recoverable failure.",
    "counter",
)
RW_DROPPED = MetricDef(
    "hfsampler_remote_write_samples_dropped_total", "Samples never delivered, by reason.", "counter"
)
RW_SEND_DURATION = MetricDef(
    "hfsampler_remote_write_send_duration_seconds", "Latency of the last request.", "gauge"
)
RW_QUEUE_SAMPLES = MetricDef(
    "hfsampler_remote_write_queue_samples", "Samples waiting in the queue.", "gauge"
)
RW_QUEUE_DISK_BYTES = MetricDef(
    "hfsampler_remote_write_queue_disk_bytes",
    "Bytes of the persistent queue's segment files.",
    "gauge",
)

RW_PROTOCOL_FALLBACKS = MetricDef(
    "hfsampler_remote_write_protocol_fallbacks_total",
    "Times a receiver refused Remote-Write 2.0 and the endpoint went back to 1.0.",
    "counter",
)
RW_PARTIAL_WRITES = MetricDef(
    "hfsampler_remote_write_partial_writes_total",
    "Refused requests of which the receiver said it wrote some samples (2.0).",
    "counter",
)

ALL: tuple[MetricDef, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, MetricDef))

Metric = MetricDef | str  # a constant above, or the name of one defined with ``define``


class SelfMetrics:
    """A small registry of named counters and gauges keyed by sorted label tuples.

    Every constant of this module is defined from the start (so Remote-Write metadata names
    each family from the first request); ``define`` adds others (tests, one-off tools).
    """

    def __init__(self) -> None:
        self._defs: dict[str, MetricDef] = {}
        self._values: dict[str, dict[LabelKey, float]] = {}
        for d in ALL:
            self._add(d)

    def define(self, name: str, help_text: str, type_: str) -> None:
        self._add(MetricDef(name, help_text, type_))

    def _add(self, d: MetricDef) -> None:
        self._defs.setdefault(d.name, d)
        self._values.setdefault(d.name, {})

    def inc(
        self, metric: Metric, amount: float = 1.0, labels: Mapping[str, str] | None = None
    ) -> None:
        name = self._check(metric, "counter")
        series = self._values[name]
        key = _key(labels)
        series[key] = series.get(key, 0.0) + amount

    def set(self, metric: Metric, value: float, labels: Mapping[str, str] | None = None) -> None:
        self._values[self._check(metric, "gauge")][_key(labels)] = value

    def get(self, metric: Metric, labels: Mapping[str, str] | None = None) -> float:
        return self._values.get(_name(metric), {}).get(_key(labels), 0.0)

    def total(self, metric: Metric) -> float:
        """Sum over every label set of ``metric``."""
        return sum(self._values.get(_name(metric), {}).values())

    def definitions(self) -> Iterator[MetricDef]:
        return iter(self._defs.values())

    def samples(self) -> Iterator[tuple[MetricDef, LabelKey, float]]:
        for name, series in self._values.items():
            d = self._defs[name]
            for key, value in series.items():
                yield d, key, value

    def _check(self, metric: Metric, type_: str) -> str:
        name = _name(metric)
        d = self._defs.get(name)
        if d is None:
            raise KeyError(f"self-metric {name} is not defined")
        if d.type != type_:
            raise TypeError(f"self-metric {name} is a {d.type}, not a {type_}")
        return name


def _name(metric: Metric) -> str:
    return metric if isinstance(metric, str) else metric.name


def _key(labels: Mapping[str, str] | None) -> LabelKey:
    return tuple(sorted(labels.items())) if labels else ()

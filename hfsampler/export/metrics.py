"""The metric model: window statistics and self-metrics become one ``Snapshot`` of named series.

GPU series take dcgm-exporter's names and labels, one series per statistic of
``sampling.window.STATS`` that the field's kind exports (a gauge's mean keeps the name, the others
are siblings such as ``_max``), plus a field's own labels where it has several instances
(``rail``, ``zone``); counters, states and bitmasks export one value. Counters and
states carry their last value into windows without a fresh sample; a gauge without samples for
``stale_after_windows`` windows, every series of a GPU that went down, and everything at shutdown
gets Prometheus's stale marker once.

A MIG instance's series are its slot row's (``DeviceInfo.mig``): dcgm-exporter's labels plus
``GPU_I_ID``, ``GPU_I_PROFILE`` and ``MIG_UUID``, with the parent GPU's ``UUID``. A slot carries
the per-instance fields (``Field.mig_instance``); GPU-level fields stay on the GPU's own row,
once, unless ``copy_device_fields`` copies them onto every instance as dcgm-exporter does. When
a slot's instance changes (``set_devices``), its old series end with stale markers and the new
instance's begin, as when a pod's labels change.

A field in ``histograms`` also has a native-histogram series per GPU and MIG instance,
``<field>_histogram``, with its float series' labels: each window's cumulative counts from the
sampling stage (``sampling.histogram_counts``). One exists once its GPU has had a sample of the
field, goes on while the GPU is up, and ends like a float with ``STALE_HISTOGRAM``. It is never
copied onto MIG instances: a sum over a GPU's instances would count its samples once per instance.
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from hfsampler.config.settings import Config
from hfsampler.export import xid_messages
from hfsampler.export.event_counts import LAST_XID, EventCounts
from hfsampler.fields import DEFAULT_INSTANCE_PORT, Field, Kind
from hfsampler.histograms import NativeHistogram
from hfsampler.sampling.histogram_counts import CountedHistogram
from hfsampler.sampling.window import STATS, Stat, WindowStats
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import (
    STALE_HISTOGRAM,
    STALE_NAN,
    Family,
    Series,
    SeriesRegistry,
    Snapshot,
    with_external_labels,
)
from hfsampler.sources.base import DeviceInfo

ObjArray = npt.NDArray[np.object_]

REFRESH_METRIC = "hfsampler_field_refresh_seconds"
REFRESH_HELP = (
    "Seconds between distinct samples of the field in the window (window length / distinct "
    "samples): the real resolution of its series."
)

SELF_PREFIX = "hfsampler_"  # hfsampler's own families, beside dcgm-exporter's DCGM_FI_*
HISTOGRAM_SUFFIX = "_histogram"  # a field's native histogram: a name of its own beside its floats
HISTOGRAM_HELP = "native histogram of every distinct sample"


def host_labels(
    hostname: str | None = None,
    host_label: str = "hostname",
    instance: str | None = None,
    instance_port: int = DEFAULT_INSTANCE_PORT,
) -> dict[str, str]:
    """The labels naming this host on every series: the host label and ``instance``.

    A scrape adds ``instance``, a push does not, and dcgm-exporter's dashboards and many alert
    rules select on it: by default it is ``<host>:<port>`` as a scrape would have made it.
    ``instance=""`` leaves it off.
    """
    host = hostname or socket.gethostname() or "localhost"
    labels = {host_label: host}
    if instance is None:
        instance = f"{host}:{instance_port}"
    if instance:
        labels["instance"] = instance
    return labels


def gpu_labels(device: DeviceInfo, host: Mapping[str, str]) -> dict[str, str]:
    """dcgm-exporter's per-GPU labels, with the host's (``host_labels``); a MIG instance's too."""
    labels = {
        "gpu": str(device.index),
        "UUID": device.uuid,
        "device": device.device,
        "modelName": device.model_name,
        **host,
        "pci_bus_id": device.pci_bus_id,
        "DCGM_FI_DRIVER_VERSION": device.driver_version,
    }
    m = device.mig
    if m is not None:
        labels.update(GPU_I_ID=str(m.gpu_instance_id), GPU_I_PROFILE=m.profile, MIG_UUID=m.uuid)
    return labels


def build_model(
    config: Config,
    devices: Sequence[DeviceInfo],
    groups: Mapping[str, Sequence[Field]],
    self_metrics: SelfMetrics,
    previous: MetricModel | None = None,
) -> MetricModel:
    """The model ``config`` asks for, of ``devices`` sampled in ``groups`` (group name: its
    fields): the service's, and check-config's count of a window's series."""
    return MetricModel(
        devices,
        groups,
        self_metrics,
        config.external_labels,
        hostname=config.hostname,
        stale_after_windows=config.stale_after_windows,
        host_label=config.host_label,
        instance=config.instance,
        instance_port=config.instance_port,
        copy_device_fields=config.mig_copy_device_fields,
        counted=config.counted_fields(),
        histograms=[f.name for f in config.histogram_fields()],
        xid_count_window_s=config.xid_count_window_s,
        clock_events_count_window_s=config.clock_events_count_window_s,
        previous=previous,
    )


@dataclass(slots=True)
class _GroupSeries:
    """A group's series per statistic, as ``[gpu, field]`` object arrays (None: not exported)."""

    fields: tuple[Field, ...]
    by_stat: list[tuple[Stat, ObjArray]]
    carried: npt.NDArray[np.bool_]  # [field]: counters, states, bitmasks carry forward
    held: npt.NDArray[np.float64]  # [stat, gpu, field]: last exported value of carried fields
    empty_windows: npt.NDArray[np.int64]  # [gpu, field]: consecutive windows without a sample
    seen: npt.NDArray[np.bool_]  # [gpu, field]: had a sample once (else nothing to mark stale)
    refresh: ObjArray  # [gpu, field]: hfsampler_field_refresh_seconds series
    copied: npt.NDArray[np.int64]  # columns copied from a GPU onto its MIG instances
    coded: npt.NDArray[np.int64]  # columns labelled with their value (the last XID's code)
    histograms: ObjArray  # [gpu, field]: the native-histogram series (None: not counted)

    def arrays(self) -> list[ObjArray]:
        """Every ``[gpu, field]`` array of series: what a GPU's new labels change."""
        return [a for _, a in self.by_stat] + [self.refresh, self.histograms]


class MetricModel:
    """Builds each window's snapshot; one per service, reused for every window."""

    def __init__(
        self,
        devices: Sequence[DeviceInfo],
        groups: Mapping[str, Sequence[Field]],
        self_metrics: SelfMetrics,
        external_labels: Mapping[str, str] | None = None,
        hostname: str | None = None,
        stale_after_windows: int = 5,
        *,
        host_label: str = "hostname",
        instance: str | None = None,
        instance_port: int = DEFAULT_INSTANCE_PORT,
        copy_device_fields: bool = False,
        counted: Sequence[Field] = (),
        histograms: Collection[str] = (),
        xid_count_window_s: float = 300.0,
        clock_events_count_window_s: float = 300.0,
        previous: MetricModel | None = None,
    ) -> None:
        """``counted``: the selected fields counted from the others' series over a trailing
        window (``export.event_counts``, dcgm-exporter's DCGM_EXP_*). ``histograms``: the
        names of the fields with a native-histogram series.

        ``previous``: the model this one replaces (a reload changed the labels). Its series
        that this one has too keep their identity (ids, so a writer's shard and caches); the
        others end with stale markers in this one's first snapshot, at that window's time."""
        self.devices = tuple(devices)
        self.copy_device_fields = copy_device_fields
        # per MIG slot row, the row of its GPU (whose fields a copy takes)
        first_row = {d.index: r for r, d in reversed(list(enumerate(self.devices))) if d.is_gpu}
        self._slots = np.array([r for r, d in enumerate(self.devices) if not d.is_gpu], np.int64)
        self._parents = np.array([first_row[self.devices[r].index] for r in self._slots], np.int64)
        twins = {f.name for fs in groups.values() for f in fs if f.mig_instance}
        self._twinned = twins  # names a MIG instance has its own series of: never copied
        self._extra: list[Mapping[str, str]] = [{} for _ in self.devices]
        self.host = host_labels(hostname, host_label, instance, instance_port)
        self.external = dict(external_labels or {})
        self.self_metrics = self_metrics
        self.registry: SeriesRegistry = (
            previous.registry if previous is not None else SeriesRegistry()
        )
        self.stale_after_windows = stale_after_windows
        self._groups: dict[str, _GroupSeries] = {}
        self._histogram_names = frozenset(histograms)
        self._live: dict[int, Series] = dict(previous._live) if previous is not None else {}
        self._live_histograms: dict[int, Series] = (
            dict(previous._live_histograms) if previous is not None else {}
        )
        self._base_labels = [
            with_external_labels(gpu_labels(d, self.host), self.external) for d in self.devices
        ]
        for name, fields in groups.items():
            self._groups[name] = self._build_group(tuple(fields))
        self.event_counts: EventCounts = EventCounts(
            counted,
            self.registry,
            xid_window_s=xid_count_window_s,
            clock_events_window_s=clock_events_count_window_s,
            previous=previous.event_counts if previous is not None else None,
        )
        for d in self_metrics.definitions():  # known before any window: senders read them
            self.registry.family(d.name, d.help, d.type)

    @property
    def families(self) -> Mapping[str, Family]:
        return self.registry.families

    def planned_series(self) -> int:
        """The series a window has at most by the plan: every statistic and refresh series of
        each planned field on each GPU and MIG instance, one ``hfsampler_gpu_up`` per device
        and hfsampler's own series known now. What Remote-Write queues are sized from
        (``remote_write.sizing``): a field a GPU does not sample this window is counted, while
        event counts and self-metrics that appear later are not; the queue keeps its newest
        window whole whatever it holds."""
        n = len(self.devices) + sum(1 for _ in self.self_metrics.samples())
        for group in self._groups.values():
            for arr in group.arrays():  # a histogram is one sample too
                n += int(np.count_nonzero(arr != None))  # noqa: E711
        return n

    def set_extra_labels(self, extra: Sequence[Mapping[str, str]]) -> None:
        """Attribution labels per GPU (``export.attribution``), given before each snapshot.

        A GPU whose labels changed (a pod ended, another started) gets new series from here on;
        the old ones drop out of the next snapshot and get stale markers like any ended series.
        """
        for i, labels in enumerate(extra):
            self._extra[i] = labels
            self._relabel(i)

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        """The rows' devices now (the sampler's source found a new MIG layout).

        A slot whose instance changed gets the new instance's series from here on; the old
        ones drop out of the next snapshot and get stale markers.
        """
        for i, d in enumerate(devices):
            if d != self.devices[i]:
                self.devices = (*self.devices[:i], d, *self.devices[i + 1 :])
                self._relabel(i)

    def _relabel(self, i: int) -> None:
        base = gpu_labels(self.devices[i], self.host)
        # attribution's labels come beneath the external ones (a pod's never replaces the
        # configured cluster); the GPU's own labels win over both
        wanted = with_external_labels(base, {**self._extra[i], **self.external})
        previous = self._base_labels[i]
        if wanted == previous:
            return
        self._base_labels[i] = wanted
        for group in self._groups.values():
            for arr in group.arrays():
                for j in range(arr.shape[1]):
                    old = arr[i, j]
                    if old is not None:
                        # keep a series' own labels (e.g. `field`), swap the GPU's
                        own = {k: v for k, v in old.labels if k not in previous}
                        arr[i, j] = self.registry.series(old.name, {**wanted, **own})

    def _has(self, row: int, f: Field) -> bool:
        """Whether row ``row`` can have series of ``f``: a GPU its fields, a MIG slot its own
        per-instance fields (and, copying, the GPU's fields an instance has no own series of)."""
        if self.devices[row].is_gpu:
            return not f.mig_instance
        if f.mig_instance:
            return True
        return self._copied(f) and f.name not in self._twinned

    def _copied(self, f: Field) -> bool:
        """Whether ``f`` is copied from a MIG GPU onto its instances (mig.copy_device_fields).

        dcgm-exporter's copying is of its fields: hfsampler's own per-GPU counters (XIDs by
        code) stay the GPU's, or one event would count once per instance.
        """
        return self.copy_device_fields and not f.mig_instance and not f.name.startswith(SELF_PREFIX)

    def _build_group(self, fields: tuple[Field, ...]) -> _GroupSeries:
        g = len(self.devices)
        own = [dict(f.labels) for f in fields]
        has = np.array([[self._has(i, f) for f in fields] for i in range(g)], dtype=np.bool_)
        has = has.reshape(g, len(fields))
        by_stat: list[tuple[Stat, ObjArray]] = []
        for stat in STATS:
            arr: ObjArray = np.empty((g, len(fields)), dtype=object)
            for j, f in enumerate(fields):
                if not stat.exports(f.kind):
                    continue
                name = f.name + stat.suffix
                help_text = f"{f.help.rstrip('.')}; {stat.help[f.kind]}."
                self.registry.family(name, help_text, f.prometheus_type, f.unit)
                for i in np.flatnonzero(has[:, j]):
                    # a per-instance field (a rail, a zone) adds its own label to the GPU's
                    arr[i, j] = self.registry.series(name, {**self._base_labels[i], **own[j]})
            by_stat.append((stat, arr))
        refresh: ObjArray = np.empty((g, len(fields)), dtype=object)
        self.registry.family(REFRESH_METRIC, REFRESH_HELP, "gauge", "seconds")
        for j, f in enumerate(fields):
            for i in np.flatnonzero(has[:, j]):
                labels = {**self._base_labels[i], **own[j], "field": f.name}
                refresh[i, j] = self.registry.series(REFRESH_METRIC, labels)
        histograms: ObjArray = np.empty((g, len(fields)), dtype=object)
        for j, f in enumerate(fields):
            if f.name not in self._histogram_names or f.kind is not Kind.GAUGE:
                continue
            name = f.name + HISTOGRAM_SUFFIX
            self.registry.family(
                name, f"{f.help.rstrip('.')}; {HISTOGRAM_HELP}.", "histogram", f.unit
            )
            for i in np.flatnonzero(has[:, j]):
                if self.devices[i].is_gpu or f.mig_instance:  # never a copy (see the docstring)
                    histograms[i, j] = self.registry.series(
                        name, {**self._base_labels[i], **own[j]}
                    )
        carried = np.array([f.kind is not Kind.GAUGE for f in fields], dtype=np.bool_)
        return _GroupSeries(
            fields,
            by_stat,
            carried,
            np.full((len(by_stat), g, len(fields)), np.nan),
            np.zeros((g, len(fields)), dtype=np.int64),
            np.zeros((g, len(fields)), dtype=np.bool_),
            refresh,
            np.array(
                [j for j, f in enumerate(fields) if self._copied(f)] if self._slots.size else [],
                dtype=np.int64,
            ),
            np.array([j for j, f in enumerate(fields) if f.name == LAST_XID], dtype=np.int64),
            histograms,
        )

    def _label_codes(
        self,
        arr: ObjArray,
        cols: npt.NDArray[np.int64],
        data: npt.NDArray[np.float64],
        emit: npt.NDArray[np.bool_],
    ) -> None:
        """Each exported last-XID series labelled with its code, as dcgm-exporter's
        (``err_code``, ``err_msg``: ``export.xid_messages``). A new code is a new series; the
        previous one leaves the live set, so it ends with a stale marker like any other."""
        for j in cols.tolist():
            for i in np.flatnonzero(emit[:, j]).tolist():
                s: Series = arr[i, j]
                wanted = xid_messages.labels(int(data[i, j]))
                if all(label in s.labels for label in wanted):
                    continue
                own = {k: v for k, v in s.labels if k not in xid_messages.LABELS}
                arr[i, j] = self.registry.series(s.name, {**own, **dict(wanted)})

    def _copy_to_instances(self, group: _GroupSeries, stats: WindowStats) -> WindowStats:
        """``stats`` with each MIG slot's copied columns taken from its GPU's row."""
        if not group.copied.size:
            return stats
        to = np.ix_(self._slots, group.copied)
        at = np.ix_(self._parents, group.copied)
        values = {}
        for name, v in stats.values.items():
            v = v.copy()
            v[to] = v[at]
            values[name] = v
        count = stats.count.copy()
        count[to] = count[at]
        return replace(stats, values=values, count=count)

    def snapshot(
        self,
        windows: Mapping[str, WindowStats],
        gpu_up: npt.NDArray[np.bool_],
        t1_ns: int,
        histograms: Mapping[str, Sequence[CountedHistogram]] | None = None,
    ) -> Snapshot:
        """The snapshot for the window ending at ``t1_ns``; ``histograms``: per group, the
        window's cumulative native histograms (``Window``'s, by group name)."""
        series: list[Series] = []
        values: list[float] = []
        alive: dict[int, Series] = {}
        for name, stats in windows.items():
            group = self._groups[name]
            stats = self._copy_to_instances(group, stats)
            has = stats.count > 0
            group.empty_windows = np.where(has, 0, group.empty_windows + 1)
            group.seen |= has
            # a gauge stays live through a few windows without samples; carried fields while known;
            # one never sampled on a GPU (a link down there) is no series, not even a stale marker
            recent = (group.empty_windows < self.stale_after_windows) & group.seen
            for k, (stat, arr) in enumerate(group.by_stat):
                fresh = stats.values.get(stat.name)
                if fresh is None:  # a recording from before this statistic existed
                    continue
                held = group.held[k] = np.where(has & group.carried, fresh, group.held[k])
                data = np.where(group.carried, held, fresh)
                emit = np.where(group.carried, ~np.isnan(held), has)
                present = gpu_up[:, None] & (arr != None)  # noqa: E711
                emit = emit & present
                if group.coded.size:
                    self._label_codes(arr, group.coded, data, emit)
                live = emit | (present & ~group.carried & recent)
                for s in arr[live]:
                    alive[s.id] = s
                idx = np.nonzero(emit)
                series.extend(arr[idx])
                values.extend(data[idx].tolist())
            # the series' real resolution: the window over its distinct samples, so a dashboard
            # can tell a 1 ms field from one the driver refreshes every 100 ms
            idx = np.nonzero(has & gpu_up[:, None] & (group.refresh != None))  # noqa: E711
            window_s = (stats.t1_ns - stats.t0_ns) / 1e9
            for s, n in zip(group.refresh[idx], stats.count[idx].tolist(), strict=True):
                alive[s.id] = s
                series.append(s)
                values.append(window_s / n)
        if self.event_counts:
            for s, v in self.event_counts.add(zip(series, values, strict=True), t1_ns):
                alive[s.id] = s
                series.append(s)
                values.append(v)
        self._self_series(series, values, alive)
        ended = [s for sid, s in self._live.items() if sid not in alive]
        self.registry.forget(ended)
        series.extend(ended)
        values.extend([STALE_NAN] * len(ended))
        self._live = alive
        counted = self._histograms(histograms or {}, gpu_up)
        return Snapshot(
            t1_ns // 1_000_000, series, values, self.registry.families, histograms=counted
        )

    def _histograms(
        self, windows: Mapping[str, Sequence[CountedHistogram]], gpu_up: npt.NDArray[np.bool_]
    ) -> list[tuple[Series, NativeHistogram]]:
        """The histogram series of the GPUs up; those that went away end with stale markers."""
        out: list[tuple[Series, NativeHistogram]] = []
        alive: dict[int, Series] = {}
        for name, counted in windows.items():
            arr = self._groups[name].histograms
            for c in counted:
                s = arr[c.row, c.column]
                if s is not None and gpu_up[c.row]:
                    alive[s.id] = s
                    out.append((s, c.histogram))
        ended = [s for sid, s in self._live_histograms.items() if sid not in alive]
        self.registry.forget(ended)
        out.extend((s, STALE_HISTOGRAM) for s in ended)
        self._live_histograms = alive
        return out

    def final_snapshot(self, t_ns: int, *, end: bool = True) -> Snapshot:
        """Stale markers for every live series: the last thing sent at shutdown. ``end=False``
        for an endpoint a reload removes: the series go on for the others."""
        ended = list(self._live.values())
        histograms = [(s, STALE_HISTOGRAM) for s in self._live_histograms.values()]
        if end:
            self._live, self._live_histograms = {}, {}
        return Snapshot(t_ns // 1_000_000, ended, [STALE_NAN] * len(ended), self.registry.families,
                        histograms=histograms)  # fmt: skip

    def _self_series(
        self, series: list[Series], values: list[float], alive: dict[int, Series]
    ) -> None:
        for d in self.self_metrics.definitions():
            self.registry.family(d.name, d.help, d.type)
        for d, key, value in self.self_metrics.samples():
            labels = with_external_labels({**self.host, **dict(key)}, self.external)
            s = self.registry.series(d.name, labels)
            series.append(s)
            values.append(value)
            alive[s.id] = s

"""Per-consumer series of shared GPUs: each window's ``WindowSplit`` per GPU row becomes
``hfsampler_consumer_*`` series beside the GPU's own, and the energy no consumer drew a counter of
its own, so a plain ``sum`` of consumers and unattributed is the GPU's energy, never twice.

At most ``max_per_gpu`` consumers per row have series of their own: a consumer keeps its place
while it is present, a place freed by one that left goes to the next in the window's order, and
the rest are folded into ``consumer="other"`` (their SM ratios and memory summed, their energy
counted) and counted in ``hfsampler_gpu_consumers_folded``. A consumer that leaves, and a row that
goes (a GPU lost, a MIG instance destroyed), end their series with stale markers and are
forgotten by the registry, so churn cannot grow memory. Energy counters count from 0 when a
consumer first appears (a series that ends and comes back starts again, which Prometheus's
``increase`` reads as a reset).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hfsampler.consumers.identity import CONSUMER_LABEL, IDENTITY_LABELS, Consumer
from hfsampler.consumers.split import ConsumerShare, WindowSplit
from hfsampler.series import STALE_NAN, Series, SeriesRegistry, with_external_labels

SM_RATIO = "hfsampler_consumer_sm_utilization_ratio"
MEMORY_USED = "hfsampler_consumer_memory_used_bytes"
ENERGY = "hfsampler_consumer_energy_joules_total"
UNATTRIBUTED = "hfsampler_gpu_unattributed_energy_joules_total"
FOLDED = "hfsampler_gpu_consumers_folded"
FAMILIES = (
    (SM_RATIO, "A consumer's share of the GPU's SMs over the window (0-1), the mean of the "
     "driver's per-process samples summed over its processes.", "gauge"),
    (MEMORY_USED, "The most GPU memory a consumer's processes held together in the window, in "
     "bytes.", "gauge"),
    (ENERGY, "The GPU's energy split among its consumers by their SM share, window by window, in "
     "joules.", "counter"),
    (UNATTRIBUTED, "The GPU's energy no consumer drew (no process, or none using the SMs), in "
     "joules.", "counter"),
    (FOLDED, "Consumers of the GPU in the window beyond consumers.max_per_gpu, folded into "
     'consumer="other".', "gauge"),
)  # fmt: skip
OTHER = "other"
DEFAULT_MAX_PER_GPU = 16
# dcgm-exporter's --kubernetes-virtual-gpus: these two per pod sharing a GPU, with the pod's
# pod, namespace and container labels (percent, and MiB, as its device series have them)
VIRTUAL_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
VIRTUAL_FB_USED = "DCGM_FI_DEV_FB_USED"
VIRTUAL_LABELS = ("pod", "namespace", "container")
_MIB = float(1 << 20)

Names = Callable[[Consumer], Mapping[str, str]]  # a consumer's labels (CriNames.labels adds names)


@dataclass(slots=True)
class _Place:
    """One consumer's series on one row, and its energy so far."""

    sm: Series
    memory: Series
    energy: Series
    energy_j: float = 0.0
    memory_sent: bool = False  # a series never sent gets no stale marker either
    util: Series | None = None  # dcgm-exporter's per-pod series (virtual_gpus), where a pod
    fb: Series | None = None
    fb_sent: bool = False


@dataclass(slots=True)
class _Row:
    unattributed: Series
    folded: Series
    places: dict[Consumer | None, _Place] = field(default_factory=dict)  # None: "other"
    unattributed_j: float = 0.0


class ConsumerSeries:
    """The consumer series of every GPU row, window by window; see the module's docstring."""

    def __init__(
        self,
        registry: SeriesRegistry,
        external: Mapping[str, str] | None = None,
        max_per_gpu: int = DEFAULT_MAX_PER_GPU,
        *,
        virtual_gpus: bool = False,
    ) -> None:
        """``virtual_gpus``: also dcgm-exporter's ``DCGM_FI_DEV_GPU_UTIL`` and
        ``DCGM_FI_DEV_FB_USED`` per named pod (its ``--kubernetes-virtual-gpus``)."""
        if max_per_gpu < 1:
            raise ValueError(f"max_per_gpu must be at least 1, not {max_per_gpu}")
        self.registry = registry
        self.external = dict(external or {})
        self.max_per_gpu = max_per_gpu
        self.virtual_gpus = virtual_gpus
        self._rows: dict[tuple[tuple[str, str], ...], _Row] = {}
        self._carried: dict[int, float] = {}  # by Series.id: a predecessor's counters (reload)
        for name, help_text, type_ in FAMILIES:
            registry.family(name, help_text, type_)
        if virtual_gpus:  # the model's own, where the field is sampled: the first one stays
            registry.family(VIRTUAL_GPU_UTIL, "GPU utilization (in %).", "gauge")
            registry.family(VIRTUAL_FB_USED, "Framebuffer memory used (in MiB).", "gauge")

    def _series(self, name: str, labels: Mapping[str, str]) -> Series:
        return self.registry.series(name, with_external_labels(labels, self.external))

    def _place(self, row_labels: Mapping[str, str], consumer_labels: Mapping[str, str]) -> _Place:
        # The GPU's own labels are never replaced, nor the operator's external ones by a pod's
        # labels (a tenant's pod labelled cluster=... would bill another cluster).
        own = IDENTITY_LABELS.union(VIRTUAL_LABELS)
        kept = {k: v for k, v in consumer_labels.items() if k not in self.external or k in own}
        labels = {**kept, **row_labels}
        place = _Place(self._series(SM_RATIO, labels), self._series(MEMORY_USED, labels),
                       self._series(ENERGY, labels))  # fmt: skip
        place.energy_j = self._carried.pop(place.energy.id, 0.0)
        if self.virtual_gpus and consumer_labels.get(VIRTUAL_LABELS[0]):
            pod = {k: consumer_labels[k] for k in VIRTUAL_LABELS if consumer_labels.get(k)}
            place.util = self._series(VIRTUAL_GPU_UTIL, {**pod, **row_labels})
            place.fb = self._series(VIRTUAL_FB_USED, {**pod, **row_labels})
        return place

    def window(
        self, rows: Sequence[tuple[Mapping[str, str], WindowSplit]], names: Names
    ) -> tuple[list[Series], list[float]]:
        """The series and values of one window: per row its GPU labels (dcgm-exporter's, with
        ``GPU_I_ID`` on a MIG instance; not a whole-GPU holder's pod labels) and its split. A row
        left out, or a consumer absent from its row's split, ends with stale markers."""
        series: list[Series] = []
        values: list[float] = []
        seen: set[tuple[tuple[str, str], ...]] = set()
        for row_labels, result in rows:
            key = tuple(sorted(row_labels.items()))
            seen.add(key)
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _Row(self._series(UNATTRIBUTED, row_labels),
                                             self._series(FOLDED, row_labels))  # fmt: skip
                row.unattributed_j = self._carried.pop(row.unattributed.id, 0.0)
            self._row_window(row, row_labels, result, names, series, values)
        for key in [k for k in self._rows if k not in seen]:
            self._end(self._rows.pop(key), series, values)
        return series, values

    def _row_window(
        self,
        row: _Row,
        row_labels: Mapping[str, str],
        result: WindowSplit,
        names: Names,
        series: list[Series],
        values: list[float],
    ) -> None:
        present = {s.consumer: s for s in result.shares}
        # who keeps a place, who leaves, who gets a free one; the rest are folded
        for consumer in [c for c in row.places if c is not None and c not in present]:
            self._end_place(row.places.pop(consumer), series, values)
        own = sum(1 for c in row.places if c is not None)
        folded: list[ConsumerShare] = []
        for consumer, share in present.items():
            if consumer not in row.places:
                if own >= self.max_per_gpu:
                    folded.append(share)
                    continue
                row.places[consumer] = self._place(row_labels, names(consumer))
                own += 1
            self._emit(row.places[consumer], share.sm_ratio, share.memory_used_bytes,
                       share.energy_j, series, values)  # fmt: skip
        other = row.places.get(None)
        if folded:
            if other is None:
                other = row.places[None] = self._place(row_labels, {CONSUMER_LABEL: OTHER})
            memory = [s.memory_used_bytes for s in folded if not math.isnan(s.memory_used_bytes)]
            self._emit(other, min(sum(s.sm_ratio for s in folded), 1.0),
                       sum(memory) if memory else float("nan"),
                       sum(s.energy_j for s in folded), series, values)  # fmt: skip
        elif other is not None:
            self._end_place(row.places.pop(None), series, values)
        row.unattributed_j += result.unattributed_j
        series += [row.unattributed, row.folded]
        values += [row.unattributed_j, float(len(folded))]

    @staticmethod
    def _emit(
        place: _Place,
        sm_ratio: float,
        memory_bytes: float,
        energy_j: float,
        series: list[Series],
        values: list[float],
    ) -> None:
        place.energy_j += energy_j
        series += [place.sm, place.energy]
        values += [sm_ratio, place.energy_j]
        if not math.isnan(memory_bytes):  # the driver never said: no memory series
            place.memory_sent = True
            series.append(place.memory)
            values.append(memory_bytes)
        if place.util is not None and place.fb is not None:
            series.append(place.util)
            values.append(sm_ratio * 100.0)
            if not math.isnan(memory_bytes):
                place.fb_sent = True
                series.append(place.fb)
                values.append(memory_bytes / _MIB)

    def _end_place(
        self, place: _Place, series: list[Series], values: list[float], forget: bool = True
    ) -> None:
        ended = [place.sm, place.energy] + ([place.memory] if place.memory_sent else [])
        ended += [place.util] if place.util is not None else []
        ended += [place.fb] if place.fb is not None and place.fb_sent else []
        if forget:
            made = [place.sm, place.memory, place.energy, place.util, place.fb]
            self.registry.forget([s for s in made if s is not None])
        series += ended
        values += [STALE_NAN] * len(ended)

    def _end(
        self, row: _Row, series: list[Series], values: list[float], forget: bool = True
    ) -> None:
        for place in row.places.values():
            self._end_place(place, series, values, forget)
        ended = [row.unattributed, row.folded]
        if forget:
            self.registry.forget(ended)
        series += ended
        values += [STALE_NAN] * len(ended)

    def counters(self) -> dict[int, float]:
        """Every energy counter where it stands, by its series' id: what a successor built by a
        reload (``take_over``) goes on from, for the label sets it takes on."""
        out = {}
        for row in self._rows.values():
            out[row.unattributed.id] = row.unattributed_j
            out.update((p.energy.id, p.energy_j) for p in row.places.values())
        return out

    def take_over(self, counters: Mapping[int, float]) -> None:
        """Go on from a predecessor's ``counters`` where a series is the same: a counter
        continues across a reload rather than starting from 0 (which would read as a reset)."""
        self._carried = dict(counters)

    def end_all(self, *, forget: bool = True) -> tuple[list[Series], list[float]]:
        """Stale markers for every consumer series: the last thing sent at shutdown.
        ``forget=False`` leaves them in the registry, for a successor (a reload) that may take
        the same label sets on, as the same series, in its first window."""
        series: list[Series] = []
        values: list[float] = []
        for row in self._rows.values():
            self._end(row, series, values, forget)
        self._rows.clear()
        return series, values

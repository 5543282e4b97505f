"""Consumer attribution for a window: each GPU row's ``WindowUse`` in, its ``hfsampler_consumer_*``
series out, through the host's procfs (who each pid is), the container runtime's names when a
socket is configured, the energy split and the consumer series.

One object per service, built from the config: ``window`` runs once per window off the event loop
(a procfs read per new process), ``refresh_names`` wherever the caller may block for the
runtime's timeout (an executor thread), ``end`` at shutdown for the stale markers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hfsampler.consumers.cri import CriNames
from hfsampler.consumers.identity import Consumer
from hfsampler.consumers.procfs import ProcfsReader
from hfsampler.consumers.split import WindowSplit, WindowUse, split, split_instances
from hfsampler.export.consumer_series import DEFAULT_MAX_PER_GPU, ConsumerSeries
from hfsampler.series import Series, SeriesRegistry


@dataclass(frozen=True, slots=True)
class GpuWindow:
    """One GPU's window: its labels and energy, and its use: its own (``use``), or on a MIG GPU
    each instance's with the instance's labels (``GPU_I_ID``) and share of the GPU's SMs."""

    labels: Mapping[str, str]
    energy_j: float
    use: WindowUse | None = None
    instances: tuple[tuple[Mapping[str, str], WindowUse, float], ...] = ()


class ConsumerAttribution:
    """Procfs, runtime names, split and series together; see the module's docstring."""

    def __init__(
        self,
        registry: SeriesRegistry,
        external: Mapping[str, str] | None = None,
        *,
        procfs: str = "/proc",
        runtime_socket: str | None = None,
        pod_label_allowlist: str | None = None,
        max_per_gpu: int = DEFAULT_MAX_PER_GPU,
        virtual_gpus: bool = False,
        reader: ProcfsReader | None = None,
        names: CriNames | None = None,
    ) -> None:
        """``reader`` and ``names``: a predecessor's (a reload), with their caches and what they
        said, in place of new ones for ``procfs`` and ``runtime_socket``."""
        self.procfs = reader if reader is not None else ProcfsReader(procfs)
        self.names = names
        if names is None and runtime_socket:
            self.names = CriNames(runtime_socket, pod_label_allowlist)
        self.series = ConsumerSeries(registry, external, max_per_gpu, virtual_gpus=virtual_gpus)

    def refresh_names(self) -> None:
        """Ask the runtime for names if due; blocks for at most its timeout."""
        if self.names is not None:
            self.names.refresh_if_due()

    def _labels(self, consumer: Consumer) -> Mapping[str, str]:
        return consumer.labels() if self.names is None else self.names.labels(consumer)

    def window(
        self, rows: Sequence[tuple[Mapping[str, str], WindowUse]]
    ) -> tuple[list[Series], list[float]]:
        """One window's consumer series: per row its GPU labels and its ``WindowUse``."""
        return self.gpus([GpuWindow(labels, use.energy_j, use) for labels, use in rows])

    def gpus(self, gpus: Sequence[GpuWindow]) -> tuple[list[Series], list[float]]:
        """One window's consumer series, GPU by GPU (a MIG GPU's energy over all its
        instances' consumers, its unattributed energy on the GPU's own row)."""
        pids: set[int] = set()
        for g in gpus:
            for use in [g.use] if g.use is not None else [u for _, u, _ in g.instances]:
                pids.update(use.mem_pid.tolist())
                pids.update(use.util_pid.tolist())
        consumers = self.procfs.consumers(sorted(pids))
        rows: list[tuple[Mapping[str, str], WindowSplit]] = []
        for g in gpus:
            if g.use is not None or not g.instances:
                use = g.use if g.use is not None else WindowUse.of(0.0)
                rows.append((g.labels, split(replace(use, energy_j=g.energy_j), consumers)))
                continue
            parts = [(use, share) for _, use, share in g.instances]
            splits, unattributed = split_instances(parts, g.energy_j, consumers)
            rows.append((g.labels, WindowSplit((), unattributed)))
            rows += [(labels, one) for (labels, _, _), one in zip(g.instances, splits, strict=True)]
        return self.series.window(rows, self._labels)

    def end(self) -> tuple[list[Series], list[float]]:
        """Stale markers for every consumer series."""
        return self.series.end_all()

    def close(self) -> None:
        if self.names is not None:
            self.names.close()

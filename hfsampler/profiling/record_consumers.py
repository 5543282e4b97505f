"""`record`'s consumers: who each GPU process belongs to, and what each window saw of them, kept
in the recording so that `report` splits each window's energy among them as `run` does
(``consumers.split``).

Each look at the GPUs' processes (the recorder's, once a second and at every window's end) gives
per GPU its processes' memory and their SM utilisation since the look before, and each pid's
consumer from the host's procfs (``consumers.procfs``: a Slurm job, a Kubernetes container, a
systemd unit, a user's command). The looks inside a window become its ``WindowUse`` per GPU:
each look one sampling instant, each look one read of the lists. When the window closes, they go
to the file as one ``ConsumerWindow`` (nothing is written for a window without any process: its
energy is all unattributed, which the report says without a chunk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hfsampler.consumers.identity import Consumer
from hfsampler.consumers.procfs import ProcfsReader
from hfsampler.consumers.split import WindowUse
from hfsampler.profiling.recording_format import ConsumerWindow
from hfsampler.sources.base import GpuProcess


class ConsumerLooks:
    """The looks at the processes since the last window, per recorded GPU."""

    def __init__(self, rows: Mapping[int, int], procfs: str) -> None:
        """``rows``: GPU index -> its position in the recording's devices (the GPU's own row:
        the process lists are per physical GPU); ``procfs``: the config's ``procfs:``."""
        self.procfs = ProcfsReader(procfs)
        self._rows = dict(rows)
        self._looks = 0
        self._samples: dict[int, list[tuple[int, int, float]]] = {}
        self._entries: dict[int, list[tuple[int, int, float | None]]] = {}
        self._consumers: dict[int, Consumer] = {}

    def look(self, found: Mapping[int, Sequence[GpuProcess]], now_ns: int) -> dict[int, Consumer]:
        """Take one look (per GPU index, its processes at ``now_ns``); returns each pid's
        consumer."""
        consumers = self.procfs.consumers({p.pid for procs in found.values() for p in procs})
        self._looks += 1
        for gpu, procs in found.items():
            row = self._rows.get(gpu)
            if row is None or not procs:
                continue
            entries = self._entries.setdefault(row, [])
            samples = self._samples.setdefault(row, [])
            for p in procs:
                self._consumers[p.pid] = consumers[p.pid]
                memory = None if p.used_memory_bytes is None else float(p.used_memory_bytes)
                entries.append((p.pid, self._looks, memory))
                if p.sm_util_pct is not None:
                    samples.append((p.pid, now_ns // 1000, float(p.sm_util_pct)))
        return consumers

    def take(self, t0_ns: int, t1_ns: int) -> ConsumerWindow | None:
        """The window's consumers from the looks since the last take (None: no process was
        seen); the looks start again empty."""
        rows = sorted(set(self._entries) | set(self._samples))
        uses = {row: WindowUse.of(0.0, self._samples.get(row), self._entries.get(row))
                for row in rows}  # fmt: skip
        window = ConsumerWindow(t0_ns, t1_ns, uses, self._consumers) if uses else None
        self._samples, self._entries, self._consumers = {}, {}, {}
        return window

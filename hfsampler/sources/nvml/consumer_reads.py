"""What each GPU's consumers did over a window, through NVML: its process lists (compute,
graphics, MPS), read a few times per window, and its per-process utilisation samples since the
last read, gathered per device until the window is taken as ``WindowUse``s.

A device is a GPU, or a MIG instance by its own handle (its lists are its instance's). It reads
through ``calls`` like every NVML user; it runs wherever the caller has NVML initialised (the
sampler's slow lane, or a thread of the service with its own reference), never on the fast lane:
a list read is several driver calls. The first read of the utilisation samples only learns where
the driver's stand: what it returns was sampled before the first window. A list this driver
lacks (graphics or MPS on an old one) is left out, said once; a device without per-process
utilisation gives memory alone, said once; a failing read skips that device for that read, said
once per device, never the window.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hfsampler.consumers.split import WindowUse
from hfsampler.sources.base import DeviceInfo
from hfsampler.sources.nvml import calls

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Gathered:
    """One device's reads since the last take."""

    handle: Any
    name: str  # for the log: "GPU 0", "GPU 0 instance 2"
    since_us: int = 0  # the newest utilisation sample's timestamp seen
    primed: bool = False  # the first answer is the driver's buffer from before: only its time
    util: bool = True  # False once the device said it has no per-process utilisation
    failing: bool = False
    samples: list[tuple[int, int, float]] = field(default_factory=list)
    entries: list[tuple[int, int, float | None]] = field(default_factory=list)


class ConsumerReads:
    """Process lists and utilisation samples of ``devices`` (``(handle, name)`` each)."""

    def __init__(self, devices: Sequence[tuple[Any, str]]) -> None:
        self._devices = [_Gathered(handle, name) for handle, name in devices]
        self._lists = [kind for kind, _ in calls.PROCESS_LISTS]
        self._reads = 0

    def read(self) -> None:
        """One read of every device's lists and of its utilisation samples since the last."""
        self._reads += 1
        for d in self._devices:
            self._read_lists(d)
            if d.util:
                self._read_util(d)

    def take(self) -> list[WindowUse]:
        """Each device's window from the reads since the last take (``energy_j`` 0: the
        window's energy is the caller's to add); the reads start again empty."""
        out = []
        for d in self._devices:
            out.append(WindowUse.of(0.0, d.samples, d.entries))
            d.samples, d.entries = [], []
        return out

    def _read_lists(self, d: _Gathered) -> None:
        for kind in list(self._lists):
            try:
                procs = calls.running_processes(d.handle, kind)
            except calls.NvmlError as e:
                code = int(e.value)
                if code == calls.FUNCTION_NOT_FOUND and kind != "compute":
                    self._lists.remove(kind)
                    log.info("this driver has no %s process list: left out", kind)
                    continue
                if not d.failing:
                    d.failing = True
                    log.warning("cannot list the processes on %s: %s; skipped until it answers",
                                d.name, calls.error_text(code))  # fmt: skip
                return
            d.entries += [(pid, self._reads, mem) for pid, mem, _ in procs]
        if d.failing:
            d.failing = False
            log.info("the processes on %s are listed again", d.name)

    def _read_util(self, d: _Gathered) -> None:
        try:
            samples = calls.process_utilization(d.handle, d.since_us)
        except calls.NvmlError as e:
            code = int(e.value)
            if code in calls.UNSUPPORTED_CODES:
                d.util = False
                log.info("%s gives no per-process utilisation (%s): its consumers' memory only, "
                         "its energy unattributed", d.name, calls.error_text(code))  # fmt: skip
            else:
                log.debug("per-process utilisation on %s: %s", d.name, calls.error_text(code))
            return
        for pid, ts_us, sm in samples:
            if d.primed:
                d.samples.append((pid, ts_us, float(sm)))
            d.since_us = max(d.since_us, ts_us)
        d.primed = True


class NvmlConsumerLists:
    """``ConsumerLists`` over NVML: its own reference (``init``/``shutdown``) in the service's
    process, as `record`'s process reader has; a GPU without MIG read on its handle, a MIG GPU
    on each instance's (a MIG GPU's own lists name the instances' processes again)."""

    def __init__(self, devices: Sequence[DeviceInfo]) -> None:
        calls.init()
        self._rows: list[int] = []
        self._reads = ConsumerReads([])
        try:
            self.set_devices(devices)
        except calls.NvmlError:
            calls.shutdown()
            raise

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        rows: list[int] = []
        targets: list[tuple[Any, str]] = []
        handles: dict[int, Any] = {}
        for r, d in enumerate(devices):
            if d.is_gpu:
                if any(s.index == d.index and not s.is_gpu for s in devices):
                    continue  # a MIG GPU: its instances' rows are read instead
                rows.append(r)
                targets.append((calls.device_handle(d.index), f"GPU {d.index}"))
            elif d.mig is not None:
                found = self._instance(handles, d)
                if found is not None:
                    rows.append(r)
                    name = f"GPU {d.index} instance {d.mig.gpu_instance_id}"
                    targets.append((found, name))
        self._rows = rows
        self._reads = ConsumerReads(targets)

    @staticmethod
    def _instance(handles: dict[int, Any], d: DeviceInfo) -> Any:
        """The MIG device handle of ``d``'s instance, by its GPU instance id; None if gone."""
        assert d.mig is not None
        parent = handles.get(d.index)
        if parent is None:
            parent = handles[d.index] = calls.device_handle(d.index)
        try:
            for k in range(calls.max_mig_devices(parent)):
                try:
                    mig = calls.mig_device_handle(parent, k)
                except calls.NvmlError:
                    continue  # an empty slot
                if calls.gpu_instance_id(mig) == d.mig.gpu_instance_id:
                    return mig
        except calls.NvmlError as e:
            log.info("GPU %d's MIG instances: %s; its consumers are left out until the layout "
                     "changes", d.index, calls.error_text(int(e.value)))  # fmt: skip
        return None

    def read(self) -> None:
        self._reads.read()

    def take(self) -> dict[int, WindowUse]:
        uses = self._reads.take()
        return dict(zip(self._rows, uses, strict=True))

    def close(self) -> None:
        try:
            calls.shutdown()
        except calls.NvmlError as e:
            log.debug("nvmlShutdown: %s", e)

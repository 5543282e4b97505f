"""The GPUs' compute processes through NVML: the memory each holds and, where the driver gives
it, its SM utilisation (``nvmlDeviceGetProcessUtilization``, averaged over the samples since the
last read).

Its own NVML reference (``init`` / ``shutdown``), in the recorder's process rather than the
sampler's: once a second is no load for the millisecond loop to carry. A device or driver
without per-process utilisation gives memory alone, said once; a failing list skips that GPU
for that read, never the recording.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

from hfsampler.sources.base import GpuProcess
from hfsampler.sources.nvml import calls

log = logging.getLogger(__name__)


class NvmlProcesses:
    """``ProcessReader`` over NVML for the GPUs with these NVML indices."""

    def __init__(self, indices: Sequence[int]) -> None:
        calls.init()
        try:
            self._handles: list[tuple[int, Any]] = [(i, calls.device_handle(i)) for i in indices]
        except calls.NvmlError:
            calls.shutdown()
            raise
        self._since_us = {i: 0 for i in indices}
        self._util = {i: True for i in indices}  # False once the device said it has none
        self._failed: set[int] = set()

    def read_processes(self, job_pids: Collection[int], now_ns: int) -> dict[int, list[GpuProcess]]:
        out: dict[int, list[GpuProcess]] = {}
        for index, handle in self._handles:
            try:
                procs = calls.compute_processes(handle)
            except calls.NvmlError as e:
                if index not in self._failed:
                    self._failed.add(index)
                    log.warning("cannot list the processes on GPU %d: %s", index,
                                calls.error_text(int(e.value)))  # fmt: skip
                continue
            sm = self._sm_util(index, handle)
            out[index] = [GpuProcess(pid, mem, sm.get(pid)) for pid, mem in sorted(procs)]
        return out

    def _sm_util(self, index: int, handle: Any) -> dict[int, float]:
        if not self._util[index]:
            return {}
        try:
            samples = calls.process_utilization(handle, self._since_us[index])
        except calls.NvmlError as e:
            code = int(e.value)
            if code in calls.UNSUPPORTED_CODES:
                self._util[index] = False
                log.info("GPU %d gives no per-process utilisation (%s): memory only", index,
                         calls.error_text(code))  # fmt: skip
            else:
                log.debug("per-process utilisation on GPU %d: %s", index, calls.error_text(code))
            return {}
        sums: dict[int, list[float]] = {}
        for pid, ts_us, sm in samples:
            sums.setdefault(pid, []).append(float(sm))
            self._since_us[index] = max(self._since_us[index], ts_us)
        return {pid: sum(v) / len(v) for pid, v in sums.items()}

    def close(self) -> None:
        try:
            calls.shutdown()
        except calls.NvmlError as e:
            log.debug("nvmlShutdown: %s", e)

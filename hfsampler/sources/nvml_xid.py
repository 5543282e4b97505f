"""XID errors: one NVML event set for every GPU, drained without blocking, last XID per GPU.

XIDs arrive as events rather than as a value to read, so the ``xid`` field is the last code each
GPU reported (0 until one arrives), as dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS``. The event
calls come from ``nvml_calls``, the only module that imports ``pynvml``.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from typing import Any

from hfsampler.sources import nvml_calls as calls


def handle_address(handle: Any) -> int | None:
    """A device handle's address: events name their device by the same pointer."""
    value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    return value


class XidWatcher:
    """Registers every GPU for critical XID events and keeps each one's last code."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self._events: Any = None
        self._gpu_of: dict[int | None, int] = {}
        self.last = [0.0] * len(handles)
        # why a GPU could not be registered (NOT_SUPPORTED until something says otherwise)
        self._failure = calls.NOT_SUPPORTED
        try:
            self._events = calls.event_set()
        except calls.NvmlError as e:
            self._failure = int(e.value)
            return
        for g, handle in enumerate(handles):
            try:
                calls.register_events(handle, calls.XID_CRITICAL, self._events)
            except calls.NvmlError as e:
                self._failure = int(e.value)
                continue
            self._gpu_of[handle_address(handle)] = g

    def support(self, gpu: int) -> int:
        """NVML_SUCCESS when ``gpu`` reports XIDs, else the code that said why not."""
        return calls.SUCCESS if gpu in self._gpu_of.values() else self._failure

    def poll(self) -> None:
        """Drain pending events; never blocks (timeout 0)."""
        if self._events is None:
            return
        while True:
            try:
                data = calls.wait_event(self._events, 0)
            except calls.NvmlError:
                return  # TIMEOUT: nothing pending (other codes: try again next read)
            g = self._gpu_of.get(handle_address(data.device))
            if g is not None and data.eventType & calls.XID_CRITICAL:
                self.last[g] = float(data.eventData)

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(calls.NvmlError):
                calls.free_event_set(self._events)
            self._events = None

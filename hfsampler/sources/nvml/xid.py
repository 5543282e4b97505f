"""XID errors: one NVML event set for every GPU, drained without blocking, last XID and counts.

XIDs arrive as events rather than as a value to read, so the ``xid`` field is the last code each
GPU reported (0 until one arrives), as dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS``, and the
``xid_count`` fields are how many events of each code (``fields.XID_LABELS``; without a label,
of every code) it reported since open. The counts are cumulative here, in the sampler process: a
ring keeps one value per field per tick, so a burst of several events between two reads, or two
windows, arrives whole as the next value. The event calls come from ``nvml_calls``, the only
module that imports ``pynvml``.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hfsampler.fields import XID_CODES, XID_LABELS, XID_OTHER, Field
from hfsampler.sources.base import BoolArray, FloatArray, IntArray
from hfsampler.sources.nvml import calls

_COLUMN = {c: i for i, c in enumerate(XID_CODES)}
_OTHER = len(XID_CODES)
_TOTAL = _OTHER + 1


def handle_address(handle: Any) -> int | None:
    """A device handle's address: events name their device by the same pointer."""
    value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    return value


class XidWatcher:
    """Registers every GPU for critical XID events; keeps each one's last code and counts."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self._events: Any = None
        self._gpu_of: dict[int | None, int] = {}
        self.last = [0.0] * len(handles)
        # [gpu, XID_LABELS and then the total]
        self.counts: FloatArray = np.zeros((len(handles), len(XID_LABELS) + 1))
        # why a GPU could not be registered (NOT_SUPPORTED until something says otherwise)
        self._failure = calls.NOT_SUPPORTED
        try:
            self._events = calls.event_set()
        except calls.NvmlError as e:
            self._failure = int(e.value)
            return
        for g, handle in enumerate(handles):
            if handle is None:
                continue  # a MIG instance slot: its events are its GPU's
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
                code = int(data.eventData)
                self.last[g] = float(code)
                self.counts[g, _COLUMN.get(code, _OTHER)] += 1.0
                self.counts[g, _TOTAL] += 1.0

    @staticmethod
    def column(label: str | None) -> int:
        """The ``counts`` column of an ``xid`` label of ``fields.XID_LABELS`` (None: the total)."""
        if label is None:
            return _TOTAL
        return _OTHER if label == XID_OTHER else _COLUMN[int(label)]

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(calls.NvmlError):
                calls.free_event_set(self._events)
            self._events = None


@dataclass(frozen=True, slots=True)
class XidCells:
    """A field tuple's ``xid_count`` cells: which columns, which counts, on which GPUs."""

    cols: IntArray  # columns of ``values``
    counts: IntArray  # the matching ``XidWatcher.counts`` columns
    mask: BoolArray  # [gpu, cols]: cells the GPU reports


def plan_counts(fields: Sequence[Field], mask: BoolArray) -> XidCells | None:
    """The ``xid_count`` cells of ``fields``; ``mask[gpu, field]``: read by the XID watcher."""
    cols = [k for k, f in enumerate(fields) if f.nvml_call == "xid_count"]
    if not cols:
        return None
    return XidCells(
        np.array(cols, dtype=np.int64),
        np.array([XidWatcher.column(dict(fields[k].labels).get("xid")) for k in cols], np.int64),
        mask[:, cols],
    )


def fill_counts(
    watcher: XidWatcher,
    cells: XidCells,
    up: BoolArray,
    values: FloatArray,
    driver_ts_us: IntArray,
    now_us: int,
) -> None:
    """Write the cumulative counts into ``values`` (NaN for a GPU that is down or unsupported)."""
    ok = cells.mask & up[:, None]
    values[:, cells.cols] = np.where(ok, watcher.counts[:, cells.counts], np.nan)
    driver_ts_us[:, cells.cols] = np.where(ok, now_us, 0)

"""MIG slots kept current: the nvml source's rescan of every MIG GPU's instances, and its lines.

The layout is looked at again every ``nvml_mig.RESCAN_S`` from a read of per-instance fields
(never the fastest group's, which has none), and soon after a slot's call starts failing (the
health marks a rescan due; no sooner than ``RESCAN_S`` after the last rescan so forced). A slot
whose instance changed is relabelled (``Rows.devices`` becomes a new tuple) and starts clean; a
slot down while its instance stays is asked again and comes back when it answers. What NVML says
about a layout comes from ``nvml_mig``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from hfsampler.sources.base import DeviceInfo
from hfsampler.sources.nvml import calls, gpm, mig, nvlink
from hfsampler.sources.nvml.health import Health
from hfsampler.sources.nvml.rows import Rows

log = logging.getLogger("hfsampler.sources.nvml.source")


class Slots:
    """The MIG GPUs' instance slots of one open, looked at again as reads ask."""

    def __init__(
        self,
        rows: Rows,
        health: Health,
        readers: list[dict[str, calls.Reader]],
        say_open: nvlink.Say = log.warning,
    ) -> None:
        """``say_open``: how open's rescan (at ``now_ns`` 0) says what it finds."""
        self._rows = rows
        self._health = health
        self._readers = readers  # per row, the call readers open picked (filled by the probe)
        self._say_open = say_open
        self.gpm: gpm.GpmReader | None = None  # set once open has probed GPM
        # slot row -> (parent handle, GPU_I_ID): what the GPM reader samples a slot by
        self.gpm_targets: dict[int, tuple[Any, int]] = {}
        self._next_ns = 0  # when the layout is looked at next
        self._forced_ns = 0  # the earliest a failed read may force a rescan
        self._partial: set[int] = set()  # GPU rows whose layout could not all be read
        self._lock = threading.Lock()  # one rescan at a time; never waited for

    def due(self, now_ns: int) -> bool:
        """Whether a read at ``now_ns`` looks at the layout again first."""
        return now_ns >= self._next_ns or (self._health.rescan_due and now_ns >= self._forced_ns)

    def rescan(self, now_ns: int) -> None:
        """Look at every MIG GPU's instances again; a slot whose instance changed is relabelled.

        An instance that went leaves its slot down (its series end); a new one brings the slot
        up with its own labels.
        """
        if not self._lock.acquire(blocking=False):
            return  # another lane is at it
        try:
            self._rescan(now_ns, self._say_open if not now_ns else log.warning)
        finally:
            self._lock.release()

    def _rescan(self, now_ns: int, say: nvlink.Say) -> None:
        health, rows = self._health, self._rows
        if health.rescan_due and now_ns < self._next_ns:  # forced early by a failed read
            self._forced_ns = now_ns + mig.RESCAN_NS
        health.rescan_started()
        self._next_ns = now_ns + mig.RESCAN_NS
        devices = list(rows.devices)
        for m in rows.mig:
            if not health.up[m.row]:
                continue
            current = [devices[s].mig for s in m.slots]
            try:
                found, unreadable = mig.instances(m.handle, len(m.slots), current)
            except calls.NvmlError as e:
                if not health.failed(m.row, int(e.value)):
                    self._say_layout(m.row, [(-1, int(e.value))], say)
                continue
            self._say_layout(m.row, unreadable, say)
            placed = mig.place(current, found)
            for slot, item in zip(m.slots, placed, strict=True):
                handle, instance = item if item is not None else (None, None)
                rows.handles[slot] = handle
                if instance is not None:
                    self.gpm_targets[slot] = (m.handle, instance.gpu_instance_id)
                else:
                    self.gpm_targets.pop(slot, None)
                if devices[slot].mig == instance:
                    # still there: its failures were its own, not its going
                    health.release_held(slot, warn=instance is not None)
                    if handle is not None and slot in health.slot_down:
                        self._try_slot(slot, handle, devices[slot])
                    continue
                devices[slot] = replace(devices[slot], mig=instance)
                if self.gpm is not None:
                    self.gpm.forget(slot)  # a sample of another instance is no pair
                health.slot_changed(slot, occupied=instance is not None)
                if now_ns:
                    log.info("MIG layout changed: %s", mig.describe(devices[slot]))
        if tuple(devices) != rows.devices:
            rows.devices = tuple(devices)

    def _say_layout(self, row: int, unreadable: mig.Unreadable, say: nvlink.Say) -> None:
        """A GPU whose MIG layout cannot be read in part (or at all, index -1) is said once, and
        so is its first whole read after; only the rescan (under its lock) calls this."""
        gpu = self._rows.devices[row].index
        if not unreadable:
            if row in self._partial:
                self._partial.discard(row)
                log.info("GPU %s: its MIG layout reads whole again", gpu)
            return
        if row in self._partial:
            return
        self._partial.add(row)
        if unreadable[0][0] < 0:
            say(
                "GPU %s: its MIG layout cannot be read (%s): the instances as last seen are "
                "kept, said again when it reads",
                gpu, calls.error_text(unreadable[0][1]),
            )  # fmt: skip
            return
        say(
            "GPU %s: MIG device(s) at index %s cannot say which instance they are (%s): not "
            "sampled while so, the rest of the layout is; said again when it reads whole",
            gpu, ",".join(str(k) for k, _ in unreadable),
            "; ".join(sorted({calls.error_text(code) for _, code in unreadable})),
        )  # fmt: skip

    def _try_slot(self, slot: int, handle: Any, device: DeviceInfo) -> None:
        """A slot down while its instance is still there: back up once its calls answer.

        One call per reader the slot's fields use (its memory, at most one a rescan); the
        reads themselves take it down again if it fails once more.
        """
        for read in self._readers[slot].values():
            try:
                read(handle)
            except calls.NvmlError:
                return  # still not answering: said when it went down, asked again next rescan
        if self._health.slot_answers(slot):
            log.info("%s answers again: sampled again", self._rows.name(slot, device))

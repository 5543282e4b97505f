"""The rows an open nvml source samples: every GPU's own, then its MIG instance slots.

Rows ``0..physical-1`` are the GPUs opened, in the order asked for; each MIG-enabled GPU's slot
rows follow (``nvml_mig.slot_rows``), so the rings' shape never changes while instances come and
go. ``Rows`` holds each row's NVML handle and labels, and names a row as the log lines do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfsampler.sources.base import DeviceInfo
from hfsampler.sources.nvml.mig import MigGpu


class Rows:
    """The rows of one open: handles, labels, which rows are slots and whose.

    ``handles`` is changed in place, never replaced: a slot's handle is its instance's MIG device
    handle (None while empty), and the GPM reader and the NVLink watcher hold the same list.
    ``devices`` is a new tuple whenever a slot's instance changed (``Source.devices``).
    """

    __slots__ = ("devices", "handles", "mig", "physical")

    def __init__(
        self,
        handles: list[Any],
        devices: tuple[DeviceInfo, ...],
        physical: int,
        mig: Sequence[MigGpu] = (),
    ) -> None:
        self.handles = handles
        self.devices = devices
        self.physical = physical  # rows 0..physical-1 are GPUs; MIG instance slots follow
        self.mig = tuple(mig)

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def slots(self) -> range:
        """The MIG instance slot rows."""
        return range(self.physical, len(self.handles))

    def gpu_of(self, row: int) -> int:
        """The GPU row a slot belongs to; a GPU's row is its own."""
        return next((m.row for m in self.mig if row in m.slots), row)

    def slots_of(self, row: int) -> tuple[int, ...]:
        """The slot rows of GPU row ``row`` (none without MIG)."""
        return next((m.slots for m in self.mig if m.row == row), ())

    def gpus(self, rows: Sequence[int]) -> str:
        """Rows as a log line lists them: their GPUs' indices."""
        return ",".join(str(self.devices[g].index) for g in rows)

    def name(self, g: int, device: DeviceInfo | None = None) -> str:
        """A row as a log line names it: the GPU, or the MIG instance in a slot (GPU_I_ID)."""
        d = device if device is not None else self.devices[g]
        if d.is_gpu:
            return f"GPU {d.index}"
        if d.mig is None:
            return f"GPU {d.index} MIG slot {d.mig_slot} (empty)"
        return f"GPU {d.index} MIG instance GPU_I_ID={d.mig.gpu_instance_id} ({d.mig.uuid})"

"""The ``dcgm`` source: DCGM's profiling fields through DCGM's own Python bindings, when present.

DCGM installs its bindings beside its libraries (``/usr/share/datacenter-gpu-manager-4/bindings/
python3`` for DCGM 4, ``/usr/local/dcgm/bindings/python3`` before); the path is configurable and is
put on ``sys.path`` only when this source opens. DCGM watches the catalogue fields that have a DCGM
field id at the configured frequency and caches every value; each ``read`` collects everything
cached since the previous one (``GetAllSinceLastCall``, DCGM's ``dcgmGetValuesSince``) into a
bounded queue per GPU and field, and hands out the oldest queued value with its DCGM timestamp.
The sampler's tick is then a conveyor: with the group's interval at or below the watch interval
every value DCGM took reaches the rings, in order, none twice.

Only this module imports ``pydcgm`` and ``dcgm_structs``.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from hfsampler.errors import DriverNotFoundError, SourceError
from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, DeviceInfo, FloatArray, IntArray, Inventory

log = logging.getLogger(__name__)

DEFAULT_BINDINGS = (
    "/usr/share/datacenter-gpu-manager-4/bindings/python3",
    "/usr/local/dcgm/bindings/python3",
)
QUEUE_LIMIT = 4096  # values per GPU and field awaiting a tick; the oldest go first when full
KEEP_AGE_S = 30.0  # how long DCGM keeps a watched value for us


def import_bindings(path: str | None) -> tuple[Any, Any]:
    """``(pydcgm, dcgm_structs)`` from ``path`` (or DCGM's usual places), or DriverNotFoundError."""
    for where in (path,) if path else DEFAULT_BINDINGS:
        if where and os.path.isdir(where) and where not in sys.path:
            sys.path.insert(0, where)
    try:
        return importlib.import_module("pydcgm"), importlib.import_module("dcgm_structs")
    except ImportError as e:
        raise DriverNotFoundError(
            f"DCGM's Python bindings not importable ({e}); install DCGM or set dcgm.path"
        ) from None


class DcgmSource:
    """The ``Source`` over a DCGM host engine (``localhost``: the one on this node)."""

    def __init__(self, path: str | None = None, host: str = "localhost", interval_s: float = 0.1):
        self._path = path
        self._host = host
        self._interval_s = interval_s
        self._handle: Any = None
        self._group: Any = None
        self._field_group: Any = None
        self._gpu_ids: list[int] = []
        self._fields: tuple[Field, ...] = ()
        self._col: dict[Field, int] = {}
        self._queues: list[list[collections.deque[tuple[int, float]]]] = []
        self._up = np.zeros(0, dtype=np.bool_)
        self._devices: tuple[DeviceInfo, ...] = ()
        self.dropped = 0  # values that fell off a full queue

    def open(self, fields: Sequence[Field]) -> Inventory:
        pydcgm, structs = import_bindings(self._path)
        self._fields = tuple(fields)
        self._col = {f: c for c, f in enumerate(self._fields)}
        try:
            self._handle = pydcgm.DcgmHandle(
                ipAddress=self._host, opMode=structs.DCGM_OPERATION_MODE_AUTO
            )
            system = self._handle.GetSystem()
            self._gpu_ids = list(system.discovery.GetAllSupportedGpuIds())
            devices = tuple(
                self._device_info(i, gid, system) for i, gid in enumerate(self._gpu_ids)
            )
            ids = sorted({f.dcgm_field for f in self._fields if f.dcgm_field is not None})
            name = f"hfsampler-{os.getpid()}"
            if ids and self._gpu_ids:
                self._group = pydcgm.DcgmGroup(
                    self._handle, groupName=name, groupType=structs.DCGM_GROUP_EMPTY
                )
                for gid in self._gpu_ids:
                    self._group.AddGpu(gid)
                self._field_group = pydcgm.DcgmFieldGroup(self._handle, name=name, fieldIds=ids)
                self._group.samples.WatchFields(
                    self._field_group, int(self._interval_s * 1e6), KEEP_AGE_S, 0
                )
        except structs.DCGMError as e:
            self.close()
            raise SourceError(f"DCGM at {self._host}: {e}") from e
        gpus = len(self._gpu_ids)
        self._up = np.ones(gpus, dtype=np.bool_)
        self._queues = [
            [collections.deque(maxlen=QUEUE_LIMIT) for _ in self._fields] for _ in range(gpus)
        ]
        # DCGM would give MIG instances as entities of their own; this source reads GPUs only
        supported = np.array(
            [[f.dcgm_field is not None and not f.mig_instance for f in self._fields]] * gpus
        )
        missing = [f.name for f in self._fields if f.dcgm_field is None]
        if missing:
            log.warning(
                "%d field(s) have no DCGM field id: skipped (%s, ...)", len(missing), missing[0]
            )
        self._devices = tuple(devices)
        return Inventory(devices, self._fields, supported.reshape(gpus, len(self._fields)))

    @staticmethod
    def _device_info(index: int, gpu_id: int, system: Any) -> DeviceInfo:
        ident = system.discovery.GetGpuAttributes(gpu_id).identifiers
        return DeviceInfo(
            index=gpu_id,
            uuid=str(ident.uuid),
            model_name=str(ident.deviceName),
            pci_bus_id=str(ident.pciBusId),
            driver_version=str(ident.driverVersion),
            minor_number=gpu_id,
        )

    def _collect(self) -> None:
        """Queue every value DCGM cached since the previous call."""
        if self._group is None:
            return
        collection = self._group.samples.GetAllSinceLastCall(None, self._field_group)
        by_gpu = collection.values
        for g, gid in enumerate(self._gpu_ids):
            per_field = by_gpu.get(gid, {})
            for c, f in enumerate(self._fields):
                if f.dcgm_field is None:
                    continue
                queue = self._queues[g][c]
                for v in per_field.get(f.dcgm_field, ()):
                    if v.isBlank:
                        continue
                    if len(queue) == QUEUE_LIMIT:
                        self.dropped += 1
                    queue.append((int(v.ts), float(v.value)))
        collection.EmptyValues()

    def read(
        self, fields: Sequence[Field], values: FloatArray, driver_ts_us: IntArray, now_ns: int
    ) -> None:
        values.fill(np.nan)
        driver_ts_us.fill(0)
        try:
            self._collect()
        except Exception as e:  # the bindings raise their own DCGMError tree; keep sampling
            log.debug("DCGM read failed: %s", e)
        for k, f in enumerate(fields):
            c = self._col.get(f)
            if c is None:
                raise SourceError(f"field {f.name} was not opened")
            for g in range(len(self._gpu_ids)):
                queue = self._queues[g][c]
                if queue:
                    ts, v = queue.popleft()
                    values[g, k] = v
                    driver_ts_us[g, k] = ts

    @property
    def gpu_up(self) -> BoolArray:
        return self._up

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._devices

    def close(self) -> None:
        for step in ("unwatch", "field_group", "group", "handle"):
            try:
                if step == "unwatch" and self._group is not None and self._field_group is not None:
                    self._group.samples.UnwatchFields(self._field_group)
                elif step == "field_group" and self._field_group is not None:
                    self._field_group.Delete()
                elif step == "group" and self._group is not None:
                    self._group.Delete()
                elif step == "handle" and self._handle is not None:
                    self._handle.Shutdown()
            except Exception as e:  # closing must finish whatever the engine says
                log.debug("DCGM close (%s): %s", step, e)
        self._group = self._field_group = self._handle = None

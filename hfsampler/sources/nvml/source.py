"""The real-GPU source: reads the catalogue's fields from NVML, batched, for every GPU.

``probe_driver`` says whether a driver is usable here. ``NvmlSource`` is the ``Source`` over
NVML and wires its parts, one job each: ``discovery`` opens the GPUs (``rows``) and probes each
field once on each; ``plan`` builds and keeps how each field tuple is read; ``read`` is the hot
path; ``slots`` keeps the MIG instance slots current; ``health`` holds every row's failure state
and says what fails. Every NVML call goes through ``nvml_calls``, the only module that imports
``pynvml``.

A lost GPU is marked down and skipped; the others keep sampling. Per-link NVLink fields are
entries of the same batch, one per link a GPU has, read while up (``nvml_nvlink``). A
MIG-enabled GPU also gets a row per MIG instance slot (``nvml_mig``): the per-instance twins of
the fields (``Field.mig_instance``: framebuffer, GPM) are read there, from the instance's own MIG
device handle, and ``devices`` changes as the layout does. An instance that stops answering
takes only its slot down; the rescan brings it back when it answers again.

Reads of different field sets may run at once on different threads (the sampler's two lanes):
NVML's handles are thread-safe, each field set has its own plan and buffers, and what the sets
share is the health's, changed under its lock, never held across an NVML call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from hfsampler.errors import DriverNotFoundError, SourceError
from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, DeviceInfo, FloatArray, IntArray, Inventory
from hfsampler.sources.nvml import calls, discovery
from hfsampler.sources.nvml.health import Health
from hfsampler.sources.nvml.plan import Plans
from hfsampler.sources.nvml.read import Reader
from hfsampler.sources.nvml.rows import Rows
from hfsampler.sources.nvml.slots import Slots

log = logging.getLogger(__name__)


def probe_driver() -> str | None:
    """None when an NVIDIA driver is usable here; otherwise a short reason why not."""
    try:
        calls.init()
    except calls.NvmlError as e:
        code = int(e.value)
        if code == calls.LIBRARY_NOT_FOUND:
            return "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver installed"
        if code == calls.DRIVER_NOT_LOADED:
            return "NVIDIA driver not loaded"
        if code == calls.NO_PERMISSION:
            return "no permission to open the NVIDIA driver"
        return f"NVML init failed: {calls.error_text(code)}"
    except OSError as e:  # pragma: no cover - pynvml maps its CDLL failure, other OSErrors remain
        return f"NVML library could not be loaded: {e}"
    try:
        if calls.device_count() == 0:
            return "NVIDIA driver loaded but it sees no GPU"
    except calls.NvmlError as e:
        return f"NVML device count failed: {calls.error_text(int(e.value))}"
    finally:
        with contextlib.suppress(calls.NvmlError):
            calls.shutdown()
    return None


class NvmlSource:
    """The ``Source`` over NVML; opened in the process that reads it."""

    def __init__(self, indices: tuple[int, ...] | None = None, *, reopened: bool = False) -> None:
        """``reopened``: the sampler process's open, after discovery's (``SourceSpec.reopened``),
        which logged what open finds; this one logs that at debug, and what reads find as ever."""
        self._indices = indices
        self._say_open = log.debug if reopened else log.warning
        self._tell_open = log.debug if reopened else log.info
        self._rows = Rows([], (), 0)
        self._health = Health(self._rows)
        self._probe: discovery.Probe | None = None
        self._reader: Reader | None = None
        self._open = False

    def open(self, fields: Sequence[Field]) -> Inventory:
        try:
            calls.init()
        except calls.NvmlError as e:
            raise DriverNotFoundError(f"NVML init failed: {calls.error_text(int(e.value))}") from e
        self._open = True
        try:
            return self._discover(tuple(fields))
        except BaseException:
            self.close()
            raise

    def _discover(self, fields: tuple[Field, ...]) -> Inventory:
        rows, indices = discovery.find_rows(self._indices)
        self._rows = rows
        fields, links = discovery.expand_links(rows, fields, indices, self._tell_open)
        self._health = health = Health(rows)
        fn = discovery.field_values_function(self._tell_open)
        self._probe = probe = discovery.Probe(
            rows, fields, health, links, self._say_open, self._tell_open
        )
        slots = Slots(rows, health, probe.readers, self._say_open)
        if rows.mig:
            slots.rescan(0)
        probe.run(slots.gpm_targets)
        slots.gpm = probe.gpm
        plans = Plans(fields, probe, health, mig=bool(rows.mig))
        self._reader = Reader(rows, health, probe, plans, slots, links, fn)
        return Inventory(rows.devices, fields, probe.mode != discovery.NONE)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._reader is not None:
            self._reader.close()
        if self._probe is not None:
            self._probe.close()
        try:
            calls.shutdown()
        except calls.NvmlError as e:
            log.debug("nvmlShutdown: %s", e)

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._rows.devices

    @property
    def gpu_up(self) -> BoolArray:
        view = self._health.up.view()
        view.flags.writeable = False
        return view

    @property
    def read_errors(self) -> IntArray:
        """Per GPU: cells that had a value to read and got an error instead, since open."""
        return self._health.errors

    def read(
        self, fields: Sequence[Field], values: FloatArray, driver_ts_us: IntArray, now_ns: int
    ) -> None:
        if self._reader is None:
            raise SourceError("the NVML source was not opened")
        self._reader.read(fields, values, driver_ts_us, now_ns)

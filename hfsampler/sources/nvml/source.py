"""The real-GPU source: reads the catalogue's fields from NVML, batched, for every GPU.

Every NVML call goes through ``nvml_calls``, the only module that imports ``pynvml``. ``open``
probes each field on each device once and picks how to read it (batched field id, or a per-device
call when the id is unsupported); ``read`` is the hot path: per GPU one ``nvmlDeviceGetFieldValues``
into a ctypes array built once per field set, converted for all GPUs at once with numpy, plus the
per-device calls. A lost GPU is marked down and skipped; the others keep sampling. Per-link NVLink
fields are entries of the same batch, one per link a GPU has, read while up (``nvml_nvlink``).
A MIG-enabled GPU also gets a row per MIG instance slot (``nvml_mig``): the per-instance twins
of the fields (``Field.mig_instance``: framebuffer, GPM) are read there, from the instance's own
MIG device handle; the layout is looked at again every ``nvml_mig.RESCAN_S`` from those reads
(never the fastest group's, which has no twins) and soon after a slot's call starts failing (no
sooner than ``RESCAN_S`` after the last rescan so forced), and ``devices`` changes. An instance
that stops answering takes only its slot down; the rescan brings it back when it answers again.

Reads of different field sets may run at once on different threads (the sampler's two lanes):
NVML's handles are thread-safe, each field set has its own plan and buffers, and what the sets
share (GPUs up, error counts, the unknown-error streaks) is changed under one lock that is never
held across an NVML call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hfsampler.errors import ConfigError, DriverNotFoundError, SourceError
from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, DeviceInfo, FloatArray, IntArray, Inventory
from hfsampler.sources.nvml import calls, gpm, mig, nvlink, xid

log = logging.getLogger(__name__)

UNKNOWN_LIMIT = 10  # consecutive NVML_ERROR_UNKNOWN answers before a GPU is taken as lost
_MAX_PLANS = 64  # a caller that builds a new tuple per tick must not grow the identity cache

_NONE, _FIELD, _CALL, _GPM = 0, 1, 2, 3
_SUCCESS = calls.SUCCESS
_NOT_SUPPORTED = calls.NOT_SUPPORTED  # how a (gpu, field) cell is read

_FV_SIZE = calls.FIELD_VALUE_SIZE
_TYPES = calls.VALUE_TYPES
_FV_DTYPE = calls.FIELD_VALUE_DTYPE


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


def _log_name(f: Field) -> str:
    """A field as a log line names it: its own labels too (a link's)."""
    return f.name + "".join(f"{{{k}={v}}}" for k, v in f.labels)


@dataclass(slots=True)
class _Batch:
    """One field set's preallocated ``nvmlDeviceGetFieldValues`` buffer, all GPUs back to back."""

    cols: IntArray  # columns of ``values`` the batch fills
    n: int  # entries per GPU
    buf: Any  # ctypes array of c_nvmlFieldValue_t, gpus * n
    per_gpu: list[Any]  # per GPU, a ctypes array sharing buf's memory at that GPU's offset
    view: Any  # numpy structured view of buf, [gpu, n]
    ids: IntArray  # field ids, [n]
    scopes: IntArray  # scope ids, [n]: the link of a per-link NVLink field, else 0
    links: IntArray | None  # [n]: each column's link (nvlink.NOT_A_LINK), None: no link column
    mask: BoolArray  # [gpu, n]: cells read through the batch (mode FIELD)
    rows: list[int]  # GPUs with at least one such cell
    scale: FloatArray  # [n]
    rate: BoolArray  # [n]: cumulative counters exported as a rate per second
    prev_value: FloatArray  # [gpu, n]: the last distinct raw value of rate columns
    prev_ts_us: IntArray  # [gpu, n]: its driver timestamp
    types: tuple[tuple[int, str], ...]  # value types seen at open
    vt0: IntArray  # [gpu, n]: the value types seen at open
    names: tuple[str, ...]  # [n]: the fields, as the log names them
    failing: BoolArray  # [gpu, n]: cells whose last read failed (said when a run starts, ends)


@dataclass(slots=True)
class _Plan:
    """How to read one tuple of fields: built on its first ``read`` and reused."""

    fields: tuple[Field, ...]
    batch: _Batch | None
    # per GPU: (reader key, [(column, extract, scale)]) for the cells read by call
    calls: list[list[tuple[str, list[tuple[int, calls.Extract, float]]]]]
    has_xid: bool
    gpm: gpm.GpmPlan | None = None  # the cells read from GPM sample pairs
    xid_counts: xid.XidCells | None = None  # the per-code XID counts, from the XID watcher
    mig: bool = False  # reads MIG instance cells: the read that looks at the layout again


class NvmlSource:
    """The ``Source`` over NVML; opened in the process that reads it."""

    def __init__(self, indices: tuple[int, ...] | None = None, *, reopened: bool = False) -> None:
        """``reopened``: the sampler process's open, after discovery's (``SourceSpec.reopened``),
        which logged what open finds; this one logs that at debug, and what reads find as ever."""
        self._indices = indices
        self._say_open = log.debug if reopened else log.warning
        self._tell_open = log.debug if reopened else log.info
        self._handles: list[Any] = []
        self._devices: tuple[DeviceInfo, ...] = ()
        self._fields: tuple[Field, ...] = ()
        self._col: dict[Field, int] = {}
        self._mode = np.zeros((0, 0), dtype=np.int8)
        self._vt = np.zeros((0, 0), dtype=np.int64)
        self._readers: list[dict[str, calls.Reader]] = []
        self._up = np.zeros(0, dtype=np.bool_)
        self._unknown: list[int] = []
        self._errors = np.zeros(0, dtype=np.int64)
        self._book = threading.Lock()  # guards _up, _unknown and _errors; never across a call
        # (GPU, call) whose last read failed; each lane adds and removes only its own calls,
        # but the rescan forgets a slot's when another instance takes it or it comes back
        self._failing_calls: set[tuple[int, str]] = set()
        # (slot, call) that started failing as a destroyed instance's handle does, with the
        # warning to give should the rescan find the instance still there; under _book
        self._gone_pending: dict[tuple[int, str], str] = {}
        self._plans: dict[tuple[Field, ...], _Plan] = {}
        self._plan_by_id: dict[int, _Plan] = {}
        self._fn: Any = None
        self._xid: xid.XidWatcher | None = None
        self._gpm: gpm.GpmReader | None = None
        self._links: nvlink.LinkWatcher | None = None
        self._open = False
        self._physical = 0  # rows 0..n-1 are GPUs; MIG instance slots follow
        self._mig: list[mig.MigGpu] = []
        self._mig_gpm: dict[int, tuple[Any, int]] = {}  # slot row -> (parent handle, GPU_I_ID)
        self._mig_next_ns = 0  # when the MIG layout is looked at next
        # a slot's read failed (the instance may have gone): look again early, but no sooner
        # than _mig_forced_ns, so a slot failing on every read forces one rescan a second
        self._mig_due = False
        self._mig_forced_ns = 0
        self._mig_partial: set[int] = set()  # GPU rows whose layout could not all be read
        self._mig_failing: set[int] = set()  # slots whose last read failed; under _book
        self._mig_lock = threading.Lock()  # one rescan at a time; never waited for
        # slots taken down because their own instance stopped answering (not their GPU): the
        # rescan asks the instance again and brings the slot back when it answers; under _book
        self._slot_down: set[int] = set()

    # -- lifecycle -------------------------------------------------------------------------

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
        try:
            count = calls.device_count()
            if count == 0:
                raise SourceError("NVML sees no GPU")
            indices = self._indices if self._indices is not None else tuple(range(count))
            for i in indices:
                if not 0 <= i < count:
                    raise ConfigError(
                        "gpus", f"GPU index {i} not present", f"this node has GPUs 0..{count - 1}"
                    )
            driver = calls.driver_version()
            self._handles = [calls.device_handle(i) for i in indices]
            self._devices = tuple(
                self._device_info(i, h, driver) for i, h in zip(indices, self._handles, strict=True)
            )
            self._physical = len(self._handles)
            self._mig, slots = mig.slot_rows(self._devices, self._handles)
            self._handles.extend([None] * len(slots))
            self._devices = (*self._devices, *slots)
        except calls.NvmlError as e:
            raise calls.translate(e, "NVML device discovery") from e
        fields = self._expand_links(fields, indices)
        gpus = len(self._handles)
        self._fields = fields
        self._col = {f: c for c, f in enumerate(fields)}
        self._up = np.ones(gpus, dtype=np.bool_)
        self._up[self._physical :] = False  # until an instance is found in the slot
        self._unknown = [0] * gpus
        self._errors = np.zeros(gpus, dtype=np.int64)
        try:
            # The C entry point itself, called with arrays built once: pynvml's wrapper builds a
            # new ctypes array and sets every field id on every call.
            self._fn = calls.c_function("nvmlDeviceGetFieldValues")
        except calls.NvmlError as e:
            # Where pynvml's own call still works, read through it, slower; on a driver from
            # before field values it fails too, and the probe finds every id unsupported.
            self._tell_open(
                "cannot look up nvmlDeviceGetFieldValues itself (%s): field values are read "
                "through pynvml's nvmlDeviceGetFieldValues instead, which allocates per read",
                calls.error_text(int(e.value)),
            )
            self._fn = calls.field_values_into
        if self._mig:
            self._rescan_mig(0)
        self._probe(fields)
        return Inventory(self._devices, fields, self._mode != _NONE)

    def _expand_links(self, fields: tuple[Field, ...], indices: Sequence[int]) -> tuple[Field, ...]:
        """Per-link NVLink fields: one per link a GPU has (``nvml_nvlink``), states watched."""
        if not any(f.per == nvlink.LINK for f in fields):
            return fields
        # a MIG instance slot has no links of its own: its GPU's are the GPU's row's
        slots = len(self._handles) - self._physical
        states = nvlink.probe_links(self._handles[: self._physical]) + [[] for _ in range(slots)]
        fields = nvlink.expand(fields, states, self._tell_open)
        self._links = nvlink.LinkWatcher(self._handles, states, fields, indices, self._tell_open)
        return fields

    @staticmethod
    def _device_info(index: int, handle: Any, driver: str) -> DeviceInfo:
        bus = calls.pci_bus_id(handle)
        try:
            minor = calls.minor_number(handle)
        except calls.NvmlError:
            minor = index  # not on Windows/WSL; dcgm-exporter's device label falls back too
        return DeviceInfo(
            index=index,
            uuid=calls.device_uuid(handle),
            model_name=calls.device_name(handle),
            pci_bus_id=bus,
            driver_version=driver,
            minor_number=minor,
        )

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self._plans.clear()
        self._plan_by_id.clear()
        self._links = None
        if self._gpm is not None:
            self._gpm.close()
            self._gpm = None
        if self._xid is not None:
            self._xid.close()
            self._xid = None
        try:
            calls.shutdown()
        except calls.NvmlError as e:
            log.debug("nvmlShutdown: %s", e)

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._devices

    @property
    def gpu_up(self) -> BoolArray:
        view = self._up.view()
        view.flags.writeable = False
        return view

    @property
    def read_errors(self) -> IntArray:
        """Per GPU: cells that had a value to read and got an error instead, since open."""
        return self._errors.copy()

    # -- probing ---------------------------------------------------------------------------

    def _probe(self, fields: tuple[Field, ...]) -> None:
        gpus = len(self._handles)
        self._mode = np.zeros((gpus, len(fields)), dtype=np.int8)
        self._vt = np.full((gpus, len(fields)), -1, dtype=np.int64)
        self._readers = [{} for _ in range(gpus)]
        why: dict[int, dict[str, list[int]]] = {}  # column -> reason -> GPUs
        fallback: dict[int, list[int]] = {}  # column -> GPUs read by call instead of field id
        entries = {c: nvlink.entry(f) for c, f in enumerate(fields) if f.nvml_field}
        ids = {c: i for c, (i, _) in entries.items()}
        for c, f in enumerate(fields):
            if f.nvml_field and ids[c] is None and not nvlink.unexpanded(f):
                why.setdefault(c, {}).setdefault(f"pynvml lacks {nvlink.constant(f)}", [])
        # a link a GPU lacks: no cells there; one down at open: its cells are read once it is
        # up, whatever its entries answer while down. Neither is a warning.
        link_down = np.zeros((gpus, len(fields)), dtype=np.bool_)
        link_absent = np.zeros((gpus, len(fields)), dtype=np.bool_)
        if self._links is not None:
            cell_links = nvlink.links(fields)
            link_down = ~self._links.cells(cell_links)
            link_absent = ~self._links.present(cell_links)
        unexpanded = [c for c, f in enumerate(fields) if nvlink.unexpanded(f)]
        link_down[:, unexpanded] = link_absent[:, unexpanded] = True
        if any(f.nvml_call in ("xid", "xid_count") for f in fields):
            self._xid = xid.XidWatcher(self._handles[: self._physical] + [None] * len(self._slots))
        twins = [c for c, f in enumerate(fields) if f.mig_instance]
        for g, handle in enumerate(self._handles[: self._physical]):
            if not self._up[g]:
                continue
            present = {
                c: (i, entries[c][1]) for c, i in ids.items() if i is not None and c not in twins
            }
            id_cols = [c for c in present if not link_absent[g, c]]
            entry_codes = self._probe_ids(g, handle, id_cols, [present[c] for c in id_cols])
            for c, code in zip(id_cols, entry_codes, strict=True):
                if code == _SUCCESS or (link_down[g, c] and code not in calls.LOST_CODES):
                    self._mode[g, c] = _FIELD
                else:
                    why.setdefault(c, {}).setdefault(calls.error_text(code), []).append(g)
            self._link_value_types(g, fields, link_down[g], entry_codes, id_cols)
            for c, f in enumerate(fields):
                if self._mode[g, c] != _NONE or not f.nvml_call or not self._up[g] or c in twins:
                    continue
                code = self._probe_call(g, handle, f.nvml_call)
                if code == _SUCCESS:
                    self._mode[g, c] = _CALL
                    if f.nvml_field:
                        fallback.setdefault(c, []).append(g)
                else:
                    why.setdefault(c, {}).setdefault(calls.error_text(code), []).append(g)
        self._probe_mig(fields, twins)
        self._probe_gpm(fields)
        told: set[str] = set()  # the XID counter is one field per code: tell once for them all
        for c, f in enumerate(fields):
            if f.gpm_metric or not f.nvml_readable or f.name in told or f.mig_instance:
                continue  # GPM: _probe_gpm logged it in one line; not NVML's (a Jetson's rails)
            if c in fallback:
                self._tell_open(
                    "%s: field id %s unsupported on GPU %s; read with call %s",
                    f.name, f.nvml_field, self._gpus(fallback[c]), f.nvml_call,
                )  # fmt: skip
            missing = [
                g
                for g in range(self._physical)
                if self._mode[g, c] == _NONE and not link_down[g, c]
            ]
            if missing:
                reasons = "; ".join(f"{r}" for r in why.get(c, {}) or ("no way to read it",))
                self._say_open(
                    "%s not supported on GPU %s (%s): skipped", f.name, self._gpus(missing), reasons
                )
                told.add(f.name)

    def _link_value_types(
        self,
        g: int,
        fields: tuple[Field, ...],
        down: BoolArray,
        codes: Sequence[int],
        cols: Sequence[int],
    ) -> None:
        """A down link's entry that failed at open has no value type yet: its field's on
        another link of the GPU stands in, so the batch's type check stays the quick one."""
        failed = [c for c, code in zip(cols, codes, strict=True) if down[c] and code != _SUCCESS]
        if not failed:
            return
        answered = [c for c, code in zip(cols, codes, strict=True) if code == _SUCCESS]
        seen = {fields[c].name: int(self._vt[g, c]) for c in answered}
        for c in failed:
            self._vt[g, c] = seen.get(fields[c].name, -1)

    def _probe_mig(self, fields: tuple[Field, ...], twins: list[int]) -> None:
        """The per-instance fields read by call on every slot, with the reader its GPU answers."""
        for m in self._mig:
            if not self._up[m.row]:
                continue
            # the reader (memory v2 or v1) is picked on an instance there is, else on the GPU,
            # and kept for every slot: an instance made later is read the same way
            held = [self._handles[slot] for slot in m.slots if self._handles[slot] is not None]
            handle = held[0] if held else m.handle
            for c in twins:
                key = fields[c].nvml_call
                if not key or fields[c].gpm_metric:
                    continue
                for slot in m.slots:
                    if self._probe_call(slot, handle, key) == _SUCCESS:
                        self._mode[slot, c] = _CALL

    def _probe_gpm(self, fields: tuple[Field, ...]) -> None:
        cols = [c for c, f in enumerate(fields) if f.gpm_metric and not f.mig_instance]
        twins = [c for c, f in enumerate(fields) if f.gpm_metric and f.mig_instance]
        if cols or twins:
            self._gpm, gpus = gpm.probe(
                fields,
                cols + twins,
                self._handles,
                self._up,
                self._gpus,
                self._gpm_error,
                rows=range(self._physical),
                mig=self._mig_gpm,
                say=self._say_open,
                tell=self._tell_open,
            )
            known = [c for c in cols + twins if calls.gpm_metric_id(fields[c].gpm_metric or "")]
            for c in known:
                if c in cols:
                    self._mode[gpus, c] = _GPM
            if self._gpm is not None and self._gpm.mig_sampling:
                slots = [s for m in self._mig if m.row in gpus for s in m.slots]
                for c in known:
                    if c in twins:
                        self._mode[slots, c] = _GPM

    @property
    def _slots(self) -> list[int]:
        return list(range(self._physical, len(self._handles)))

    # -- MIG layout ------------------------------------------------------------------------

    def _rescan_mig(self, now_ns: int) -> None:
        """Look at every MIG GPU's instances again; a slot whose instance changed is relabelled.

        An instance that went leaves its slot down (its series end); a new one brings the slot
        up with its own labels. ``devices`` is a new tuple when anything changed.
        """
        if not self._mig_lock.acquire(blocking=False):
            return  # another lane is at it
        try:
            if self._mig_due and now_ns < self._mig_next_ns:  # forced early by a failed read
                self._mig_forced_ns = now_ns + mig.RESCAN_NS
            self._mig_due = False
            self._mig_next_ns = now_ns + mig.RESCAN_NS
            devices = list(self._devices)
            say = self._say_open if not now_ns else log.warning  # open's rescan: now_ns 0
            for m in self._mig:
                if not self._up[m.row]:
                    continue
                current = [devices[s].mig for s in m.slots]
                try:
                    found, unreadable = mig.instances(m.handle, len(m.slots), current)
                except calls.NvmlError as e:
                    if not self._failed(m.row, int(e.value)):
                        self._say_layout(m.row, [(-1, int(e.value))], say)
                    continue
                self._say_layout(m.row, unreadable, say)
                placed = mig.place(current, found)
                for slot, item in zip(m.slots, placed, strict=True):
                    handle, instance = item if item is not None else (None, None)
                    self._handles[slot] = handle
                    if instance is not None:
                        self._mig_gpm[slot] = (m.handle, instance.gpu_instance_id)
                    else:
                        self._mig_gpm.pop(slot, None)
                    if devices[slot].mig == instance:
                        # still there: its failures were its own, not its going
                        self._say_pending(slot, warn=instance is not None)
                        if handle is not None and slot in self._slot_down:
                            self._try_slot(slot, handle, devices[slot])
                        continue
                    self._forget_failing(slot)  # the instance went: what failed was its own
                    devices[slot] = replace(devices[slot], mig=instance)
                    if self._gpm is not None:
                        self._gpm.forget(slot)  # a sample of another instance is no pair
                    with self._book:
                        self._up[slot] = instance is not None
                        self._unknown[slot] = 0
                        self._slot_down.discard(slot)
                        self._mig_failing.discard(slot)
                    if now_ns:
                        log.info("MIG layout changed: %s", mig.describe(devices[slot]))
            if tuple(devices) != self._devices:
                self._devices = tuple(devices)
        finally:
            self._mig_lock.release()

    def _say_layout(
        self, row: int, unreadable: mig.Unreadable, say: nvlink.Say = log.warning
    ) -> None:
        """A GPU whose MIG layout cannot be read in part (or at all, index -1) is said once, and
        so is its first whole read after; only the rescan (under its lock) calls this."""
        gpu = self._devices[row].index
        if not unreadable:
            if row in self._mig_partial:
                self._mig_partial.discard(row)
                log.info("GPU %s: its MIG layout reads whole again", gpu)
            return
        if row in self._mig_partial:
            return
        self._mig_partial.add(row)
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
        with self._book:
            if slot not in self._slot_down:
                return
            self._slot_down.discard(slot)
            self._mig_failing.discard(slot)
            self._up[slot] = True
            self._unknown[slot] = 0
        self._forget_failing(slot)  # said here, not again as each call reads
        log.info("%s answers again: sampled again", self._row_name(slot, device))

    def _say_pending(self, slot: int, *, warn: bool) -> None:
        """The slot's calls that failed as a gone instance's would: warned where it is not."""
        if not self._gone_pending:
            return
        with self._book:
            said = [k for k in self._gone_pending if k[0] == slot]
            lines = [self._gone_pending.pop(k) for k in said]
        if warn:
            for line in lines:
                log.warning("%s", line)

    def _forget_failing(self, slot: int) -> None:
        """A slot's failing state ends with its instance: a newcomer is not "read again"."""
        self._say_pending(slot, warn=False)
        # copies taken in one C call each: the lanes add to both meanwhile
        for key in [k for k in set(self._failing_calls) if k[0] == slot]:
            self._failing_calls.discard(key)
        for plan in list(self._plans.values()):
            if plan.batch is not None:
                plan.batch.failing[slot] = False

    def _gpm_error(self, g: int, code: int, cells: int) -> bool:
        return self._failed(g, code, cells)

    def _probe_ids(
        self, g: int, handle: Any, cols: list[int], ids: list[tuple[int, int]]
    ) -> list[int]:
        if not ids:
            return []
        try:
            entries = calls.field_values(handle, ids)
        except calls.NvmlError as e:
            code = int(e.value)
            if code in calls.LOST_CODES:
                self._mark_down(g, code)
            return [code] * len(ids)
        codes = []
        for c, entry in zip(cols, entries, strict=True):
            codes.append(int(entry.nvmlReturn))
            self._vt[g, c] = int(entry.valueType)
        return codes

    def _probe_call(self, g: int, handle: Any, key: str) -> int:
        spec = calls.CALL_FIELDS.get(key)
        if spec is None:
            return _NOT_SUPPORTED
        if spec.reader == "xid":
            return self._xid.support(g) if self._xid is not None else _NOT_SUPPORTED
        reader = self._readers[g].get(spec.reader)
        code = calls.FUNCTION_NOT_FOUND
        candidates = (reader,) if reader is not None else calls.READERS[spec.reader]
        for candidate in candidates:
            try:
                raw = candidate(handle)
            except calls.NvmlError as e:
                code = int(e.value)
                if code in calls.LOST_CODES:
                    self._mark_down(g, code)
                    return code
                continue
            self._readers[g][spec.reader] = candidate
            if spec.extract(raw) is None:
                return _NOT_SUPPORTED  # e.g. reserved memory from the v1 struct
            return _SUCCESS
        return code

    # -- reading ---------------------------------------------------------------------------

    def _plan(self, fields: Sequence[Field]) -> _Plan:
        plan = self._plan_by_id.get(id(fields))
        if plan is not None and plan.fields is fields:
            return plan
        key = tuple(fields)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build_plan(key)
            self._plans[key] = plan
        if isinstance(fields, tuple) and len(self._plan_by_id) < _MAX_PLANS:
            # Keyed by identity so the hot path skips hashing the fields; plan.fields keeps the
            # tuple alive, so the id cannot be reused while the entry exists.
            plan = replace(plan, fields=fields)
            self._plan_by_id[id(fields)] = plan
        return plan

    def _build_plan(self, fields: tuple[Field, ...]) -> _Plan:
        gpus = len(self._handles)
        try:
            src = [self._col[f] for f in fields]
        except KeyError as e:
            raise SourceError(f"field {e.args[0].name} was not opened") from e
        mode = self._mode[:, src]
        batch_cols = [k for k in range(len(fields)) if (mode[:, k] == _FIELD).any()]
        batch = self._build_batch(fields, src, batch_cols, mode) if batch_cols else None
        per_gpu: list[list[tuple[str, list[tuple[int, calls.Extract, float]]]]] = []
        for g in range(gpus):
            by_reader: dict[str, list[tuple[int, calls.Extract, float]]] = {}
            for k, f in enumerate(fields):
                if mode[g, k] == _CALL and f.nvml_call and f.nvml_call != "xid_count":
                    spec = calls.CALL_FIELDS[f.nvml_call]
                    by_reader.setdefault(spec.reader, []).append((k, spec.extract, f.scale))
            per_gpu.append(list(by_reader.items()))
        xid_counts = xid.plan_counts(fields, mode == _CALL)
        has_xid = xid_counts is not None or any(r == "xid" for work in per_gpu for r, _ in work)
        gpm_cols = [k for k in range(len(fields)) if (mode[:, k] == _GPM).any()]
        gpm_plan = None
        if gpm_cols and self._gpm is not None:
            gpm_plan = self._gpm.plan(fields, gpm_cols, mode[:, gpm_cols] == _GPM)
        has_mig = any(f.mig_instance for f in fields) and bool(self._mig)
        return _Plan(fields, batch, per_gpu, has_xid, gpm_plan, xid_counts, has_mig)

    def _build_batch(
        self, fields: tuple[Field, ...], src: list[int], cols: list[int], mode: Any
    ) -> _Batch:
        gpus, n = len(self._handles), len(cols)
        buf = (calls.FieldValue * (gpus * n))()
        row_type = calls.FieldValue * n
        per_gpu = [row_type.from_buffer(buf, g * n * _FV_SIZE) for g in range(gpus)]
        view = np.frombuffer(buf, dtype=_FV_DTYPE).reshape(gpus, n)
        entries = [nvlink.entry(fields[k]) for k in cols]
        ids = np.array([i or 0 for i, _ in entries], dtype=np.int64)
        scopes = np.array([scope for _, scope in entries], dtype=np.int64)
        view["fieldId"][:] = ids
        view["scopeId"][:] = scopes
        links = nvlink.links([fields[k] for k in cols])
        mask = mode[:, cols] == _FIELD
        vt0 = self._vt[:, [src[k] for k in cols]]
        seen = {int(t) for t in vt0[mask]}
        return _Batch(
            cols=np.array(cols, dtype=np.int64),
            n=n,
            buf=buf,
            per_gpu=per_gpu,
            view=view,
            ids=ids,
            scopes=scopes,
            links=links if (links != nvlink.NOT_A_LINK).any() else None,
            mask=mask,
            rows=[g for g in range(gpus) if mask[g].any()],
            scale=np.array([fields[k].scale for k in cols], dtype=np.float64),
            rate=np.array([fields[k].nvml_rate for k in cols], dtype=np.bool_),
            prev_value=np.full((gpus, n), np.nan),
            prev_ts_us=np.zeros((gpus, n), dtype=np.int64),
            types=tuple((t, name) for t, name in _TYPES if t in seen),
            vt0=vt0,
            names=tuple(_log_name(fields[k]) for k in cols),
            failing=np.zeros((gpus, n), dtype=np.bool_),
        )

    def read(
        self,
        fields: Sequence[Field],
        values: FloatArray,
        driver_ts_us: IntArray,
        now_ns: int,
    ) -> None:
        plan = self._plan(fields)
        if plan.mig and (
            now_ns >= self._mig_next_ns or (self._mig_due and now_ns >= self._mig_forced_ns)
        ):
            self._rescan_mig(now_ns)
        values.fill(np.nan)
        driver_ts_us.fill(0)
        if plan.batch is not None:
            if plan.batch.links is not None and self._links is not None:
                self._links.refresh(now_ns, self._up)
            self._read_batch(plan.batch, values, driver_ts_us)
        if plan.has_xid and self._xid is not None:
            self._xid.poll()
        now_us = now_ns // 1000
        if plan.gpm is not None and self._gpm is not None:
            self._gpm.read(plan.gpm, self._up, values, driver_ts_us, now_us)
        up = self._up
        xid_last = self._xid.last if self._xid is not None else []
        for g, work in enumerate(plan.calls):
            if not work or not up[g]:
                continue
            handle = self._handles[g]
            readers = self._readers[g]
            for key, outs in work:
                try:
                    raw = xid_last[g] if key == "xid" else readers[key](handle)
                except calls.NvmlError as e:
                    if self._failed(g, int(e.value), len(outs)):
                        values[g].fill(np.nan)
                        driver_ts_us[g].fill(0)
                        break
                    if (g, key) not in self._failing_calls:
                        self._say_call(g, key, plan.fields, outs, int(e.value))
                    continue
                if self._failing_calls and (g, key) in self._failing_calls:
                    self._say_call(g, key, plan.fields, outs, None)
                self._answered(g)
                for k, extract, scale in outs:
                    v = extract(raw)
                    if v is not None:
                        values[g, k] = v * scale
                        driver_ts_us[g, k] = now_us
        if plan.xid_counts is not None and self._xid is not None:
            xid.fill_counts(self._xid, plan.xid_counts, self._up, values, driver_ts_us, now_us)

    def _read_batch(self, b: _Batch, values: FloatArray, driver_ts_us: IntArray) -> None:
        fn, handles, up = self._fn, self._handles, self._up
        row_ok = up.copy()
        view = b.view
        view["fieldId"][:] = b.ids  # cheap insurance should a driver ever touch the inputs
        view["scopeId"][:] = b.scopes
        for g in b.rows:
            if not up[g]:
                continue
            ret = fn(handles[g], b.n, b.per_gpu[g])
            if ret:
                row_ok[g] = False
                self._failed(g, int(ret), int(b.mask[g].sum()))
            else:
                self._answered(g)
        vt = view["valueType"]
        # The driver gives each field one value type; recheck only the cells that count.
        types = _TYPES if ((vt != b.vt0) & b.mask).any() else b.types
        out = view["d"].copy() if types and types[0][1] == "d" else np.full(vt.shape, np.nan)
        for t, name in types:
            if name != "d":
                np.copyto(out, view[name], where=vt == t, casting="unsafe")
        rets = view["nvmlReturn"]
        live = b.mask & row_ok[:, None]
        if b.links is not None and self._links is not None:
            live &= self._links.cells(b.links)  # a link that went down is not read while down
        ok = live & (rets == 0)
        bad = live & ~ok
        if bad.any() or b.failing.any():
            self._say_failing(b, bad, ok, rets)
        if bad.any():
            self._entry_errors(bad, rets)
            if b.links is not None and self._links is not None and bad[:, b.links >= 0].any():
                self._links.recheck()  # a link that went down answers so, maybe
            ok &= self._up[:, None]
        ts = view["timestamp"]
        if b.rate.any():
            out = self._rates(b, out, ts, ok)
        values[:, b.cols] = np.where(ok, out * b.scale, np.nan)
        driver_ts_us[:, b.cols] = np.where(ok, ts, 0)

    @staticmethod
    def _rates(b: _Batch, raw: FloatArray, ts: IntArray, ok: BoolArray) -> FloatArray:
        """Counter columns become (value delta) / (driver timestamp delta) per second.

        The first sample, a repeat, and a counter that went backwards (reset) give NaN.
        """
        fresh = ok & b.rate & (ts != b.prev_ts_us)
        dt_s = (ts - b.prev_ts_us) / 1e6
        delta = raw - b.prev_value
        usable = fresh & (b.prev_ts_us > 0) & (dt_s > 0) & (delta >= 0)
        rate = np.divide(delta, dt_s, out=np.full(raw.shape, np.nan), where=usable)
        b.prev_value = np.where(fresh, raw, b.prev_value)
        b.prev_ts_us = np.where(fresh, ts, b.prev_ts_us)
        result: FloatArray = np.where(b.rate, rate, raw)
        return result

    def _say_call(
        self, g: int, key: str, fields: tuple[Field, ...], outs: Sequence[Any], code: int | None
    ) -> None:
        """A per-device call that starts failing on row ``g`` (``code``), or reads again (None).

        On a MIG slot, a code a destroyed instance's handle answers is said only if the rescan
        (soon: the failure forced one) finds the instance still there; gone, the layout change
        says it.
        """
        names = ", ".join(_log_name(fields[k]) for k, *_ in outs)
        row = self._row_name(g)
        if code is None:
            self._failing_calls.discard((g, key))
            with self._book:
                unsaid = self._gone_pending.pop((g, key), None) is not None
            if not unsaid:
                log.info("%s: %s reads again", row, names)
            return
        self._failing_calls.add((g, key))
        line = (
            f"{row}: reading {names} failed: {calls.error_text(code)}; its series go stale while "
            "it fails (said again when it reads)"
        )
        if g >= self._physical and code in mig.GONE_CODES:
            with self._book:
                self._gone_pending[(g, key)] = line
            return
        log.warning("%s", line)

    def _say_failing(self, b: _Batch, bad: BoolArray, ok: BoolArray, rets: Any) -> None:
        """A field that starts failing on a GPU is said once, and so is its first good read
        after: a field that fails for good is a warning, not series vanishing without a word."""
        started = bad & ~b.failing
        ended = ok & b.failing
        b.failing = (b.failing | bad) & ~ok
        for g, k in zip(*np.nonzero(started), strict=True):
            code = int(rets[g][k])
            if code in calls.LOST_CODES:
                continue  # the GPU is lost: _mark_down says so
            log.warning(
                "%s: reading %s failed: %s; its series go stale while it fails (said again "
                "when it reads)",
                self._row_name(int(g)), b.names[k], calls.error_text(code),
            )  # fmt: skip
        for g, k in zip(*np.nonzero(ended), strict=True):
            log.info("%s: %s reads again", self._row_name(int(g)), b.names[k])

    def _entry_errors(self, bad: BoolArray, rets: Any) -> None:
        with self._book:
            self._errors += bad.sum(axis=1)
        for g in np.flatnonzero(bad.any(axis=1)):
            lost = [int(r) for r in rets[g][bad[g]] if int(r) in calls.LOST_CODES]
            if lost:
                self._mark_down(int(g), lost[0])

    def _answered(self, g: int) -> None:
        """Row ``g`` answered: its streak of unknown errors ends, and a slot's failing (no lock
        when there is neither: the hot path)."""
        if self._unknown[g] or (self._mig_failing and g in self._mig_failing):
            with self._book:
                self._unknown[g] = 0
                self._mig_failing.discard(g)

    def _failed(self, g: int, code: int, cells: int = 0) -> bool:
        """Account an error answer from GPU ``g`` that cost ``cells`` values.

        True when it takes the GPU down.
        """
        with self._book:
            if g >= self._physical and code not in calls.LOST_CODES and g not in self._mig_failing:
                # a slot that starts failing: most likely its instance went, so look at the
                # layout soon; one that goes on failing while its instance stays forces no more
                self._mig_failing.add(g)
                self._mig_due = True
            self._errors[g] += cells
            if code in calls.LOST_CODES:
                lost = True
            elif code == calls.UNKNOWN_CODE:
                self._unknown[g] += 1
                lost = self._unknown[g] >= UNKNOWN_LIMIT
            else:
                return False
        if lost:
            self._mark_down(g, code)
        return lost

    def _gpus(self, rows: Sequence[int]) -> str:
        return ",".join(str(self._devices[g].index) for g in rows)

    def _row_name(self, g: int, device: DeviceInfo | None = None) -> str:
        """A row as a log line names it: the GPU, or the MIG instance in a slot (GPU_I_ID)."""
        d = device if device is not None else self._devices[g]
        if d.is_gpu:
            return f"GPU {d.index}"
        if d.mig is None:
            return f"GPU {d.index} MIG slot {d.mig_slot} (empty)"
        return f"GPU {d.index} MIG instance GPU_I_ID={d.mig.gpu_instance_id} ({d.mig.uuid})"

    def _mark_down(self, g: int, code: int) -> None:
        if g >= self._physical and code in calls.LOST_CODES:
            # an instance answering "GPU lost" speaks for its GPU: one line, every row down
            g = next((m.row for m in self._mig if g in m.slots), g)
        slot = g >= self._physical
        with self._book:
            if not self._up[g]:
                return
            self._up[g] = False
            if slot:
                self._slot_down.add(g)
            for m in self._mig:
                if m.row == g:
                    self._up[list(m.slots)] = False  # its instances go with it
                    self._slot_down.difference_update(m.slots)  # down for good with it
        info = self._devices[g]
        if slot:
            # only the instance went: its GPU's row and the other instances keep sampling
            log.error(
                "%s stopped answering: %s; the instance's series go stale, GPU %s and its other "
                "instances continue; asked again once a second",
                self._row_name(g), calls.error_text(code), info.index,
            )  # fmt: skip
            return
        log.error(
            "GPU %s (%s) stopped answering: %s; no longer sampled, the others continue",
            info.index, info.uuid, calls.error_text(code),
        )  # fmt: skip

"""Discovery for the nvml source: the GPUs and their MIG slots, and how each field is read.

``find_rows`` opens the GPUs asked for and gives each MIG-enabled one its instance slot rows;
``expand_links`` makes a per-link NVLink field one field per link a GPU has; ``Probe`` asks
each field on each row once and records how it is read (``mode``): through the batched field id,
a per-device call (also where the id is unsupported), GPM, or not at all, and says once per
field where it cannot be read. Every NVML call goes through ``nvml_calls``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hfsampler.errors import ConfigError, SourceError
from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, DeviceInfo
from hfsampler.sources.nvml import calls, gpm, mig, nvlink, xid
from hfsampler.sources.nvml.health import Health
from hfsampler.sources.nvml.rows import Rows

log = logging.getLogger("hfsampler.sources.nvml.source")

NONE, FIELD, CALL, GPM = 0, 1, 2, 3  # how a (row, field) cell is read


def find_rows(indices: tuple[int, ...] | None) -> tuple[Rows, tuple[int, ...]]:
    """The GPUs at ``indices`` (None: all) and their MIG slots (empty until the first rescan),
    and the NVML indices opened."""
    try:
        count = calls.device_count()
        if count == 0:
            raise SourceError("NVML sees no GPU")
        chosen = indices if indices is not None else tuple(range(count))
        for i in chosen:
            if not 0 <= i < count:
                raise ConfigError(
                    "gpus", f"GPU index {i} not present", f"this node has GPUs 0..{count - 1}"
                )
        driver = calls.driver_version()
        handles = [calls.device_handle(i) for i in chosen]
        devices = tuple(_device_info(i, h, driver) for i, h in zip(chosen, handles, strict=True))
        migs, slots = mig.slot_rows(devices, handles)
    except calls.NvmlError as e:
        raise calls.translate(e, "NVML device discovery") from e
    physical = len(handles)
    return Rows([*handles, *([None] * len(slots))], (*devices, *slots), physical, migs), chosen


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


def expand_links(
    rows: Rows, fields: tuple[Field, ...], indices: Sequence[int], tell: nvlink.Say
) -> tuple[tuple[Field, ...], nvlink.LinkWatcher | None]:
    """Per-link NVLink fields: one per link a GPU has (``nvml_nvlink``), states watched."""
    if not any(f.per == nvlink.LINK for f in fields):
        return fields, None
    # a MIG instance slot has no links of its own: its GPU's are the GPU's row's
    states = nvlink.probe_links(rows.handles[: rows.physical]) + [[] for _ in rows.slots]
    fields = nvlink.expand(fields, states, tell)
    return fields, nvlink.LinkWatcher(rows.handles, states, fields, indices, tell)


def field_values_function(tell: nvlink.Say) -> Any:
    """``nvmlDeviceGetFieldValues`` as the batch calls it: (handle, count, entries) -> code."""
    try:
        # The C entry point itself, called with arrays built once: pynvml's wrapper builds a
        # new ctypes array and sets every field id on every call.
        return calls.c_function("nvmlDeviceGetFieldValues")
    except calls.NvmlError as e:
        # Where pynvml's own call still works, read through it, slower; on a driver from
        # before field values it fails too, and the probe finds every id unsupported.
        tell(
            "cannot look up nvmlDeviceGetFieldValues itself (%s): field values are read "
            "through pynvml's nvmlDeviceGetFieldValues instead, which allocates per read",
            calls.error_text(int(e.value)),
        )
        return calls.field_values_into


class Probe:
    """How each field is read on each row, found once at open: ``mode`` [row, field], the value
    types the batch saw (``vt``), the call readers each row answers, the XID and GPM readers."""

    def __init__(
        self,
        rows: Rows,
        fields: tuple[Field, ...],
        health: Health,
        links: nvlink.LinkWatcher | None,
        say: nvlink.Say,
        tell: nvlink.Say,
    ) -> None:
        """``say`` and ``tell``: how what is not supported, and how it is read instead, are
        logged (at debug in the sampler process's reopen: said once, by discovery's open)."""
        self._rows, self._fields, self._health, self._links = rows, fields, health, links
        self._say, self._tell = say, tell
        gpus = len(rows)
        self.mode = np.zeros((gpus, len(fields)), dtype=np.int8)
        self.vt = np.full((gpus, len(fields)), -1, dtype=np.int64)
        self.readers: list[dict[str, calls.Reader]] = [{} for _ in range(gpus)]
        self.xid: xid.XidWatcher | None = None
        self.gpm: gpm.GpmReader | None = None

    def close(self) -> None:
        if self.gpm is not None:
            self.gpm.close()
            self.gpm = None
        if self.xid is not None:
            self.xid.close()
            self.xid = None

    def run(self, gpm_targets: dict[int, tuple[Any, int]]) -> None:
        """Probe every field on every row up; ``gpm_targets``: the slots' live GPM map."""
        rows, fields, up = self._rows, self._fields, self._health.up
        gpus = len(rows)
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
            self.xid = xid.XidWatcher(rows.handles[: rows.physical] + [None] * len(rows.slots))
        twins = [c for c, f in enumerate(fields) if f.mig_instance]
        for g, handle in enumerate(rows.handles[: rows.physical]):
            if not up[g]:
                continue
            present = {
                c: (i, entries[c][1]) for c, i in ids.items() if i is not None and c not in twins
            }
            id_cols = [c for c in present if not link_absent[g, c]]
            entry_codes = self._probe_ids(g, handle, id_cols, [present[c] for c in id_cols])
            for c, code in zip(id_cols, entry_codes, strict=True):
                if code == calls.SUCCESS or (link_down[g, c] and code not in calls.LOST_CODES):
                    self.mode[g, c] = FIELD
                else:
                    why.setdefault(c, {}).setdefault(calls.error_text(code), []).append(g)
            self._link_value_types(g, link_down[g], entry_codes, id_cols)
            for c, f in enumerate(fields):
                if self.mode[g, c] != NONE or not f.nvml_call or not up[g] or c in twins:
                    continue
                code = self._probe_call(g, handle, f.nvml_call)
                if code == calls.SUCCESS:
                    self.mode[g, c] = CALL
                    if f.nvml_field:
                        fallback.setdefault(c, []).append(g)
                else:
                    why.setdefault(c, {}).setdefault(calls.error_text(code), []).append(g)
        self._probe_mig(twins)
        self._probe_gpm(gpm_targets)
        self._say_missing(why, fallback, link_down)

    def _say_missing(
        self, why: dict[int, dict[str, list[int]]], fallback: dict[int, list[int]], link_down: Any
    ) -> None:
        """One line per field read by call instead of its id, and per field some GPU lacks."""
        told: set[str] = set()  # the XID counter is one field per code: tell once for them all
        for c, f in enumerate(self._fields):
            if f.gpm_metric or not f.nvml_readable or f.name in told or f.mig_instance:
                continue  # GPM: _probe_gpm logged it in one line; not NVML's (a Jetson's rails)
            if c in fallback:
                self._tell(
                    "%s: field id %s unsupported on GPU %s; read with call %s",
                    f.name, f.nvml_field, self._rows.gpus(fallback[c]), f.nvml_call,
                )  # fmt: skip
            missing = [
                g
                for g in range(self._rows.physical)
                if self.mode[g, c] == NONE and not link_down[g, c]
            ]
            if missing:
                reasons = "; ".join(f"{r}" for r in why.get(c, {}) or ("no way to read it",))
                self._say(
                    "%s not supported on GPU %s (%s): skipped",
                    f.name, self._rows.gpus(missing), reasons,
                )  # fmt: skip
                told.add(f.name)

    def _link_value_types(
        self, g: int, down: BoolArray, codes: Sequence[int], cols: Sequence[int]
    ) -> None:
        """A down link's entry that failed at open has no value type yet: its field's on
        another link of the GPU stands in, so the batch's type check stays the quick one."""
        failed = [
            c for c, code in zip(cols, codes, strict=True) if down[c] and code != calls.SUCCESS
        ]
        if not failed:
            return
        answered = [c for c, code in zip(cols, codes, strict=True) if code == calls.SUCCESS]
        seen = {self._fields[c].name: int(self.vt[g, c]) for c in answered}
        for c in failed:
            self.vt[g, c] = seen.get(self._fields[c].name, -1)

    def _probe_mig(self, twins: list[int]) -> None:
        """The per-instance fields read by call on every slot, with the reader its GPU answers."""
        rows = self._rows
        for m in rows.mig:
            if not self._health.up[m.row]:
                continue
            # the reader (memory v2 or v1) is picked on an instance there is, else on the GPU,
            # and kept for every slot: an instance made later is read the same way
            held = [rows.handles[slot] for slot in m.slots if rows.handles[slot] is not None]
            handle = held[0] if held else m.handle
            for c in twins:
                key = self._fields[c].nvml_call
                if not key or self._fields[c].gpm_metric:
                    continue
                for slot in m.slots:
                    if self._probe_call(slot, handle, key) == calls.SUCCESS:
                        self.mode[slot, c] = CALL

    def _probe_gpm(self, targets: dict[int, tuple[Any, int]]) -> None:
        fields, rows = self._fields, self._rows
        cols = [c for c, f in enumerate(fields) if f.gpm_metric and not f.mig_instance]
        twins = [c for c, f in enumerate(fields) if f.gpm_metric and f.mig_instance]
        if not cols and not twins:
            return
        self.gpm, gpus = gpm.probe(
            fields,
            cols + twins,
            rows.handles,
            self._health.up,
            rows.gpus,
            self._health.failed,
            rows=range(rows.physical),
            mig=targets,
            say=self._say,
            tell=self._tell,
        )
        known = [c for c in cols + twins if calls.gpm_metric_id(fields[c].gpm_metric or "")]
        for c in known:
            if c in cols:
                self.mode[gpus, c] = GPM
        if self.gpm is not None and self.gpm.mig_sampling:
            slots = [s for m in rows.mig if m.row in gpus for s in m.slots]
            for c in known:
                if c in twins:
                    self.mode[slots, c] = GPM

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
                self._health.mark_down(g, code)
            return [code] * len(ids)
        codes = []
        for c, entry in zip(cols, entries, strict=True):
            codes.append(int(entry.nvmlReturn))
            self.vt[g, c] = int(entry.valueType)
        return codes

    def _probe_call(self, g: int, handle: Any, key: str) -> int:
        spec = calls.CALL_FIELDS.get(key)
        if spec is None:
            return calls.NOT_SUPPORTED
        if spec.reader == "xid":
            return self.xid.support(g) if self.xid is not None else calls.NOT_SUPPORTED
        reader = self.readers[g].get(spec.reader)
        code = calls.FUNCTION_NOT_FOUND
        candidates = (reader,) if reader is not None else calls.READERS[spec.reader]
        for candidate in candidates:
            try:
                raw = candidate(handle)
            except calls.NvmlError as e:
                code = int(e.value)
                if code in calls.LOST_CODES:
                    self._health.mark_down(g, code)
                    return code
                continue
            self.readers[g][spec.reader] = candidate
            if spec.extract(raw) is None:
                return calls.NOT_SUPPORTED  # e.g. reserved memory from the v1 struct
            return calls.SUCCESS
        return code

"""Read plans for the nvml source: how one tuple of fields is read, built once and reused.

A plan holds, for its field tuple, the preallocated ``nvmlDeviceGetFieldValues`` buffer of every
cell read by field id (``Batch``, all rows back to back, with a numpy view to convert them at
once), the per-device calls per row grouped by reader, and its GPM and XID work, all from the
``mode`` open's probe recorded. ``Plans`` keeps one plan per field tuple, found by the tuple's
identity on the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hfsampler.errors import SourceError
from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, FloatArray, IntArray
from hfsampler.sources.nvml import calls, gpm, nvlink, xid
from hfsampler.sources.nvml.discovery import CALL, FIELD, GPM, Probe
from hfsampler.sources.nvml.health import Health

_MAX_PLANS = 64  # a caller that builds a new tuple per tick must not grow the identity cache


def log_name(f: Field) -> str:
    """A field as a log line names it: its own labels too (a link's)."""
    return f.name + "".join(f"{{{k}={v}}}" for k, v in f.labels)


@dataclass(slots=True)
class Batch:
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
    failing: BoolArray  # [gpu, n]: cells whose last read failed (the health's record)


# (reader, [(col, extract, scale, rate)]); rate: a cumulative counter exported as a rate per
# second, the reader giving its driver timestamp (calls.Stamped)
Out = tuple[int, calls.Extract, float, bool]
Work = list[tuple[str, list[Out]]]


@dataclass(slots=True)
class Plan:
    """How to read one tuple of fields: built on its first ``read`` and reused."""

    fields: tuple[Field, ...]
    batch: Batch | None
    calls: list[Work]  # per GPU: the cells read by call, grouped by reader
    has_xid: bool
    gpm: gpm.GpmPlan | None = None  # the cells read from GPM sample pairs
    xid_counts: xid.XidCells | None = None  # the per-code XID counts, from the XID watcher
    mig: bool = False  # reads MIG instance cells: the read that looks at the layout again
    # [gpu, field]: the last distinct raw value of a call column that is a rate, and its driver
    # timestamp (the batch keeps its own in Batch)
    call_prev_value: FloatArray | None = None
    call_prev_ts_us: IntArray | None = None


class Plans:
    """One open's plans, by field tuple."""

    def __init__(
        self, fields: tuple[Field, ...], probe: Probe, health: Health, *, mig: bool
    ) -> None:
        """``mig``: some GPU has MIG instance slots, whose layout reads look at again."""
        self._col = {f: c for c, f in enumerate(fields)}
        self._probe = probe
        self._health = health
        self._mig = mig
        self._plans: dict[tuple[Field, ...], Plan] = {}
        self._by_id: dict[int, Plan] = {}

    def clear(self) -> None:
        self._plans.clear()
        self._by_id.clear()

    def get(self, fields: Sequence[Field]) -> Plan:
        plan = self._by_id.get(id(fields))
        if plan is not None and plan.fields is fields:
            return plan
        key = tuple(fields)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build(key)
            self._plans[key] = plan
        if isinstance(fields, tuple) and len(self._by_id) < _MAX_PLANS:
            # Keyed by identity so the hot path skips hashing the fields; plan.fields keeps the
            # tuple alive, so the id cannot be reused while the entry exists.
            plan = replace(plan, fields=fields)
            self._by_id[id(fields)] = plan
        return plan

    def _build(self, fields: tuple[Field, ...]) -> Plan:
        probe = self._probe
        try:
            src = [self._col[f] for f in fields]
        except KeyError as e:
            raise SourceError(f"field {e.args[0].name} was not opened") from e
        mode = probe.mode[:, src]
        gpus = mode.shape[0]
        batch_cols = [k for k in range(len(fields)) if (mode[:, k] == FIELD).any()]
        batch = self._batch(fields, src, batch_cols, mode) if batch_cols else None
        per_gpu: list[Work] = []
        for g in range(gpus):
            by_reader: dict[str, list[Out]] = {}
            for k, f in enumerate(fields):
                if mode[g, k] == CALL and f.nvml_call and f.nvml_call != "xid_count":
                    spec = calls.CALL_FIELDS[f.nvml_call]
                    out = (k, spec.extract, f.scale, f.nvml_rate)
                    by_reader.setdefault(spec.reader, []).append(out)
            per_gpu.append(list(by_reader.items()))
        xid_counts = xid.plan_counts(fields, mode == CALL)
        has_xid = xid_counts is not None or any(r == "xid" for work in per_gpu for r, _ in work)
        gpm_cols = [k for k in range(len(fields)) if (mode[:, k] == GPM).any()]
        gpm_plan = None
        if gpm_cols and probe.gpm is not None:
            gpm_plan = probe.gpm.plan(fields, gpm_cols, mode[:, gpm_cols] == GPM)
        has_mig = any(f.mig_instance for f in fields) and self._mig
        rates = any(rate for work in per_gpu for _, outs in work for *_, rate in outs)
        shape = (gpus, len(fields))
        return Plan(
            fields, batch, per_gpu, has_xid, gpm_plan, xid_counts, has_mig,
            np.full(shape, np.nan) if rates else None,
            np.zeros(shape, dtype=np.int64) if rates else None,
        )  # fmt: skip

    def _batch(
        self, fields: tuple[Field, ...], src: list[int], cols: list[int], mode: Any
    ) -> Batch:
        gpus, n = mode.shape[0], len(cols)
        buf = (calls.FieldValue * (gpus * n))()
        row_type = calls.FieldValue * n
        per_gpu = [row_type.from_buffer(buf, g * n * calls.FIELD_VALUE_SIZE) for g in range(gpus)]
        view = np.frombuffer(buf, dtype=calls.FIELD_VALUE_DTYPE).reshape(gpus, n)
        entries = [nvlink.entry(fields[k]) for k in cols]
        ids = np.array([i or 0 for i, _ in entries], dtype=np.int64)
        scopes = np.array([scope for _, scope in entries], dtype=np.int64)
        view["fieldId"][:] = ids
        view["scopeId"][:] = scopes
        links = nvlink.links([fields[k] for k in cols])
        mask = mode[:, cols] == FIELD
        vt0 = self._probe.vt[:, [src[k] for k in cols]]
        seen = {int(t) for t in vt0[mask]}
        return Batch(
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
            types=tuple((t, name) for t, name in calls.VALUE_TYPES if t in seen),
            vt0=vt0,
            names=tuple(log_name(fields[k]) for k in cols),
            failing=self._health.failing_cells(n),
        )

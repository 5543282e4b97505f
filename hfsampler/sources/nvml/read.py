"""The nvml source's hot read: one field tuple's values for every row, by its plan.

Per GPU one ``nvmlDeviceGetFieldValues`` into the plan's ctypes array, converted for all rows at
once with numpy, then the GPM pairs, the per-device calls and the XID counts. A cell that cannot
be read is NaN; what failed is accounted and said by the health, and a row it takes down is
skipped from then on, the others read on. A read of a plan with MIG instance cells first looks
at the layout again when the slots say it is due.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, FloatArray, IntArray
from hfsampler.sources.nvml import calls, nvlink, xid
from hfsampler.sources.nvml.discovery import Probe
from hfsampler.sources.nvml.health import Health
from hfsampler.sources.nvml.plan import Batch, Out, Plan, Plans, log_name
from hfsampler.sources.nvml.rows import Rows
from hfsampler.sources.nvml.slots import Slots

_TYPES = calls.VALUE_TYPES


class Reader:
    """Reads one open's rows; field tuples of different plans may be read on different threads
    at once (the sampler's two lanes): each plan has its own buffers, and what they share is
    the health's to change."""

    def __init__(
        self,
        rows: Rows,
        health: Health,
        probe: Probe,
        plans: Plans,
        slots: Slots,
        links: nvlink.LinkWatcher | None,
        fn: Any,
    ) -> None:
        """``fn``: ``nvmlDeviceGetFieldValues`` as the batch calls it (``discovery``'s)."""
        self._rows = rows
        self._health = health
        self._probe = probe  # its XID and GPM readers: None once closed
        self.plans = plans
        self._slots = slots
        self._links = links
        self._fn = fn

    def close(self) -> None:
        self.plans.clear()
        self._links = None

    def read(
        self, fields: Sequence[Field], values: FloatArray, driver_ts_us: IntArray, now_ns: int
    ) -> None:
        """``Source.read``: fill ``values`` and ``driver_ts_us`` [row, field] for ``fields``."""
        plan = self.plans.get(fields)
        if plan.mig and self._slots.due(now_ns):
            self._slots.rescan(now_ns)
        values.fill(np.nan)
        driver_ts_us.fill(0)
        health = self._health
        watcher, gpm_reader = self._probe.xid, self._probe.gpm
        if plan.batch is not None:
            if plan.batch.links is not None and self._links is not None:
                self._links.refresh(now_ns, health.up)
            self._read_batch(plan.batch, values, driver_ts_us)
        if plan.has_xid and watcher is not None:
            watcher.poll()
        now_us = now_ns // 1000
        if plan.gpm is not None and gpm_reader is not None:
            gpm_reader.read(plan.gpm, health.up, values, driver_ts_us, now_us)
        up = health.up
        handles = self._rows.handles
        readers = self._probe.readers
        xid_last = watcher.last if watcher is not None else []
        for g, work in enumerate(plan.calls):
            if not work or not up[g]:
                continue
            handle = handles[g]
            row_readers = readers[g]
            for key, outs in work:
                try:
                    raw = xid_last[g] if key == "xid" else row_readers[key](handle)
                except calls.NvmlError as e:
                    if health.failed(g, int(e.value), len(outs)):
                        values[g].fill(np.nan)
                        driver_ts_us[g].fill(0)
                        break
                    if (g, key) not in health.failing_calls:
                        health.call_failed(g, key, _names(plan.fields, outs), int(e.value))
                    continue
                failing = health.failing_calls
                if failing and (g, key) in failing:
                    health.call_answers(g, key, _names(plan.fields, outs))
                health.answered(g)
                for k, extract, scale, rate in outs:
                    v = extract(raw)
                    if v is None:
                        continue
                    ts = now_us
                    if rate:
                        # the driver's timestamp tells a repeat from a counter at rest
                        ts = raw.timestamp_us if isinstance(raw, calls.Stamped) else now_us
                        v = _call_rate(plan, g, k, v, ts)
                        if v is None:
                            continue
                    values[g, k] = v * scale
                    driver_ts_us[g, k] = ts
        if plan.xid_counts is not None and watcher is not None:
            xid.fill_counts(watcher, plan.xid_counts, up, values, driver_ts_us, now_us)

    def _read_batch(self, b: Batch, values: FloatArray, driver_ts_us: IntArray) -> None:
        fn, handles, health = self._fn, self._rows.handles, self._health
        up = health.up
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
                health.failed(g, int(ret), int(b.mask[g].sum()))
            else:
                health.answered(g)
        vt = view["valueType"]
        # The driver gives each field one value type; recheck only the cells that count.
        types = _TYPES if ((vt != b.vt0) & b.mask).any() else b.types
        out = view["d"].copy() if types and types[0][1] == "d" else np.full(vt.shape, np.nan)
        for t, name in types:
            if name != "d":
                np.copyto(out, view[name], where=vt == t, casting="unsafe")
        rets = view["nvmlReturn"]
        live = b.mask & row_ok[:, None]
        links = self._links
        if b.links is not None and links is not None:
            live &= links.cells(b.links)  # a link that went down is not read while down
        ok = live & (rets == 0)
        bad = live & ~ok
        if bad.any() or b.failing.any():
            health.cells_read(b.failing, bad, ok, rets, b.names)
        if bad.any():
            health.entry_errors(bad, rets)
            if b.links is not None and links is not None and bad[:, b.links >= 0].any():
                links.recheck()  # a link that went down answers so, maybe
            ok &= up[:, None]
        ts = view["timestamp"]
        if b.rate.any():
            out = _rates(b, out, ts, ok)
        values[:, b.cols] = np.where(ok, out * b.scale, np.nan)
        driver_ts_us[:, b.cols] = np.where(ok, ts, 0)


def _names(fields: tuple[Field, ...], outs: Sequence[Out]) -> str:
    """The fields one call reads, as its log lines name them."""
    return ", ".join(log_name(fields[k]) for k, *_ in outs)


def _call_rate(plan: Plan, g: int, k: int, raw: float, ts_us: int) -> float | None:
    """A call column's counter as a rate per second, as ``_rates`` makes the batch's: None for
    a repeat of the driver's last reading (same timestamp), and NaN for the first reading
    and after a reset (the counter went backwards)."""
    prev_value, prev_ts = plan.call_prev_value, plan.call_prev_ts_us
    assert prev_value is not None  # a plan with a rate column has both
    assert prev_ts is not None
    before_ts = int(prev_ts[g, k])
    if ts_us == before_ts:
        return None
    delta = raw - float(prev_value[g, k])
    prev_value[g, k], prev_ts[g, k] = raw, ts_us
    dt_s = (ts_us - before_ts) / 1e6
    if before_ts <= 0 or dt_s <= 0 or not delta >= 0:
        return float("nan")
    return delta / dt_s


def _rates(b: Batch, raw: FloatArray, ts: IntArray, ok: BoolArray) -> FloatArray:
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

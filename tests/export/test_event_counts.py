"""The windowed counts in the metric model: codes outside the tracked list, new labels, reloads."""

from __future__ import annotations

import numpy as np

from hfsampler import fields
from hfsampler.export.metrics import MetricModel
from hfsampler.sampling.window import STATS, WindowStats
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.sources.sim.source import SimSource

S = 10**9
LAST = fields.BY_NAME["DCGM_FI_DEV_XID_ERRORS"]
XIDS = fields.expand_xid((fields.BY_NAME["hfsampler_xid_events_total"],))
FIELDS = (LAST, *XIDS)
COUNTED = (fields.BY_NAME["DCGM_EXP_XID_ERRORS_COUNT"],)
OTHER = 1 + fields.XID_LABELS.index(fields.XID_OTHER)
C79 = 1 + fields.XID_LABELS.index("79")


def _model(previous: MetricModel | None = None, window_s: float = 3.0) -> MetricModel:
    inv = SimSource(1).open(FIELDS)
    return MetricModel(
        inv.devices, {"x": FIELDS}, SelfMetrics(), hostname="node1", counted=COUNTED,
        xid_count_window_s=window_s, previous=previous,
    )  # fmt: skip


def _window(last: float, counts: dict[int, float]) -> dict[str, WindowStats]:
    row = [last] + [0.0] * len(XIDS)
    for col, n in counts.items():
        row[col] = n
    m = np.array([row])
    return {"x": WindowStats(0, 1, FIELDS, {s.name: m for s in STATS}, np.ones_like(m, np.int64))}


def _counts(model: MetricModel, window: dict[str, WindowStats], t_ns: int) -> dict[str, float]:
    snap = model.snapshot(window, np.array([True]), t_ns)
    return {
        dict(s.labels).get("xid", "-"): v
        for s, v in snap.items()
        if s.name == "DCGM_EXP_XID_ERRORS_COUNT" and v == v
    }


def test_an_untracked_code_is_counted_under_the_last_xid() -> None:
    model = _model()
    assert _counts(model, _window(0, {}), 1 * S) == {"-": 0.0}
    # two events of code 200, which hfsampler counts under "other": the last XID names it
    assert _counts(model, _window(200, {OTHER: 2}), 2 * S) == {"200": 2.0}
    # one more of another untracked code, then a tracked one in the same window: the untracked
    # event's code is not known any more, so it stays "other"
    got = _counts(model, _window(79, {OTHER: 3, C79: 1}), 3 * S)
    assert got == {"200": 2.0, "other": 1.0, "79": 1.0}


def test_a_reload_keeps_the_window_and_the_totals() -> None:
    """A reloaded model (new labels) neither loses the events in the window nor counts the
    cumulative totals again as new events."""
    model = _model()
    _counts(model, _window(79, {C79: 4}), 1 * S)
    again = _model(previous=model)
    assert _counts(again, _window(79, {C79: 4}), 2 * S) == {"79": 4.0}
    assert _counts(again, _window(79, {C79: 5}), 3 * S) == {"79": 5.0}
    assert _counts(again, _window(79, {C79: 5}), 4 * S) == {"79": 1.0}  # the first slid out
    assert _counts(again, _window(79, {C79: 5}), 6 * S) == {"-": 0.0}


def test_clock_events_total_counts_a_reason_each_time_it_turns_on() -> None:
    reasons = fields.BY_NAME["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]
    inv = SimSource(1).open((reasons,))
    counted = (fields.BY_NAME["DCGM_EXP_CLOCK_EVENTS_TOTAL"],)
    model = MetricModel(inv.devices, {"c": (reasons,)}, SelfMetrics(), counted=counted)

    def totals(bits: int, t_ns: int) -> dict[str, float]:
        m = np.array([[float(bits)]])
        w = WindowStats(0, 1, (reasons,), {s.name: m for s in STATS}, np.ones((1, 1), np.int64))
        snap = model.snapshot({"c": w}, np.array([True]), t_ns)
        return {
            dict(s.labels)["clock_event"]: v
            for s, v in snap.items()
            if s.name == "DCGM_EXP_CLOCK_EVENTS_TOTAL"
        }

    assert totals(0x4, 1 * S) == {}  # on at the first value: no transition seen
    assert totals(0x4, 2 * S) == {}
    assert totals(0x0, 3 * S) == {}
    assert totals(0x44, 4 * S) == {"power_cap": 1.0, "hw_thermal": 1.0}
    assert totals(0x40, 5 * S) == {"power_cap": 1.0, "hw_thermal": 1.0}
    assert totals(0x44, 6 * S) == {"power_cap": 2.0, "hw_thermal": 1.0}

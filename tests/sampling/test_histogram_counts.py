"""Native histograms counted in the sampling stage: every distinct sample, per GPU and field,
restarted where the series they become restarts (a MIG slot's new instance, a reload)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from histograms_check import V1Histogram, histogram_problems, histogram_quantile
from inprocess import run_plan, start_ns

from hfsampler.fields import BY_NAME, Field
from hfsampler.histograms import NativeHistogram, ResetHint, quantile_error_bound
from hfsampler.remote_write.histwrite import histogram_message
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.histogram_counts import HistogramChoice, HistogramCounter
from hfsampler.sampling.pipeline import RECORD, RUN, Pipeline, Policy, Window
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.stepping import VirtualClock
from hfsampler.sources.base import DeviceInfo

POWER = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
TEMP = "DCGM_FI_DEV_GPU_TEMP"


def _message(h: NativeHistogram):  # type: ignore[no-untyped-def]
    return V1Histogram.FromString(histogram_message(h, 0))


def _windows(policy: Policy, n: int, *histograms: str) -> list[Window]:
    plan = run_plan("--source", "sim", "--gpus", "2")
    plan = replace(plan, config=replace(plan.config, histograms=histograms))
    clock = VirtualClock(start_ns())
    pipeline = Pipeline(plan, policy, clock=clock)
    pipeline.start()
    try:
        pipeline.begin()
        out = []
        for _ in range(n):
            clock.sleep((pipeline.due_ns - clock.now_ns()) / 1e9)
            out.append(pipeline.window())
            pipeline.advance()
        return out
    finally:
        pipeline.close()


def test_every_distinct_sample_of_every_window_is_counted_per_gpu() -> None:
    windows = _windows(RUN, 3, POWER)
    samples: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for k, w in enumerate(windows):
        fast = next(g for g in w.groups if g.plan.name == "fast")
        j = [f.name for f in fast.plan.fields].index(POWER)
        assert {(c.row, c.column) for c in fast.histograms} == {(0, j), (1, j)}
        for c in fast.histograms:
            values = fast.rows.values[:, c.row, j]
            samples[c.row].append(values[~np.isnan(values)])
            seen = np.concatenate(samples[c.row])
            h = c.histogram
            assert h.count == len(seen)  # every distinct sample, repeats (NaN) not
            assert h.sum == pytest.approx(seen.sum())
            assert h.schema == 3  # the default 5 %
            assert h.reset_hint is (ResetHint.YES if k == 0 else ResetHint.NO)
            msg = _message(h)
            assert histogram_problems(msg) == []
            for q in (0.5, 0.99, 0.999):
                exact = float(np.quantile(seen, q))
                got = histogram_quantile(q, msg)
                assert abs(got - exact) <= quantile_error_bound(3) * exact, (q, got, exact)
        # the groups without a histogram field count nothing
        assert all(not g.histograms for g in w.groups if g is not fast)
    # the sim's spikes: the instant power's distribution is wider than any one window's mean
    assert windows[-1].groups[0].histograms[0].histogram.count > 1000


def test_record_and_a_run_without_histograms_count_nothing() -> None:
    for w in _windows(RECORD, 2, POWER) + _windows(RUN, 2):
        assert all(not g.histograms for g in w.groups)


def _device(index: int, **kw: object) -> DeviceInfo:
    return replace(DeviceInfo(index, f"GPU-{index}", "H200", f"0000:0{index}:00.0", "570", index),
                   **kw)  # type: ignore[arg-type]  # fmt: skip


def _rows(values: list[list[list[float]]]) -> RingRows:
    v = np.array(values, dtype=np.float64)
    n = v.shape[0]
    return RingRows(np.arange(n), np.zeros(n, np.int64), v, np.zeros(v.shape, np.int64))


def _counter(devices: list[DeviceInfo], *names: str, schema: int = 3) -> HistogramCounter:
    fields: tuple[Field, ...] = (BY_NAME[POWER], BY_NAME[TEMP])
    return HistogramCounter(
        [GroupPlan("fast", 0.001, fields)], devices, HistogramChoice(frozenset(names), schema)
    )


def _counts(counted: list[list[object]]) -> dict[tuple[int, int], tuple[int, ResetHint]]:
    return {(c.row, c.column): (c.histogram.count, c.histogram.reset_hint)  # type: ignore[attr-defined]
            for c in counted[0]}  # fmt: skip


def test_a_changed_mig_instance_starts_a_new_histogram_and_its_mixed_window_counts_nowhere() -> (
    None
):
    devices = [_device(0), _device(1)]
    counter = _counter(devices, POWER)
    rows = _rows([[[100.0, 40.0], [200.0, 50.0]], [[101.0, 40.0], [float("nan"), 51.0]]])
    no = np.zeros(2, np.bool_)
    assert _counts(counter.count([rows], [None], devices, no)) == {
        (0, 0): (2, ResetHint.YES),
        (1, 0): (1, ResetHint.YES),
    }
    # row 1's device changed inside the next window: its samples are two instances', and the
    # series it had ends (the model's); row 0 goes on
    changed = [devices[0], replace(devices[1], uuid="MIG-other")]
    mixed = np.array([False, True])
    assert _counts(counter.count([rows], [None], changed, mixed)) == {(0, 0): (4, ResetHint.NO)}
    # the window after: the new instance's histogram from its first sample
    assert _counts(counter.count([rows], [None], changed, no)) == {
        (0, 0): (6, ResetHint.NO),
        (1, 0): (1, ResetHint.YES),
    }


def test_a_reload_restarts_only_the_histograms_it_changes() -> None:
    devices = [_device(0)]
    counter = _counter(devices, POWER)
    rows = _rows([[[100.0, 40.0]], [[101.0, 41.0]]])
    no = np.zeros(1, np.bool_)
    counter.count([rows], [None], devices, no)
    counter.choose(HistogramChoice(frozenset({POWER, TEMP}), 3))  # TEMP added: POWER goes on
    assert _counts(counter.count([rows], [None], devices, no)) == {
        (0, 0): (4, ResetHint.NO),
        (0, 1): (2, ResetHint.YES),
    }
    counter.choose(HistogramChoice(frozenset({TEMP}), 3))  # POWER removed, then back: anew
    counter.count([rows], [None], devices, no)
    counter.choose(HistogramChoice(frozenset({POWER, TEMP}), 3))
    assert _counts(counter.count([rows], [None], devices, no)) == {
        (0, 0): (2, ResetHint.YES),
        (0, 1): (6, ResetHint.NO),
    }
    counter.choose(HistogramChoice(frozenset({POWER, TEMP}), 5))  # a new error: every one anew
    assert _counts(counter.count([rows], [None], devices, no)) == {
        (0, 0): (2, ResetHint.YES),
        (0, 1): (2, ResetHint.YES),
    }


def test_only_the_rows_asked_are_counted_and_a_row_without_samples_has_no_histogram() -> None:
    devices = [_device(0), _device(1), _device(2)]
    counter = _counter(devices, POWER, TEMP)
    nan = float("nan")
    rows = _rows([[[100.0, nan], [200.0, 50.0], [300.0, 60.0]]])
    counted = counter.count([rows], [[0, 1]], devices, np.zeros(3, np.bool_))
    assert _counts(counted) == {
        (0, 0): (1, ResetHint.YES),
        (1, 0): (1, ResetHint.YES),
        (1, 1): (1, ResetHint.YES),
    }

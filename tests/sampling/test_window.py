"""Window statistics against numpy's own reductions, on random windows with gaps and repeats."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hfsampler import fields
from hfsampler.sampling.ring import Ring, RingRows
from hfsampler.sampling.window import (
    LAST,
    MAX,
    MEAN,
    MIN,
    P99,
    TickStats,
    WindowClock,
    WindowReader,
    reduce,
)

POWER = fields.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"]
ENERGY = fields.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
REASONS = fields.BY_NAME["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]


def _rows(values: np.ndarray) -> RingRows:
    n = values.shape[0]
    return RingRows(
        np.arange(n, dtype=np.int64),
        np.arange(n, dtype=np.int64) * 10,
        values,
        np.zeros(values.shape, dtype=np.int64),
    )


@given(
    hnp.arrays(
        np.float64,
        st.tuples(st.integers(0, 60), st.integers(1, 3), st.just(1)),
        elements=st.one_of(st.floats(-1e6, 1e6), st.just(np.nan)),
    )
)
def test_gauge_statistics_match_numpy(values: np.ndarray) -> None:
    stats = reduce(_rows(values), [POWER], 0, 1)
    for g in range(values.shape[1]):
        x = values[:, g, 0]
        x = x[~np.isnan(x)]
        assert stats.count[g, 0] == len(x)
        if len(x) == 0:
            assert np.isnan(stats[MEAN][g, 0])
            assert np.isnan(stats[MAX][g, 0])
            continue
        assert stats[MIN][g, 0] == x.min()
        assert stats[MAX][g, 0] == x.max()
        assert stats[LAST][g, 0] == x[-1]
        np.testing.assert_allclose(stats[MEAN][g, 0], x.mean(), rtol=1e-9, atol=1e-6)
        np.testing.assert_allclose(stats[P99][g, 0], np.quantile(x, 0.99), rtol=1e-9, atol=1e-6)


def test_counter_keeps_last_and_bitmask_ors_the_window() -> None:
    values = np.full((5, 1, 2), np.nan)
    values[:, 0, 0] = [10, 11, np.nan, 13, np.nan]
    values[:, 0, 1] = [0, 4, 0, 8, np.nan]
    rows = _rows(values)
    stats, ticks = reduce(rows, [ENERGY, REASONS], 0, 1), TickStats.of(rows)
    assert stats[LAST][0, 0] == 13
    assert stats[LAST][0, 1] == 12  # 4 | 8: both reasons were active at some point
    assert ticks.ticks == 5
    assert ticks.lateness_max_ns == 40


def test_empty_window_has_no_values() -> None:
    stats = reduce(_rows(np.empty((0, 2, 1))), [POWER], 0, 1)
    assert stats.count.tolist() == [[0], [0]]
    assert np.isnan(stats[MEAN]).all()


def test_reader_hands_out_rows_by_window_end() -> None:
    ring = Ring.create(16, 1, 1)
    try:
        reader = WindowReader(ring)
        for t in (5, 15, 25):
            values, _ = ring.slot()
            values[:] = t
            ring.commit(t, 0)
        first = reader.take(10)
        assert first.time_ns.tolist() == [5]
        second = reader.take(20)
        assert second.time_ns.tolist() == [15]
        assert reader.take(30).time_ns.tolist() == [25]
        assert len(reader.take(40)) == 0
    finally:
        ring.close()


def test_reader_after_a_step_back_of_the_wall_clock_hands_out_every_row_before_the_end() -> None:
    """A row read after the clock stepped back sits behind rows past the window's end in the
    ring: it is still the window's, and the rows past the end wait for the next."""
    ring = Ring.create(16, 1, 1)
    try:
        reader = WindowReader(ring)
        for t in (5, 15, 7, 25):  # 7: read after the clock stepped back from 15
            values, driver_ts_us = ring.slot()
            values[:] = t
            driver_ts_us[:] = t  # a new sample each read, not a repeat
            ring.commit(t, 0)
        first = reader.take(10)
        assert first.time_ns.tolist() == [5, 7]
        assert first.values[:, 0, 0].tolist() == [5.0, 7.0]
        second = reader.take(20)
        assert second.time_ns.tolist() == [15]
        assert second.values[:, 0, 0].tolist() == [15.0]
        assert reader.take(30).time_ns.tolist() == [25]
    finally:
        ring.close()


class _Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


def test_clock_ends_windows_on_multiples_and_reads_them_a_grace_later() -> None:
    now = _Clock(10_250_000_000)
    clock = WindowClock(1.0, 0.01, now)
    assert (clock.t0_ns, clock.t1_ns) == (10_250_000_000, 11_000_000_000)  # a short first window
    assert clock.due_ns == 11_010_000_000
    assert clock.wait_s() == pytest.approx(0.76)
    now.now_ns = 11_020_000_000
    assert clock.wait_s() == 0.0
    clock.advance()
    assert (clock.t0_ns, clock.t1_ns) == (11_000_000_000, 12_000_000_000)
    assert clock.catch_up() == 0  # on time: nothing skipped


def test_clock_catches_up_after_a_stall_without_losing_rows() -> None:
    now = _Clock(0)
    clock = WindowClock(1.0, clock_ns=now)
    clock.advance()  # [1 s, 2 s) in progress
    now.now_ns = 4_500_000_000  # stalled past its end and the next
    assert clock.catch_up() == 2
    assert (clock.t0_ns, clock.t1_ns) == (1_000_000_000, 4_000_000_000)  # one window, every row
    offline = WindowClock(1.0, start_ns=7_000_000_000)
    assert (offline.t0_ns, offline.t1_ns) == (7_000_000_000, 8_000_000_000)

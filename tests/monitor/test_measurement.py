"""A span's reductions against the held-signal integral written out plainly, row by row.

``reduce_span`` is vectorised for speed (a running maximum, clipping folded into it, a NaN found
from the integrals' sum); this reference follows measurement.py's definition one value at a
time: missing values, timestamps off the host's clock, a clock stepped back, rows before the
window and after it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hfsampler.monitor.measurement import Layout, counter_energy_j, reduce_span
from hfsampler.sampling.ring import RingCells

T0_NS = 1_780_000_000 * 10**9
SLACK_NS = 1_000_000_000


def reference(
    read_ns: list[int], values: list[list[float]], driver_us: list[list[int]], t0: int, t1: int
) -> list[tuple[float, float, float]]:
    """Per cell: (ns held, value x ns, highest value held), as the docstring defines them."""
    out = []
    for cell_values, cell_driver in zip(values, driver_us, strict=True):
        starts = []
        for host, us in zip(read_ns, cell_driver, strict=True):
            ts = us * 1000
            starts.append(host if abs(ts - host) >= SLACK_NS else ts)
        edges, latest = [], -math.inf
        for e in [*starts, t1]:
            latest = max(latest, min(max(e, t0), t1))
            edges.append(latest)
        held = [b - a for a, b in itertools.pairwise(edges)]
        ns = integral = 0.0
        top = -math.inf
        for v, h in zip(cell_values, held, strict=True):
            if math.isnan(v):
                continue
            ns += h
            integral += v * h
            if h > 0:
                top = max(top, v)
        out.append((ns, integral, top))
    return out


@st.composite
def spans(draw: st.DrawFn) -> tuple[list[int], list[list[float]], list[list[int]], int, int]:
    n = draw(st.integers(1, 40))
    gaps = draw(st.lists(st.integers(0, 3_000_000), min_size=n, max_size=n))
    read_ns = list(np.cumsum(gaps) + T0_NS - 2_000_000)
    cells = 6  # 2 GPUs: power, then memory, then events
    values, driver = [], []
    for c in range(cells):
        row_v, row_d = [], []
        for host in read_ns:
            kind = draw(st.sampled_from(["ok", "ok", "ok", "ok", "nan", "zero", "far", "back"]))
            lag_us = draw(st.integers(0, 4000))
            us = host // 1000 - lag_us
            if kind == "zero":
                us = 0
            elif kind == "far":
                us += 5 * SLACK_NS // 1000
            elif kind == "back":  # a driver clock stepped back a little
                us -= draw(st.integers(0, 10_000))
            v = float("nan") if kind == "nan" else draw(st.floats(0, 1000))
            row_v.append(float(int(v)) if c >= 4 and v == v else v)  # events: whole bits
            row_d.append(us)
        values.append(row_v)
        driver.append(row_d)
    t0 = T0_NS + draw(st.integers(-1_000_000, 1_000_000))
    t1 = t0 + draw(st.integers(0, 200_000_000))
    return read_ns, values, driver, t0, t1


@given(spans())
def test_a_spans_reductions_are_the_held_signal_integral(
    span: tuple[list[int], list[list[float]], list[list[int]], int, int],
) -> None:
    read_ns, values, driver, t0, t1 = span
    expected = reference(read_ns, values, driver, t0, t1)
    rows = RingCells(np.array(read_ns, np.int64), np.array(values), np.array(driver, np.int64))
    got = reduce_span(rows, t0, t1, Layout.of(2, 1, 2))
    for gpu in (0, 1):
        ns, integral, top = expected[gpu]
        assert got.covered_s[gpu] == pytest.approx(ns / 1e9, abs=1e-12)
        assert got.energy_j[gpu] == pytest.approx(integral / 1e9, rel=1e-9, abs=1e-9)
        assert got.peak_w[gpu] == top
        assert got.memory_mib[gpu] == expected[2 + gpu][2]
    bits = got.bits()
    held_events = [expected[4 + gpu][0] for gpu in (0, 1)]
    if bits is not None:  # no reason held longer than its GPU's events were known
        assert (bits.max(axis=0) <= np.array(held_events) + 0.5).all()


def test_the_counters_answer_is_its_mean_power_between_its_values_times_the_window() -> None:
    first = ([1_000.0, 5.0, math.nan], [1_000_000, 1_000_000, 1_000_000])
    last = ([31_000.0, 5.0, 9.0], [1_100_000, 1_000_000, 1_100_000])
    # 30 J over the counter's 100 ms: 300 W, for a 150 ms window 45 J; the second never moved
    # (no span), the third had no value at the start
    assert counter_energy_j(first, last, 150_000_000) == [pytest.approx(45.0), None, None]
    # its values span under half the window: no answer
    assert counter_energy_j(first, last, 250_000_000) == [None, None, None]

"""The window pipeline on the sim, stepped in this process by a virtual clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from inprocess import run_plan, start_ns

from hfsampler.sampling.pipeline import RECORD, RUN, Pipeline, Policy, Window
from hfsampler.sampling.stepping import SteppingSampler, VirtualClock
from hfsampler.sampling.window import MAX
from hfsampler.sources.sim.source import SimSource

S = 10**9
POWER = "DCGM_FI_DEV_POWER_USAGE_INSTANT"


def _pipeline(policy: Policy, start: int) -> tuple[Pipeline, VirtualClock]:
    clock = VirtualClock(start)
    pipeline = Pipeline(run_plan("--source", "sim", "--gpus", "2"), policy, clock=clock)
    pipeline.start()
    return pipeline, clock


def _fast(window: Window) -> int:
    return next(k for k, g in enumerate(window.groups) if g.plan.name == "fast")


def test_each_window_holds_its_ticks_and_the_sims_samples() -> None:
    start = start_ns()
    pipeline, clock = _pipeline(RUN, start)
    try:
        assert pipeline.begin() == start
        windows = []
        for _ in range(3):
            clock.sleep((pipeline.due_ns - clock.now_ns()) / 1e9)
            windows.append(pipeline.window())
            assert pipeline.advance() == 0
    finally:
        pipeline.close()
    first, *rest = windows
    assert (first.t0_ns, first.t1_ns) == (start, start - start % S + S)
    for w in rest:
        assert w.t1_ns - w.t0_ns == S
        fast = w.groups[_fast(w)]
        assert len(fast.rows) == fast.health.ticks == 1000  # a 1 ms tick, never late
        assert fast.ticks.lateness_max_ns == 0
        assert (fast.health.late, fast.health.missed, fast.health.lost_rows) == (0, 0, 0)
        assert not fast.health.stalled_s
        assert w.gpu_up.all()
        assert not w.mixed.any()
    # the window's maximum is the sim's own at the driver timestamps read
    sim = SimSource(2, seed=0)
    w = rest[-1]
    fast = w.groups[_fast(w)]
    j = [f.name for f in fast.plan.fields].index(POWER)
    for gpu in (0, 1):
        ok = ~np.isnan(fast.rows.values[:, gpu, j])
        truth = sim.value_at(POWER, fast.rows.driver_ts_us[ok, gpu, j] * 1000, gpu)
        assert fast.stats[MAX][gpu, j] == pytest.approx(truth.max())


@pytest.mark.parametrize(("policy", "skipped"), [(RUN, 1), (RECORD, 0)])
def test_run_catches_up_after_a_stall_and_record_reads_every_window(
    policy: Policy, skipped: int
) -> None:
    start = start_ns() // S * S
    pipeline, clock = _pipeline(policy, start)
    try:
        pipeline.begin()
        clock.sleep(3.5)  # a loop stalled: the first window is read at 3.5 s
        first = pipeline.window()
        assert pipeline.advance() == skipped
        second = pipeline.window()
    finally:
        pipeline.close()
    assert (first.t0_ns, first.t1_ns) == (start, start + S)
    assert second.t0_ns == start + S
    assert second.t1_ns == start + (2 + skipped) * S  # run's stretches to the current one
    # none of the rows is lost either way: run's second window has them all
    assert len(second.groups[_fast(second)].rows) == (1 + skipped) * 1000


def test_record_drops_what_was_read_before_its_start() -> None:
    start = start_ns()
    for policy, first_rows in ((RECORD, 700), (RUN, 899)):
        pipeline, clock = _pipeline(policy, start - 200_000_000)
        try:
            clock.sleep(0.2)  # sampled while the command set up
            pipeline.begin()
            clock.sleep((pipeline.due_ns - clock.now_ns()) / 1e9)
            w = pipeline.window()
        finally:
            pipeline.close()
        assert len(w.groups[_fast(w)].rows) == first_rows, policy


def test_a_paused_sampler_is_a_stalled_group_then_missed_ticks() -> None:
    start = start_ns() // S * S
    pipeline, clock = _pipeline(RUN, start)
    sampler = pipeline.sampler
    assert isinstance(sampler, SteppingSampler)
    try:
        pipeline.begin()
        found = []
        for k in range(8):
            if k == 1:
                sampler.pause()
            if k == 6:
                sampler.resume()
            clock.sleep((pipeline.due_ns - clock.now_ns()) / 1e9)
            w = pipeline.window()
            found.append(w.groups[_fast(w)].health)
            pipeline.advance()
    finally:
        pipeline.close()
    stalled = [h.stalled_s for h in found]
    # paused from 1 s on: found when it had not ticked for 3 s (STALL_MIN_S), until resumed
    assert [bool(s) for s in stalled] == [False] * 3 + [True] * 3 + [False] * 2
    assert [h.stall_found for h in found] == [False] * 3 + [True] + [False] * 4
    assert found[6].resumed_after_s == pytest.approx(6.0)
    assert sum(h.missed for h in found) == pytest.approx(5000, abs=20)
    assert pipeline.stalled() == []


async def test_windows_end_when_the_sampler_dies() -> None:
    start = start_ns()
    pipeline, clock = _pipeline(RUN, start)
    sampler = pipeline.sampler
    assert isinstance(sampler, SteppingSampler)
    clock.at(start + 2 * S, lambda: sampler.fail("killed by SIGKILL"))
    got = []
    try:
        async for w in pipeline.windows(asyncio.Event(), duration_s=10.0):
            got.append(w.t1_ns)
    finally:
        pipeline.close()
    assert pipeline.died
    assert sampler.exit_reason() == "killed by SIGKILL"
    assert len(got) == 2  # the windows due before it died


async def test_windows_end_at_the_duration_or_when_stopped() -> None:
    start = start_ns()
    pipeline, clock = _pipeline(RUN, start)
    stop = asyncio.Event()
    clock.at(start + 3 * S, stop.set)
    try:
        got = [w.t1_ns async for w in pipeline.windows(stop, duration_s=10.0)]
    finally:
        pipeline.close()
    assert not pipeline.died
    assert len(got) == 3
    assert clock.now_ns() == start + 3 * S

"""The sampler's two lanes: a slow read on the slow lane leaves the fast lane ticking.

The slow calls are real waits with the GIL released (the fake NVML's and the sim's read costs,
``time.sleep`` inside the call), as a ctypes call into the driver releases it. Where one thread
did every group, no fast tick could land while a slow call ran; with two lanes they keep coming.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pynvml
import pytest
from fake_nvml import FakeNvml, every, install, make_fake

from hfsampler import fields as F
from hfsampler.errors import SourceError
from hfsampler.fields import Field
from hfsampler.sampling.groups import GroupPlan, plan_groups
from hfsampler.sampling.lanes import SLOW_LANE_THREAD, STOP, run_lanes
from hfsampler.sampling.plan import discover
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.sampler import Sampler
from hfsampler.sources.base import Source, SourceSpec
from hfsampler.sources.nvml.source import NvmlSource
from hfsampler.sources.sim.source import SimSource

# It measures the machine's time (lateness, deadlines, rates): it runs alone.
pytestmark = pytest.mark.alone

INSTANT = F.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"]
SM_CLOCK = F.BY_NAME["DCGM_FI_DEV_SM_CLOCK"]
ECC = F.BY_NAME["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"]
GPU_TEMP = F.BY_NAME["DCGM_FI_DEV_GPU_TEMP"]
ENERGY = F.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
VIOLATION = F.BY_NAME["DCGM_FI_DEV_POWER_VIOLATION"]
SLOW_CALL_S = 0.005


def _wait(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class Lanes:
    """``run_lanes`` on a thread of this process, over a source opened here (the fake's)."""

    def __init__(self, sampler: Sampler, src: Source) -> None:
        self.sampler = sampler
        assert sampler.status is not None
        self.s = sampler.status.array
        rings = [sampler.rings[g.name] for g in sampler.groups]
        self.error: BaseException | None = None

        def run() -> None:
            try:
                run_lanes(sampler.plan, src, rings, self.s, os.getpid())
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.s[STOP] = 1
        self.thread.join(10)
        assert not self.thread.is_alive()


def _rows(sampler: Sampler, name: str) -> RingRows:
    _, rows, lost = sampler.rings[name].read_since(0)
    assert lost == 0
    return rows


def _fast_ticks_during(fast: RingRows, slow: RingRows, seconds: float) -> npt.NDArray[np.intp]:
    """Per slow read, the fast ticks that read inside it (a read starts at its row's time)."""
    t, starts = fast.time_ns, slow.time_ns
    inside: npt.NDArray[np.intp] = np.searchsorted(
        t, starts + int(seconds * 1e9)
    ) - np.searchsorted(t, starts, "right")
    return inside


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return install(monkeypatch, make_fake(2))


@pytest.fixture
def nvml() -> Iterator[NvmlSource]:
    s = NvmlSource()
    yield s
    s.close()


def _nvml_sampler(src: NvmlSource, groups: Sequence[tuple[str, float, Sequence[Field]]]) -> Sampler:
    inventory = src.open([f for _, _, fs in groups for f in fs])
    plans = [GroupPlan(name, interval, tuple(fs)) for name, interval, fs in groups]
    return Sampler(SourceSpec("nvml"), inventory, plans, window_s=4.0, spin_s=0.0)


def test_a_slow_nvml_call_does_not_hold_up_the_fast_lane(fake: FakeNvml, nvml: NvmlSource) -> None:
    """An ECC read that takes 5 ms every 20 ms: the 1 ms ticks go on while it waits."""
    fake.gpus[0].field_cost_s[pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL] = SLOW_CALL_S
    fake.costs["nvmlDeviceGetFieldValues"] = 20e-6  # every batched read takes a little
    with _nvml_sampler(nvml, [("fast", 0.001, [INSTANT, SM_CLOCK]), ("slow", 0.02, [ECC])]) as s:
        lanes = Lanes(s, nvml)
        _wait(lambda: s.counters(1).ticks >= 40)
        lanes.stop()
        assert lanes.error is None
        fast, slow = _rows(s, "fast"), _rows(s, "slow")
        assert s.counters(0).ticks == len(fast)
        assert s.counters(1).ticks == len(slow)
    slow_calls = [sec for name, sec in fake.slept if sec == SLOW_CALL_S]
    assert len(slow_calls) >= 40
    during = _fast_ticks_during(fast, slow, SLOW_CALL_S)
    # one thread for both groups: no fast tick inside any slow read; here about five in each
    assert np.mean(during >= 2) >= 0.8, during.tolist()
    assert not np.isnan(fast.values[:, :, 0]).all()  # the fast lane read real values


def test_the_slow_lane_keeps_each_groups_deadlines(fake: FakeNvml, nvml: NvmlSource) -> None:
    groups = [("fast", 0.001, [INSTANT]), ("slow", 0.01, [GPU_TEMP]), ("gpm", 0.025, [ECC])]
    with _nvml_sampler(nvml, groups) as s:
        lanes = Lanes(s, nvml)
        _wait(lambda: s.counters(2).ticks >= 20)
        lanes.stop()
        assert lanes.error is None
        for k, (name, interval, _) in enumerate(groups[1:], start=1):
            rows = _rows(s, name)
            steps = np.diff(rows.time_ns) / 1e9
            assert abs(np.median(steps) - interval) < interval / 5
            c = s.counters(k)
            assert c.ticks == len(rows)
            assert c.late <= c.ticks


def test_a_failing_slow_lane_ends_the_sampler_with_its_error(
    fake: FakeNvml, nvml: NvmlSource
) -> None:
    inventory = nvml.open([INSTANT])
    groups = [GroupPlan("fast", 0.001, (INSTANT,)), GroupPlan("slow", 0.01, (GPU_TEMP,))]
    with Sampler(SourceSpec("nvml"), inventory, groups, window_s=1.0, spin_s=0.0) as s:
        lanes = Lanes(s, nvml)  # GPU_TEMP was never opened: the slow lane's read raises
        lanes.thread.join(10)
        assert not lanes.thread.is_alive()
        assert isinstance(lanes.error, SourceError)
        assert "DCGM_FI_DEV_GPU_TEMP was not opened" in str(lanes.error)


def test_every_n_th_call_is_the_slow_one(fake: FakeNvml) -> None:
    cost = every(3, 0.004, 0.001)
    assert [cost(n) for n in range(1, 7)] == [0.001, 0.001, 0.004, 0.001, 0.001, 0.004]


# -- the sources, read from two threads at once ----------------------------------------------------


def _read_many(src: Source, fields: tuple[Field, ...], times: Sequence[int]) -> np.ndarray:
    gpus = len(src.gpu_up)
    out = np.empty((len(times), gpus, len(fields)))
    driver = np.empty((gpus, len(fields)), np.int64)
    for k, t in enumerate(times):
        src.read(fields, out[k], driver, t)
    return out


def _concurrently(*jobs: object) -> list[np.ndarray]:
    results: list[np.ndarray] = [np.empty(0)] * len(jobs)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = jobs[k]()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    return results


def test_sim_reads_of_two_field_sets_at_once_are_as_one_at_a_time() -> None:
    """Each field set keeps its own rows and counters: threads do not mix them."""
    fast = (INSTANT, SM_CLOCK, ENERGY)
    slow = (GPU_TEMP, VIOLATION, ENERGY)
    t0 = 1_800_000_000 * 1_000_000_000
    ms = [t0 + k * 1_000_000 for k in range(3000)]
    tens = [t0 + k * 7_000_000 for k in range(400)]
    alone = SimSource(4, seed=3)
    want = [_read_many(alone, fast, ms), _read_many(alone, slow, tens)]
    both = SimSource(4, seed=3)
    got = _concurrently(lambda: _read_many(both, fast, ms), lambda: _read_many(both, slow, tens))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(w, g)


def test_nvml_reads_of_two_field_sets_at_once_count_every_error(
    fake: FakeNvml, nvml: NvmlSource
) -> None:
    """Error counts and GPUs up are shared by the field sets: no count is lost between threads."""
    nvml.open([INSTANT, SM_CLOCK, ECC, GPU_TEMP])
    fake.gpus[1].fields[pynvml.NVML_FI_DEV_POWER_INSTANT].ret = pynvml.NVML_ERROR_UNKNOWN
    fake.gpus[1].fields[pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL].ret = pynvml.NVML_ERROR_UNKNOWN
    times = [7_000_000_000 + k * 1_000_000 for k in range(1500)]
    fast, slow = _concurrently(
        lambda: _read_many(nvml, (INSTANT, SM_CLOCK), times),
        lambda: _read_many(nvml, (ECC, GPU_TEMP), times),
    )
    assert nvml.read_errors.tolist() == [0, 2 * len(times)]
    assert nvml.gpu_up.tolist() == [True, True]  # an entry's error is not the GPU's
    assert np.isnan(fast[:, 1, 0]).all()
    assert not np.isnan(fast[:, 0, 0]).any()
    assert not np.isnan(slow[:, :, 1]).any()


# -- the sampler process -----------------------------------------------------------------------


def test_a_slow_read_in_the_sampler_process_leaves_fast_ticks_coming() -> None:
    """The sim's ECC read takes 5 ms on the slow lane of a real sampler process."""
    spec = SourceSpec("sim", gpus=2, seed=1, sim_read_cost_s=((ECC.name, SLOW_CALL_S),))
    inventory = discover(spec, F.CATALOGUE)
    groups = plan_groups(inventory.fields, {"fast": 0.001, "slow": 0.02, "gpm": 0.1})
    with Sampler(spec, inventory, groups, window_s=4.0, spin_s=0.0) as s:
        s.start()
        _wait(lambda: s.counters(1).ticks >= 40)
        fast, slow = _rows(s, "fast"), _rows(s, "slow")
        gpm = s.counters(2)
    assert gpm.ticks >= 5  # the gpm group ticks on the slow lane too,
    assert gpm.late <= gpm.ticks // 2  # away from the slow group's 5 ms reads
    during = _fast_ticks_during(fast, slow, SLOW_CALL_S)
    assert np.mean(during >= 2) >= 0.8, during.tolist()


def _policy(task: Path) -> int:
    """A thread's scheduling policy, from /proc (field 41 of stat)."""
    stat = (task / "stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[38])


def _priority(task: Path) -> int:
    """A thread's real-time priority, from /proc (field 40 of stat; 0: the normal scheduler)."""
    stat = (task / "stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[37])


def test_the_threads_that_take_the_gil_share_the_fast_lanes_priority() -> None:
    """The slow lane runs at the fast lane's real-time priority, so the kernel never preempts it
    for a normal process while it holds the GIL the fast lane waits for; no thread outranks the
    fast lane, and the threads that do not take the GIL (numpy's) stay normal."""
    spec = SourceSpec("sim", gpus=1, seed=1)
    inventory = discover(spec, F.CATALOGUE)
    groups = plan_groups(inventory.fields, {"fast": 0.001, "slow": 0.1, "gpm": 0.1})
    with Sampler(spec, inventory, groups, window_s=1.0, spin_s=0.0, realtime_priority=1) as s:
        s.start()
        if s.realtime_priority == 0:
            pytest.skip("SCHED_FIFO refused here (no CAP_SYS_NICE)")
        _wait(lambda: s.counters(1).ticks >= 2)
        pid = s.pid
        assert pid is not None
        tasks = {int(p.name): _policy(p) for p in Path(f"/proc/{pid}/task").iterdir()}
        priorities = {int(p.name): _priority(p) for p in Path(f"/proc/{pid}/task").iterdir()}
        names = {int(p.name): (p / "comm").read_text().strip()
                 for p in Path(f"/proc/{pid}/task").iterdir()}  # fmt: skip
    assert tasks.pop(pid) == os.SCHED_FIFO  # the main thread: the fast lane
    fast_priority = priorities.pop(pid)
    assert fast_priority == 1
    slow = [t for t, name in names.items() if name == SLOW_LANE_THREAD]
    assert len(slow) == 1, names  # the slow lane by its name, not any other thread numpy made
    assert tasks.pop(slow[0]) == os.SCHED_FIFO
    assert priorities[slow[0]] == fast_priority
    assert max(priorities.values()) <= fast_priority
    # the sim's helper (started from the fast lane, keeping its priority) at most; numpy's normal
    assert sum(t == os.SCHED_FIFO for t in tasks.values()) <= 1, (tasks, names)


def test_a_read_stuck_at_shutdown_is_said_and_the_process_leaves_without_crashing() -> None:
    """A slow-lane read the driver does not return from (here 30 s) when the sampler must stop:
    the source and rings stay open under it, the process exits with its own status and the
    reason reaches the parent, instead of a segfault in a read writing to an unmapped ring."""
    spec = SourceSpec("sim", gpus=1, seed=1, sim_read_cost_s=((GPU_TEMP.name, 30.0),))
    inventory = discover(spec, F.CATALOGUE)
    groups = plan_groups(inventory.fields, {"fast": 0.001, "slow": 0.1, "gpm": 0.1})
    with Sampler(spec, inventory, groups, window_s=1.0, spin_s=0.0) as s:
        s.start()
        _wait(lambda: s.counters(0).ticks >= 200)  # the slow lane is in its first read by now
        started = time.monotonic()
        s.stop(timeout_s=10.0)
        took = time.monotonic() - started
        reason = s.exit_reason()
    assert reason is not None
    assert "still in a read of group slow" in reason, reason
    assert took < 10.0  # it left by itself: not killed at the end of the wait


def test_under_chrt_the_fast_lane_keeps_the_higher_priority_and_no_thread_outranks_it() -> None:
    """Started under ``chrt -f 10`` (the process inherits FIFO 10): the fast lane keeps 10 rather
    than dropping to the configured 1, the slow lane shares it, and numpy's BLAS threads (which
    inherited it) run at the normal scheduler."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, OSError):
        pytest.skip("SCHED_FIFO refused here (no CAP_SYS_NICE)")
    try:
        spec = SourceSpec("sim", gpus=1, seed=1)
        inventory = discover(spec, F.CATALOGUE)
        groups = plan_groups(inventory.fields, {"fast": 0.001, "slow": 0.1, "gpm": 0.1})
        with Sampler(spec, inventory, groups, window_s=1.0, spin_s=0.0, realtime_priority=1) as s:
            s.start()
            _wait(lambda: s.counters(1).ticks >= 2)
            pid = s.pid
            assert pid is not None
            assert s.realtime_priority == 10
            tasks = {int(p.name): _policy(p) for p in Path(f"/proc/{pid}/task").iterdir()}
            priorities = {int(p.name): _priority(p) for p in Path(f"/proc/{pid}/task").iterdir()}
            names = {int(p.name): (p / "comm").read_text().strip()
                     for p in Path(f"/proc/{pid}/task").iterdir()}  # fmt: skip
            assert os.sched_getparam(pid).sched_priority == 10
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    assert tasks.pop(pid) == os.SCHED_FIFO
    slow = [t for t, name in names.items() if name == SLOW_LANE_THREAD]
    assert len(slow) == 1, names
    assert (tasks.pop(slow[0]), priorities[slow[0]]) == (os.SCHED_FIFO, 10)
    assert max(priorities.values()) <= 10
    assert len(tasks) >= 2  # numpy's threads, and the sim's helper
    # the sim's helper (started from the fast lane, keeping its priority) at most; numpy's normal
    assert sum(t == os.SCHED_FIFO for t in tasks.values()) <= 1, (tasks, names)
    assert os.SCHED_OTHER in tasks.values(), tasks

"""The Monitor on GPUs whose power is known: exact energy, spikes, throttling, keys, sources.

Most tests run on a ``VirtualClock``: the Monitor's pipeline then samples the fake NVML (or the
sim) in this process as the clock moves, one millisecond per move, so a 2 s window takes no
2 s. The fake's driver clock is the virtual one.
"""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest
from fake_nvml import install, make_fake, remove_library
from known_power import MS_NS, KnownPower

from hfsampler import Measurement, Monitor, markers
from hfsampler.config.settings import Config
from hfsampler.errors import ConfigError, DriverNotFoundError, NoPermissionError
from hfsampler.fields import POWER_INSTANT
from hfsampler.monitor.measurement import HISTOGRAM_BINS, Span
from hfsampler.monitor.monitor import LongWindowWarning, WindowTooLongError
from hfsampler.monitor.running import Missed, RunningStats
from hfsampler.profiling.job_markers import MarkerSocket
from hfsampler.sampling.ring import SHM_DIR_ENV
from hfsampler.sampling.stepping import VirtualClock
from hfsampler.sources.nvml import calls
from hfsampler.sources.sim.source import SimSource

START_NS = 1_780_000_000 * 10**9  # a whole second
SECONDS = 6.0


def run_ms(clock: VirtualClock, ms: int) -> None:
    """Move the clock ``ms`` milliseconds, one tick at a time (the fake reads the clock's now)."""
    for _ in range(ms):
        clock.sleep(0.001)


@pytest.fixture
def known(monkeypatch: pytest.MonkeyPatch) -> tuple[KnownPower, VirtualClock]:
    truth = KnownPower(START_NS, SECONDS)
    clock = VirtualClock(START_NS)
    fake = truth.fake()
    fake.clock_us = lambda: clock.now_ns() // 1000
    install(monkeypatch, fake)
    return truth, clock


@pytest.fixture
def mon(known: tuple[KnownPower, VirtualClock]) -> Monitor:
    _, clock = known
    with Monitor(source="nvml", clock=clock, env={}, history_s=4.0) as m:
        run_ms(clock, 50)  # some history before the first window
        yield m


def test_two_second_windows_are_within_one_percent_of_the_exact_energy(
    known: tuple[KnownPower, VirtualClock], mon: Monitor
) -> None:
    truth, clock = known
    clock.sleep(0.0004)  # windows need not start on a tick
    t0 = clock.now_ns()
    mon.begin_window("a")
    run_ms(clock, 1000)
    mon.begin_window("b")  # overlapping windows
    run_ms(clock, 1000)
    a = mon.end_window("a")
    run_ms(clock, 1000)
    b = mon.end_window("b")
    t1 = clock.now_ns()
    assert a.time == pytest.approx(2.0)
    assert b.time == pytest.approx(2.0)
    for gpu in (0, 1):
        exact_a = truth.truth_j(gpu, t0, t0 + 2 * 10**9)
        exact_b = truth.truth_j(gpu, t0 + 10**9, t1)
        assert a.gpu_energy[gpu] == pytest.approx(exact_a, rel=0.01)
        assert b.gpu_energy[gpu] == pytest.approx(exact_b, rel=0.01)
        assert a.gpu_mean_power[gpu] == pytest.approx(exact_a / 2.0, rel=0.01)
        # the driver's counter agrees, to its 100 ms steps
        assert a.gpu_energy_counter[gpu] == pytest.approx(exact_a, rel=0.05)
    assert a.total_energy == pytest.approx(sum(a.gpu_energy.values()))
    assert a.gpu_energy[1] > a.gpu_energy[0]  # GPU 1 draws 30 W more: the GPUs are told apart


def test_a_window_around_a_5ms_spike_shows_its_peak_and_energy(
    known: tuple[KnownPower, VirtualClock], mon: Monitor
) -> None:
    truth, clock = known
    t0 = clock.now_ns() + (430 + 40 + 2) * MS_NS  # the spike window's start
    spike_at = t0 + 18 * MS_NS
    baseline_j = truth.truth_j(0, t0, t0 + 40 * MS_NS)
    truth.spike(0, spike_at, 5, 900.0)
    exact_j = truth.truth_j(0, t0, t0 + 40 * MS_NS)
    run_ms(clock, 430)
    with mon.window("between spikes") as quiet:
        run_ms(clock, 40)
    run_ms(clock, 2)
    assert clock.now_ns() == t0
    with mon.window("spike") as w:
        run_ms(clock, 40)
    m = w.measurement
    assert isinstance(m, Measurement)
    assert isinstance(quiet.measurement, Measurement)
    assert m.gpu_peak_power[0] == pytest.approx(900.0)
    assert m.gpu_energy[0] == pytest.approx(exact_j, rel=0.01)
    assert m.gpu_energy[0] - baseline_j == pytest.approx(exact_j - baseline_j, rel=0.10)
    assert m.gpu_peak_power[1] < 400.0  # GPU 1 had no spike
    assert quiet.measurement.gpu_peak_power[0] < 400.0
    assert quiet.measurement.time == pytest.approx(0.04)


def test_a_span_ending_in_the_future_or_before_it_begins_is_refused_not_extrapolated(
    known: tuple[KnownPower, VirtualClock], mon: Monitor
) -> None:
    """measure() of a span whose end has not come yet would hold the last samples until then
    (energy for time not yet spent); one ending before it begins has a negative time."""
    _, clock = known
    run_ms(clock, 100)
    now = clock.now_ns()
    with pytest.raises(ValueError, match="in the future"):
        mon.measure(now - 50 * MS_NS, now + 1000 * MS_NS)
    with pytest.raises(ValueError, match="ends before it begins"):
        mon.measure(now - 10 * MS_NS, now - 20 * MS_NS)
    assert mon.measure(now - 50 * MS_NS, now).time == pytest.approx(0.05)


def test_throttling_and_memory_are_measured_per_gpu(
    known: tuple[KnownPower, VirtualClock], mon: Monitor
) -> None:
    truth, clock = known
    truth.throttle(1, clock.now_ns() + 10 * MS_NS, 25)
    with mon.window("w") as w:
        run_ms(clock, 100)
    m = w.measurement
    assert m is not None
    assert m.gpu_throttled_time[1] == {"sw_power_cap": pytest.approx(0.025)}
    assert m.gpu_throttled_time[0] == {}
    # the standard fake's memory: (10 + ms % 7) GiB, so 16 GiB at its highest
    assert m.gpu_memory_high_water_mib[0] == pytest.approx(16 * 1024)
    assert 250.0 <= m.gpu_p99_power[0] <= m.gpu_peak_power[0]


def test_the_p99_and_throttled_time_made_on_first_use_read_as_plain_mappings(
    known: tuple[KnownPower, VirtualClock], mon: Monitor
) -> None:
    truth, clock = known
    truth.throttle(0, clock.now_ns() + 5 * MS_NS, 10)
    with mon.window("w") as w:
        run_ms(clock, 30)
    m = w.measurement
    assert m is not None
    assert m.gpu_throttled_time == {0: {"sw_power_cap": pytest.approx(0.010)}, 1: {}}
    assert sorted(m.gpu_p99_power) == [0, 1]
    assert len(m.gpu_p99_power) == 2
    assert repr(m.gpu_p99_power) == repr(dict(m.gpu_p99_power))
    assert pickle.loads(pickle.dumps(m)) == m
    assert all(m.gpu_p99_power[g] <= m.gpu_peak_power[g] for g in (0, 1))


def test_ending_a_key_never_begun_is_a_key_error(mon: Monitor) -> None:
    with pytest.raises(KeyError, match="never begun"):
        mon.end_window("nope")
    mon.begin_window("x")
    with pytest.raises(ValueError, match="open already"):
        mon.begin_window("x")
    mon.end_window("x")
    with pytest.raises(KeyError):
        mon.end_window("x")


def test_windows_from_threads_at_once(known: tuple[KnownPower, VirtualClock], mon: Monitor) -> None:
    _, clock = known
    keys = [f"thread {k}" for k in range(8)]
    threads = [threading.Thread(target=mon.begin_window, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run_ms(clock, 20)
    got: dict[str, Measurement] = {}
    threads = [threading.Thread(target=lambda k=k: got.update({k: mon.end_window(k)}))
               for k in keys]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == keys
    assert len({m.gpu_energy[0] for m in got.values()}) == 1  # the same span, the same energy


def test_a_window_longer_than_the_history_is_answered_from_running_statistics(
    known: tuple[KnownPower, VirtualClock],
) -> None:
    truth, clock = known
    with Monitor(source="nvml", clock=clock, env={}, history_s=1.0) as mon:
        run_ms(clock, 3)
        truth.spike(0, clock.now_ns() + 300 * MS_NS, 5, 950.0)  # long gone from the rings
        truth.throttle(1, clock.now_ns() + 200 * MS_NS, 40)
        t0 = clock.now_ns()
        mon.begin_window("epoch")
        mon.begin_window("step")
        run_ms(clock, 20)
        mon.end_window("step")  # a window ended between passes leaves nothing behind
        run_ms(clock, 2500)
        with pytest.warns(LongWindowWarning, match="longer than the 1 s of samples"):
            m = mon.end_window("epoch")
        t1 = clock.now_ns()
        with pytest.raises(WindowTooLongError, match=r"history_s=\d+"):
            mon.measure(t0, t1)  # a span alone, without running statistics: refused
    assert not m.exact
    k0, k1 = truth.ms(t0), truth.ms(t1)
    for gpu in (0, 1):
        assert m.gpu_energy[gpu] == pytest.approx(truth.truth_j(gpu, t0, t1), rel=1e-6)
        held = truth.power_w[gpu, k0:k1]
        assert m.gpu_peak_power[gpu] == pytest.approx(held.max(), abs=1e-3)
        assert abs(m.gpu_p99_power[gpu] - np.percentile(held, 99)) <= 1.0
    assert m.gpu_peak_power[0] == pytest.approx(950.0)
    assert m.gpu_throttled_time[1] == {"sw_power_cap": pytest.approx(0.040)}
    assert m.gpu_energy_counter == {0: None, 1: None}


def test_gpu_indices_follow_cuda_visible_devices_and_local_rank(
    known: tuple[KnownPower, VirtualClock],
) -> None:
    truth, clock = known
    uuid1 = "GPU-00000001-1111-2222-3333-444455556666"
    with Monitor(source="nvml", clock=clock, env={"CUDA_VISIBLE_DEVICES": uuid1}) as m:
        assert list(m.gpus) == [0]  # cuda:0 is NVML's GPU 1
        run_ms(clock, 5)
        t0 = clock.now_ns()
        m.begin_window("w")
        run_ms(clock, 100)
        got = m.end_window("w").gpu_energy[0]
        assert got == pytest.approx(truth.truth_j(1, t0, clock.now_ns()), rel=0.01)
    with Monitor(source="nvml", clock=clock, env={"LOCAL_RANK": "1"}) as m:
        assert list(m.gpus) == [1]
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        Monitor(source="nvml", clock=clock, env={"CUDA_VISIBLE_DEVICES": "7"})


def test_sim_windows_match_the_sims_own_truth() -> None:
    clock = VirtualClock(START_NS)
    config = Config(sim_gpus=2, seed=3)
    sim = SimSource(gpus=2, seed=3)
    # CUDA_VISIBLE_DEVICES names real GPUs: the simulated ones are all there
    env = {"CUDA_VISIBLE_DEVICES": "GPU-8a2c1e6f"}
    with Monitor(source="sim", config=config, clock=clock, env=env) as mon:
        assert list(mon.gpus) == [0, 1]
        run_ms(clock, 10)
        t0 = clock.now_ns()
        mon.begin_window("w")
        clock.sleep(2.0)  # the sim needs no per-tick clock: it reads at each tick's time
        m = mon.end_window("w")
    ms = np.arange(t0 // MS_NS, clock.now_ns() // MS_NS) * MS_NS
    for gpu in (0, 1):
        exact = float(sim.value_at(POWER_INSTANT.name, ms, gpu).sum()) * 1e-3
        assert m.gpu_energy[gpu] == pytest.approx(exact, rel=0.01)
        peak = float(sim.value_at(POWER_INSTANT.name, ms, gpu).max())
        assert m.gpu_peak_power[gpu] == pytest.approx(peak)


def test_no_gpu_is_an_error_that_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    remove_library(monkeypatch)
    with pytest.raises(DriverNotFoundError, match=r"libnvidia-ml.*source='sim'"):
        Monitor()


def test_no_permission_is_an_error_that_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake(1)
    fake.init_error = calls.NO_PERMISSION
    install(monkeypatch, fake)
    with pytest.raises(NoPermissionError, match=r"no permission.*/dev/nvidia"):
        Monitor(source="nvml")


def test_no_room_in_dev_shm_is_an_error_that_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SHM_DIR_ENV, "/nonexistent-shm-dir")
    with pytest.raises(ConfigError, match=r"nonexistent-shm-dir.*mount a writable tmpfs"):
        Monitor(source="sim", clock=VirtualClock(START_NS), env={})


def test_under_record_each_window_is_a_phase_with_the_same_edges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = VirtualClock(time.time_ns())  # the recorder takes markers of about now only
    inbox = MarkerSocket()  # what `hfsampler record` names to its job
    monkeypatch.setenv(markers.ENV, str(inbox.path))
    try:
        with Monitor(source="sim", clock=clock, env={}) as mon:
            t0 = clock.now_ns()
            with mon.window("eval"):
                run_ms(clock, 10)
            t1 = clock.now_ns()
        deadline = time.monotonic() + 30
        while inbox.received + inbox.rejected < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        got = [(m.kind, m.name, m.t_ns) for m in inbox.drain()]
    finally:
        inbox.close()
    assert got == [("begin", "eval", t0), ("end", "eval", t1)]


def test_running_statistics_a_pass_could_not_read_are_missed() -> None:
    """A pass after the rings moved past the pass before (the reduce finds nothing) leaves the
    open windows without running statistics: ``end_window`` refuses them then."""
    spans = iter([None, None, None])
    running = RunningStats(lambda t0, t1: next(spans), 0)
    running.advance(10, {"w": 5})
    running.advance(20, {"w": 5})
    assert isinstance(running.claim("w", 5, 20), Missed)
    assert isinstance(running.claim("never", 0, 20), Missed)


def _rings_hold(held_s: float, reduction_s: float, now: list[int]) -> object:
    """A pass's reduce whose rings hold ``held_s`` before the pass, each reduction taking
    ``reduction_s`` on the clock ``now`` (no sleep: the clock is moved)."""
    zero, none = np.zeros(2), np.full(2, -np.inf)

    def reduce(t0_ns: int, t1_ns: int) -> Span | None:
        now[0] += int(reduction_s * 1e9)
        if t1_ns - t0_ns > held_s * 1e9:
            return None
        return Span(zero, zero, none, none, None, zero, None, np.zeros((2, HISTOGRAM_BINS)))

    return reduce


def test_windows_a_slow_pass_left_without_running_statistics_are_refused_naming_it() -> None:
    """10,000 windows begun at once: the next pass reduces each from its begin, one by one, for
    longer than the rings hold; the refusal names that cause and its fix, not the history."""
    now = [0]
    running = RunningStats(_rings_hold(60.0, 0.01, now), 0, lambda: now[0])
    windows = {k: 1_000_000 * k for k in range(10_000)}
    now[0] = 15 * 10**9
    running.advance(now[0], windows)  # 100 s of reductions
    now[0] += 15 * 10**9
    running.advance(now[0], windows)  # 130 s since the pass before: the rings hold 60
    missed = running.claim(7, windows[7], now[0])
    assert isinstance(missed, Missed)
    assert (missed.gap_s, missed.took_s, missed.begun) == (
        pytest.approx(115.0, abs=0.1),
        pytest.approx(100.0, abs=0.1),
        10_000,
    )
    cause = missed.cause(15.0, "give history_s")
    assert "took 100.0 s, reducing the 10000 windows begun" in cause
    assert "keep fewer windows open at once" in cause
    assert "history_s" not in cause
    assert isinstance(running.claim(7, windows[7], now[0]), Missed)  # claimed once


def test_windows_a_late_pass_left_without_running_statistics_are_refused_naming_the_gil() -> None:
    now = [0]
    running = RunningStats(_rings_hold(60.0, 0.001, now), 0, lambda: now[0])
    now[0] = 15 * 10**9
    running.advance(now[0], {"epoch": 10})
    now[0] = 90 * 10**9  # no pass for 75 s: the job held the GIL
    running.advance(now[0], {"epoch": 10})
    cause = running.claim("epoch", 10, now[0])
    assert isinstance(cause, Missed)
    text = cause.cause(15.0, "give Monitor(history_s=240)")
    assert "no pass of them ran for 75.0 s" in text
    assert "GIL" in text
    assert "give Monitor(history_s=240)" in text
    # a window begun since the last pass, which has not come: the same cause, said as it stands
    late = running.claim("later", 95 * 10**9, 170 * 10**9)
    assert isinstance(late, Missed)
    assert "ran for 80.0 s" in late.cause(15.0, "give history_s")

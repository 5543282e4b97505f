"""The Monitor's reducer process: its answers are the rings' as read in the job, and faults in it
(killed, stopped, a job that never reads its windows, Ctrl-C to the process group) lose no window.

Real processes: the reducer is a process spawned beside the sampler, mapping the same rings, and
what these check is that hand-over (a pipe, a thread taking the answers off it, signals), which
no fake shows. Each run is short: a second or two of sampling on the sim source.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from hfsampler import Monitor
from hfsampler.monitor.measurement import Measurement
from hfsampler.sampling.ring import SHM_DIR_ENV


@pytest.fixture
def mon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Monitor]:
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    with Monitor(source="sim", env={}, history_s=10.0) as monitor:
        yield monitor


def reducer_pid(mon: Monitor) -> int:
    reducer = mon._reducer
    assert reducer is not None
    assert reducer.pid is not None
    return reducer.pid


def answered_window(mon: Monitor, name: str = "after", length_s: float = 0.01) -> float:
    """A window of ``length_s`` measured and read: its energy (the reducer answers, or the job
    does for it)."""
    with mon.window(name) as w:
        time.sleep(length_s)
    assert w.measurement is not None
    return w.measurement.total_energy


def numbers(m: object) -> list[float]:
    """Every number of a Measurement, in a fixed order (NaN as None, to compare)."""
    out: list[float] = []
    for name in ("gpu_energy", "gpu_mean_power", "gpu_peak_power", "gpu_p99_power",
                 "gpu_memory_high_water_mib", "gpu_energy_counter"):  # fmt: skip
        for _, v in sorted(getattr(m, name).items()):
            out.append(v)
    for _, reasons in sorted(m.gpu_throttled_time.items()):  # type: ignore[attr-defined]
        out.extend(v for _, v in sorted(reasons.items()))
    return out


def test_the_reducers_answers_are_the_rings_as_read_in_the_job(mon: Monitor) -> None:
    """Spans of every length the rings hold, measured through the reducer, and the same spans
    reduced in this process from the same rings: the same numbers, to the last bit."""
    time.sleep(1.5)
    now = time.time_ns()
    spans = [(now - d_ns - length_ns, now - d_ns)
             for length_ns in (2_000_000, 40_000_000, 300_000_000, 1_000_000_000)
             for d_ns in (0, 7_000_000, 150_000_000)]  # fmt: skip
    asked = [mon.measure(t0, t1) for t0, t1 in spans]
    for (t0, t1), m in zip(spans, asked, strict=True):
        here = mon._reader.answer(t0, t1)
        assert here is not None
        assert m.total_energy > 0
        assert numbers(m) == numbers(_as_measurement(mon, here, t1 - t0))


def _as_measurement(mon: Monitor, answer: object, length_ns: int) -> object:
    from hfsampler.monitor.measurement import Answer, Measurement

    assert isinstance(answer, Answer)
    return Measurement.of(answer, length_ns / 1e9, mon._indices)


def test_windows_never_read_neither_pile_up_nor_block_the_job(mon: Monitor) -> None:
    """A job that ends windows far faster than the reducer reduces them, and never reads them
    (logging only some steps): nothing is kept for them in the job, and the windows after them
    are answered as ever, once the reducer has caught up."""
    for k in range(3000):
        mon.begin_window(k)
        mon.end_window(k)
    for k in range(3):
        assert answered_window(mon, f"last {k}", 0.02) > 0


def test_a_killed_reducer_leaves_every_window_answered_in_the_job_said_once(
    mon: Monitor,
) -> None:
    """The reducer killed (the OOM killer's choice) with windows waiting and more to come: each
    is reduced in the job's process instead, right, and one warning says why."""
    time.sleep(0.3)
    waiting = []
    for k in range(20):
        mon.begin_window(k)
        time.sleep(0.002)
        waiting.append(mon.end_window(k))
    os.kill(reducer_pid(mon), signal.SIGKILL)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        later = []
        for k in range(20, 30):
            mon.begin_window(k)
            time.sleep(0.002)
            later.append(mon.end_window(k))
        for m in waiting + later:
            assert all(math.isfinite(e) and e > 0 for e in m.gpu_energy.values())
            assert all(math.isfinite(p) for p in m.gpu_p99_power.values())
    gone = [w for w in said if "reducer process ended" in str(w.message)]
    assert len(gone) == 1
    assert "SIGKILL" in str(gone[0].message)
    assert mon.alive()


def test_a_stopped_reducer_costs_a_window_its_patience_not_its_answer(
    mon: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reducer stopped (SIGSTOP, a debugger): a window read waits a bounded time, then is
    reduced in the job's process, said once; the reducer, resumed, goes on answering."""
    from hfsampler.monitor import reducer as reducer_module

    monkeypatch.setattr(reducer_module, "_PATIENCE_S", 0.3)
    time.sleep(0.3)
    pid = reducer_pid(mon)
    os.kill(pid, signal.SIGSTOP)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            ms = []
            for k in range(3):
                mon.begin_window(k)
                time.sleep(0.01)
                ms.append(mon.end_window(k))
            assert all(m.total_energy > 0 for m in ms)
        assert [str(w.message) for w in said if "has not answered" in str(w.message)] != []
        assert len([w for w in said if "has not answered" in str(w.message)]) == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    assert answered_window(mon) > 0


def test_windows_ended_before_close_are_answered_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() stops the reducer only once it has answered every window asked before: their
    Measurements read after close are whole."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    mon = Monitor(source="sim", env={}, history_s=10.0)
    time.sleep(0.3)
    ended = []
    for k in range(50):
        mon.begin_window(k)
        ended.append(mon.end_window(k))
    pid = reducer_pid(mon)
    mon.close()
    assert all(math.isfinite(m.total_energy) for m in ended)
    assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_to_the_process_group_leaves_the_reducer_answering(mon: Monitor) -> None:
    """A terminal's Ctrl-C reaches every process of the job's group; the job may catch it and
    go on (saving a checkpoint, say): its reducer must still be there."""
    os.kill(reducer_pid(mon), signal.SIGINT)
    time.sleep(0.2)
    assert answered_window(mon) > 0
    assert mon._reducer is not None
    assert not mon._reducer.gone


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_stopped_reducer_never_blocks_end_window(
    mon: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reducer stopped while the job goes on ending windows: the pipe of requests fills
    (2,048 of them) and end_window must not wait for room that never comes; it waits its
    patience once, says so at the job's line, and the windows past it are reduced in the
    job's process."""
    from hfsampler.monitor import reducer as reducer_module

    monkeypatch.setattr(reducer_module, "_PATIENCE_S", 0.5)
    time.sleep(0.3)
    pid = reducer_pid(mon)
    ended: list[object] = []

    def steps() -> None:
        for k in range(3000):
            mon.begin_window(k)
            ended.append(mon.end_window(k))

    os.kill(pid, signal.SIGSTOP)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            job = threading.Thread(target=steps)
            job.start()
            job.join(30)
            blocked = job.is_alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    job.join()
    assert not blocked
    assert len(ended) == 3000
    last = ended[-1]
    assert isinstance(last, Measurement)
    assert type(last.gpu_energy) is dict  # reduced at once, in this process
    assert math.isfinite(last.total_energy)
    assert last.total_energy > 0
    behind = [w for w in said if "has taken no window" in str(w.message)]
    assert len(behind) == 1
    assert behind[0].filename == __file__


def test_a_stopped_reducer_costs_only_the_first_window_read_its_patience(
    mon: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many windows waiting on a stopped reducer: the first one read waits its patience, the
    next ones do not wait again (ten windows, not ten patiences)."""
    from hfsampler.monitor import reducer as reducer_module

    monkeypatch.setattr(reducer_module, "_PATIENCE_S", 0.5)
    time.sleep(0.3)
    pid = reducer_pid(mon)
    os.kill(pid, signal.SIGSTOP)
    try:
        ms = []
        for k in range(10):
            mon.begin_window(k)
            time.sleep(0.002)
            ms.append(mon.end_window(k))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            began = time.monotonic()
            assert all(m.total_energy > 0 for m in ms)
            took_s = time.monotonic() - began
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took_s < 2 * 0.5
    late = [w for w in said if "has not answered" in str(w.message)]
    assert len(late) == 1
    assert late[0].filename == __file__  # the job's line that read it
    assert answered_window(mon) > 0  # resumed, it answers again


def test_a_stopped_reducer_costs_no_window_of_a_short_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """history_s=1, shorter than the reducer's patience: a window waiting on a stopped reducer
    is reduced in the job's process while the rings still hold it, not refused after."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    with Monitor(source="sim", env={}, history_s=1.0) as short:
        time.sleep(0.3)
        pid = reducer_pid(short)
        os.kill(pid, signal.SIGSTOP)
        try:
            short.begin_window("step")
            time.sleep(0.01)
            m = short.end_window("step")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                assert m.total_energy > 0
        finally:
            os.kill(pid, signal.SIGCONT)


def test_measurements_kept_unread_past_the_table_are_whole_after_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training loop that keeps every step's Measurement and reads them all after the
    Monitor is closed: more steps than the table has slots, so the first ones' slots were
    reused meanwhile; each is still answered, with the reducer's numbers."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    steps = []
    with Monitor(source="sim", env={}, history_s=10.0) as mon:
        time.sleep(0.3)
        for _ in range(1100):  # more than the table's 1,024 slots
            with mon.window("step") as w:
                time.sleep(0.002)
            steps.append(w.measurement)
    assert all(isinstance(m, Measurement) for m in steps)
    for m in steps:
        assert m is not None
        assert m.total_energy > 0
        assert all(math.isfinite(p) for p in m.gpu_p99_power.values())

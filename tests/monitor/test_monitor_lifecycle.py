"""The Monitor's life where a training job puts it: threads, multiprocessing workers, forks.

Most of these start the real sampler process: what they check is the operating system's (a
parent-death signal tied to the starting thread, multiprocessing's exit hook that joins a
process's children, what a fork copies, a thread's Ctrl-C), which no fake shows. Those whose
failure was a hang run their job in a subprocess with a timeout; the cheap ones (use after
close, pickling, threads racing close()) run on a VirtualClock.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hfsampler import Monitor
from hfsampler.errors import SourceError
from hfsampler.sampling.ring import SHM_DIR_ENV
from hfsampler.sampling.stepping import VirtualClock

ROOT = Path(__file__).resolve().parents[2]
START_NS = 1_780_000_000 * 10**9


def run_job(code: str, tmp_path: Path, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    """``code`` as a job's script (``python job.py``), its rings in ``tmp_path/shm``."""
    shm = tmp_path / "shm"
    shm.mkdir()
    job = tmp_path / "job.py"
    job.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), SHM_DIR_ENV: str(shm)}
    return subprocess.run([sys.executable, str(job)], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)  # fmt: skip


def test_a_monitor_made_on_a_thread_keeps_sampling_after_the_thread_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real process: PR_SET_PDEATHSIG fires when the thread that started the sampler ends, so a
    Monitor made in a worker thread (a callback, an executor) had its sampler killed."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    made: list[Monitor] = []
    maker = threading.Thread(target=lambda: made.append(Monitor(source="sim")))
    maker.start()
    maker.join()
    with made[0] as mon:
        time.sleep(0.5)  # the kill came at once when the thread ended
        assert mon.alive()
        with mon.window("w") as w:
            time.sleep(0.05)
        assert w.measurement is not None
        assert w.measurement.total_energy > 0


def test_a_job_killed_with_sigkill_takes_along_the_sampler_its_thread_started(
    tmp_path: Path,
) -> None:
    """Real processes: the sampler and the reducer of a Monitor made on a worker thread still
    die with the job at once (the kernel's parent-death signal), not only when the sampler next
    checks its parent."""
    shm = tmp_path / "shm"
    shm.mkdir()
    job = tmp_path / "job.py"
    job.write_text("""
import threading, time
from hfsampler import Monitor
made = []
maker = threading.Thread(target=lambda: made.append(Monitor(source="sim")))
maker.start()
maker.join()
print(made[0]._pipeline.sampler.pid, made[0]._reducer.pid, flush=True)
time.sleep(60)
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT), SHM_DIR_ENV: str(shm)}
    with subprocess.Popen([sys.executable, str(job)], env=env, stdout=subprocess.PIPE,
                          text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        proc.kill()
        proc.wait(10)
        time.sleep(0.3)  # the getppid() check alone would take a second or more
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat")
            assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_window_ended_after_the_sampler_died_is_an_error_not_stale_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real process, killed as the OOM killer would: the last samples must not be taken to hold
    until now."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    with Monitor(source="sim") as mon:
        mon.begin_window("step")
        pid = mon._pipeline.sampler.pid if mon._pipeline else None
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(SourceError, match=r"SIGKILL.*make a new one"):
            mon.end_window("step")


def test_multiprocessing_workers_that_make_a_monitor_and_never_close_it_exit(
    tmp_path: Path,
) -> None:
    """DataLoader-like workers, each with its own Monitor and no close(): a daemonic fork worker
    (multiprocessing refused it children) and a spawned one (its exit hook joined the sampler,
    which waits for its parent: a hang)."""
    done = run_job(
        """
import multiprocessing as mp, sys, time
from hfsampler import Monitor

def worker():
    mon = Monitor(source="sim")
    with mon.window("batch") as w:
        time.sleep(0.05)
    print("ENERGY", w.measurement.total_energy, flush=True)

if __name__ == "__main__":
    procs = [mp.get_context("fork").Process(target=worker, daemon=True),
             mp.get_context("spawn").Process(target=worker)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(45)
    print("EXIT", [p.exitcode for p in procs])
""",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "EXIT [0, 0]" in done.stdout, done.stderr
    assert done.stdout.count("ENERGY") == 2
    assert list((tmp_path / "shm").iterdir()) == []


def test_a_forked_child_uses_and_closes_the_parents_monitor_without_stopping_it(
    tmp_path: Path,
) -> None:
    """Real process: what ``os.fork`` copies (the Monitor, multiprocessing's list of children,
    the exit hooks) must leave the parent's sampler to the parent."""
    done = run_job(
        """
import os, sys, time
from hfsampler import Monitor

mon = Monitor(source="sim")
pid = os.fork()
if pid == 0:
    with mon.window("child") as w:
        time.sleep(0.05)
    print("CHILD", w.measurement.total_energy > 0, flush=True)
    mon.close()
    sys.exit(0)
_, status = os.waitpid(pid, 0)
time.sleep(0.2)
print("PARENT", os.waitstatus_to_exitcode(status), mon.alive(), flush=True)
with mon.window("parent") as w:
    time.sleep(0.05)
print("AFTER", w.measurement.total_energy > 0)
mon.close()
""",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["CHILD", "True", "PARENT", "0", "True", "AFTER", "True"]
    assert "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
    assert list((tmp_path / "shm").iterdir()) == []


def test_a_closed_monitor_refuses_new_windows() -> None:
    mon = Monitor(source="sim", clock=VirtualClock(START_NS), env={})
    mon.close()
    mon.close()
    with pytest.raises(RuntimeError, match="closed"):
        mon.begin_window("late")
    with pytest.raises(RuntimeError, match="closed"), mon.window("late"):
        pass


def test_a_monitor_no_longer_referenced_stops_its_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real process: a notebook cell ``mon = Monitor()`` run again leaves the first Monitor
    unreferenced; its sampler (a core's share, rings in /dev/shm) must not run on until exit."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    cell = "from hfsampler import Monitor\nmon = Monitor(source='sim')\n"
    namespace: dict[str, Monitor] = {}
    exec(cell, namespace)  # a notebook cell, as the kernel runs it
    first, reducer = namespace["mon"]._pipeline, namespace["mon"]._reducer
    assert first is not None
    assert reducer is not None
    pids, blocks = (first.sampler.pid, reducer.pid), len(list(tmp_path.iterdir()))
    del first, reducer
    exec(cell, namespace)
    gc.collect()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert len(list(tmp_path.iterdir())) == blocks
    namespace["mon"].close()


def test_close_while_other_threads_end_windows_is_clean_for_both() -> None:
    """Threads ending windows while another closes the Monitor: each call either measures or says
    the Monitor is closed (no AttributeError from a pipeline gone mid-call, no BufferError from
    rings unmapped under a reader), and close() itself never raises."""
    errors: list[str] = []
    for _ in range(8):
        mon = Monitor(source="sim", clock=VirtualClock(START_NS), env={})
        started = threading.Barrier(4)

        def windows(mon: Monitor = mon, started: threading.Barrier = started) -> None:
            started.wait()
            for k in range(100_000):
                key = (threading.get_ident(), k)
                try:
                    mon.begin_window(key)
                    mon.end_window(key)
                except RuntimeError as exc:
                    if "closed" not in str(exc):
                        errors.append(repr(exc))
                    return
                except Exception as exc:  # any other is the failure
                    errors.append(repr(exc))
                    return

        threads = [threading.Thread(target=windows) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.05)
        mon.close()
        for t in threads:
            t.join()
    assert errors == []


def test_ctrl_c_during_close_still_frees_the_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real process, held stopped (SIGSTOP) so that close() is waiting for it when Ctrl-C comes:
    the interrupt goes to the job, and the rings are freed all the same (nothing runs close()
    again, at exit or later)."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    mon = Monitor(source="sim")
    pid = mon._pipeline.sampler.pid if mon._pipeline else None
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            mon.close()
        assert list(tmp_path.iterdir()) == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.kill(pid, signal.SIGKILL)


def test_a_monitor_sent_to_a_spawned_process_is_refused_saying_what_to_do() -> None:
    """``Process(target=work, args=(mon,))`` under spawn pickles the Monitor: its sampler and
    rings are this process's, so the refusal says to make one in each process."""
    mon = Monitor(source="sim", clock=VirtualClock(START_NS), env={})
    with mon, pytest.raises(TypeError, match="make a Monitor in each process"):
        pickle.dumps(mon)

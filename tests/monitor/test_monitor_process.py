"""The Monitor with its real sampler process, on the sim: the docs' training loop, and close().

These start the sampler process, as a job's Monitor does (spawned, a second or so on a busy
runner): what only the real process shows is that it starts without the script's ``__main__``,
runs beside the job, and is gone with its shared memory after ``close()``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import shm_dirs

from hfsampler import Monitor
from hfsampler.errors import ConfigError
from hfsampler.sampling.ring import SHM_DIR_ENV

ROOT = Path(__file__).resolve().parents[2]
small_shm = shm_dirs.small_shm


def docs_training_loop() -> str:
    """The script under docs/monitor.md's "A training loop"."""
    page = (ROOT / "docs" / "monitor.md").read_text()
    part = page.split("## A training loop", 1)[1]
    found = re.search(r"```python\n(.*?)```", part, re.S)
    assert found is not None
    return found.group(1)


def test_the_docs_training_loop_logs_each_steps_energy(tmp_path: Path) -> None:
    """The page's script as a job runs it: ``python train.py``, no ``__main__`` guard."""
    script = tmp_path / "train.py"
    script.write_text(docs_training_loop())
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), SHM_DIR_ENV: str(shm)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    steps = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(s["epoch"], s["step"]) for s in steps] == [(e, k) for e in range(2) for k in range(5)]
    for s in steps:
        # two sim GPUs draw about 330 and 340 W: 20 ms of sleep is 13 J and more
        assert s["seconds"] >= 0.02
        assert 600 * s["seconds"] < s["energy_j"] < 2000 * s["seconds"]
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 2
    assert "memory high-water" in epochs[0]
    assert list(shm.iterdir()) == []  # the sampler's rings are freed at exit


def test_close_stops_the_sampler_process_and_frees_its_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    mon = Monitor(source="sim", env={}, history_s=2.0)
    pid = mon._pipeline.sampler.pid if mon._pipeline else None
    assert pid is not None
    assert mon.alive()
    assert len(list(tmp_path.iterdir())) >= 2  # rings and the status block
    mon.begin_window("w")
    m = mon.end_window("w")
    assert m.time >= 0
    mon.close()
    mon.close()
    assert not mon.alive()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        mon.measure(0, 1)


def test_a_small_dev_shm_is_refused_at_construction(small_shm: Path) -> None:
    with pytest.raises(ConfigError, match=r"the sample rings need .*--shm-size"):
        Monitor(source="sim", env={}, history_s=600.0)


def test_import_hfsampler_stays_light_and_an_unclosed_monitor_is_stopped_at_exit(
    tmp_path: Path,
) -> None:
    """``import hfsampler`` loads neither numpy nor the Monitor; a Monitor never closed is
    closed at exit, its shared memory freed."""
    code = """
import sys
import hfsampler
assert "numpy" not in sys.modules and "hfsampler.monitor" not in sys.modules, sorted(sys.modules)
from hfsampler import Monitor
mon = Monitor(source="sim", env={}, history_s=2.0)
mon.begin_window("w")
print(mon.end_window("w").time >= 0)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), SHM_DIR_ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert list(tmp_path.iterdir()) == []


def test_under_record_the_report_shows_each_window_with_the_same_energy(tmp_path: Path) -> None:
    """``hfsampler record -- python job.py`` for real: the recorder's socket reaches the job's
    Monitor only through the environment of a real child. Both sample the same sim GPUs (a
    function of time), so the report's phases and the Monitor's windows agree."""
    job = tmp_path / "job.py"
    job.write_text("""
import time
from hfsampler import Monitor
with Monitor(source="sim") as mon:
    for k in range(2):
        with mon.window("train step") as w:
            time.sleep(0.2)
        print("ENERGY", w.measurement.total_energy, flush=True)
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "r.hfs"
    hfs = [sys.executable, "-m", "hfsampler"]
    done = subprocess.run([*hfs, "record", "--source", "sim", "-o", str(out), "--",
                           sys.executable, str(job)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    energies = [float(line.split()[1]) for line in done.stdout.splitlines()
                if line.startswith("ENERGY")]  # fmt: skip
    report = subprocess.run([*hfs, "report", str(out), "--format", "json"], env=env,
                            capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    phases = [p for p in json.loads(report.stdout)["phases"] if p["name"] == "train step"]
    assert len(phases) == len(energies) == 2
    for phase, energy in zip(phases, energies, strict=True):
        assert phase["energy_j"] == pytest.approx(energy, rel=0.01)


_SIGPIPE_JOB = """
import os, signal, time, warnings
warnings.simplefilter("ignore", RuntimeWarning)  # the reducer's end, said once
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as scripts piped into `head` do
from hfsampler import Monitor
with Monitor(source="sim", env={}, history_s=4.0) as mon:
    time.sleep(0.3)
    os.kill(mon._reducer.pid, signal.SIGKILL)  # the out-of-memory killer's choice
    time.sleep(0.3)
    mon.begin_window("step")
    time.sleep(0.01)
    print(mon.end_window("step").total_energy > 0)
"""


def test_a_killed_reducer_does_not_kill_a_job_with_sigpipe_at_its_default(tmp_path: Path) -> None:
    """A job that set SIGPIPE back to its default, whose reducer was killed: its next window is
    reduced in the job's process, not the job killed by a write to a pipe nobody reads."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), SHM_DIR_ENV: str(shm)}
    done = subprocess.run([sys.executable, "-c", _SIGPIPE_JOB], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["True"]
    assert list(shm.iterdir()) == []

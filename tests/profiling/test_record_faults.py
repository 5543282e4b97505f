"""`record` when the disk fills, the command cannot run or the file system is read-only: the job
runs to its end and its status comes back, every error is said once, never as a traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hfsampler.fields import BY_NAME
from hfsampler.profiling.record import EXIT_INCOMPLETE
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import Marker, RecordingWriteError
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sources.base import DeviceInfo

pytestmark = pytest.mark.long  # its tests take half a minute or more together

REPO = Path(__file__).resolve().parents[2]
STOPPED = "the recording stopped"
FIELDS = (BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"], BY_NAME["DCGM_FI_DEV_GPU_TEMP"])
DEVICES = tuple(DeviceInfo(i, f"GPU-{i}", "test", f"0:{i}", "1.0", i) for i in range(2))


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _mount(where: Path, options: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 160 KiB file system: 4 sim GPUs fill it in a few seconds."""
    yield from _mount(tmp_path / "small", "size=160k")


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    yield from _mount(tmp_path / "ro", "ro,size=64k")


def _outlive(out: Path, then: str) -> str:
    """A job that runs until the recording has stopped growing for 3 s (the disk is full: a
    window adds a chunk a second), then does ``then``."""
    return (
        "import pathlib, time\n"
        f"p, size, since = pathlib.Path({str(out)!r}), -1, time.monotonic()\n"
        "while size < 50_000 or time.monotonic() - since < 3:\n"
        "    now = p.stat().st_size if p.exists() else 0\n"
        "    if now != size: size, since = now, time.monotonic()\n"
        "    time.sleep(0.1)\n"
        f"{then}\n"
    )


def _record(out: Path, job: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--gpus", "0,1,2,3",
         "--quiet", "-o", str(out), "--", sys.executable, "-c", job],
        env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left, the job included


def test_a_full_disk_stops_the_recording_not_the_job(small_disk: Path) -> None:
    out = small_disk / "run.hfs"
    proc = _record(out, _outlive(out, "print('job done', flush=True)"))
    stdout, stderr = _finish(proc, 100)
    assert proc.returncode == EXIT_INCOMPLETE, stderr
    assert stdout == "job done\n"
    assert "Traceback" not in stderr
    assert stderr.count(STOPPED) == 1, stderr
    assert "No space left on device" in stderr
    rec = Recording(out)  # what fitted is readable, and says why it ends early
    assert not rec.complete
    assert rec.end is not None
    assert rec.end["exit_code"] == 0
    assert rec.stopped_early is not None
    assert "No space left" in rec.stopped_early
    assert rec.end["samples"] > 0
    assert not rec.damaged_parts


def test_the_job_s_own_failure_is_passed_on_as_it_is(small_disk: Path) -> None:
    out = small_disk / "run.hfs"
    proc = _record(out, _outlive(out, "raise SystemExit(3)"))
    _, stderr = _finish(proc, 100)
    assert proc.returncode == 3, stderr
    assert stderr.count(STOPPED) == 1
    assert "Traceback" not in stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_after_the_failure_a_signal_ends_record_promptly(small_disk: Path, sig: int) -> None:
    # a job that dies of the signal itself, as a shell command would (no KeyboardInterrupt)
    job = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); time.sleep(120)"
    proc = _record(small_disk / "run.hfs", job)
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # until the disk is full
        line = proc.stderr.readline()
        lines.append(line)
        if STOPPED in line or not line:
            break
    assert STOPPED in lines[-1], "".join(lines)
    started = time.monotonic()
    proc.send_signal(sig)  # passed on to the job (stdin is not a terminal: SIGINT too)
    _, rest = _finish(proc, 20)
    assert time.monotonic() - started < 10
    assert proc.returncode == 128 + sig, "".join(lines) + rest
    assert "Traceback" not in rest


def test_a_missing_or_not_executable_command_gets_a_shell_s_status(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexit 0\n")  # not executable: 0644
    for command, status, said in (("no-such-command-xyz", 127, "command not found"),
                                  (str(script), 126, "Permission denied")):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
             str(tmp_path / "x.hfs"), "--", command],
            env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == status, done.stderr
        assert done.stderr.count(said) == 1, done.stderr
        assert "Traceback" not in done.stderr


def test_a_read_only_file_system_is_named_so_once(read_only: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet",
         "--duration", "1s", "-o", str(read_only / "x.hfs")],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "Read-only file system" in line]
    assert len(errors) == 1, done.stderr  # printed, not logged and printed
    assert "Traceback" not in done.stderr
    config = tmp_path / "c.yaml"
    config.write_text(f"queue_dir: {read_only / 'queue'}\n")
    done = subprocess.run([sys.executable, "-m", "hfsampler", "check-config", str(config)],
                          env=_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "read-only file system" in done.stderr
    assert "permission" not in done.stderr


def test_status_is_documented() -> None:
    done = subprocess.run([sys.executable, "-m", "hfsampler", "record", "--help"], env=_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert f"{EXIT_INCOMPLETE}" in done.stdout
    assert "127" in done.stdout
    docs = (REPO / "docs" / "profiling.md").read_text()
    assert f"`{EXIT_INCOMPLETE}`" in docs


def test_the_writer_cuts_back_to_whole_chunks_and_still_ends_the_file(small_disk: Path) -> None:
    out = small_disk / "w.hfs"
    rng = np.random.default_rng(3)
    plan = GroupPlan("fast", 0.001, FIELDS)
    w = RecordingWriter(out, {"start_ns": 10**18, "command": ["x"]}, DEVICES, [plan])

    def fill() -> None:
        for k in range(10_000):  # random values do not compress: the disk fills
            n = 1000
            time_ns = 10**18 + k * 10**9 + np.arange(n, dtype=np.int64) * 1_000_000
            values = rng.uniform(0, 1e6, (n, 2, 2))
            driver = np.repeat((time_ns // 1000)[:, None, None], 2, axis=1).repeat(2, axis=2)
            w.add_rows(0, RingRows(time_ns, np.zeros(n, np.int64), values, driver))

    with pytest.raises(RecordingWriteError, match="No space left on device"):
        fill()
    assert w.failed is not None
    with pytest.raises(RecordingWriteError):
        w.add_markers([Marker(10**18, "mark", "late")])  # stopped: nothing more is written
    w.close({"end_ns": 10**18 + 1, "exit_code": 0, "incomplete": str(w.failed)})  # no raise
    rec = Recording(out)
    assert not rec.torn
    assert not rec.damaged_parts
    assert rec.stopped_early is not None
    assert rec.end is not None
    assert rec.end["samples"] == sum(len(c.ts_us) for c in rec.raw_chunks())

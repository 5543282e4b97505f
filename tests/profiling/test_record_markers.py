"""`hfsampler record` around a real job that sends markers and prints matched lines (the CLI)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hfsampler import fields as F
from hfsampler.cli.main import main
from hfsampler.profiling.recording import Recording
from hfsampler.sources.sim.source import SimSource

pytestmark = pytest.mark.long  # its tests take half a minute or more together

REPO = Path(__file__).resolve().parents[2]

JOB = """
import os, sys, time
from hfsampler import markers

def work(s):
    time.sleep(s)

with markers.phase("load"):
    work(0.4)
for epoch in range(2):
    print(f"Epoch {epoch} begins", flush=True)
    for n in range(3):
        markers.step(epoch * 3 + n)
        work(0.25)
    markers.mark("eval")
    print(f"checkpoint saved: ckpt-{epoch}", file=sys.stderr, flush=True)
    work(0.2)  # stderr and stdout are two pipes read by two threads: no order between them
pid = os.fork()
if pid == 0:
    markers.mark("from the fork")
    os._exit(0)
os.waitpid(pid, 0)
work(1.2)  # the process list is polled once a second
print("sent", markers.sent(), "dropped", markers.dropped(), "wire", os.environ[markers.WIRE_ENV])
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("HFSAMPLER_MARKER_SOCKET", None)
    return env


Run = subprocess.CompletedProcess[bytes]


def _record(tmp_path: Path, *flags: str, job: str) -> tuple[Run, Path]:
    out = tmp_path / "run.hfs"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(job))
    proc = subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
         str(out), *flags, "--", sys.executable, str(script)],
        env=_env(), capture_output=True, timeout=90,
    )  # fmt: skip
    return proc, out


def test_markers_output_patterns_gpm_and_processes_are_recorded(tmp_path: Path) -> None:
    proc, out = _record(tmp_path, "--mark-pattern", r"(?P<phase>Epoch \d+) begins",
                        "--mark-pattern", r"checkpoint saved: (?P<name>\S+)", job=JOB)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    # the child's output reached our stdout and stderr unchanged
    assert proc.stdout.decode().splitlines() == [
        "Epoch 0 begins", "Epoch 1 begins", "sent 10 dropped 0 wire 3"
    ]  # fmt: skip
    assert b"checkpoint saved: ckpt-0\ncheckpoint saved: ckpt-1\n" in proc.stderr
    rec = Recording(out)
    assert rec.complete
    assert rec.end is not None
    assert rec.end["markers_dropped_by_job"] == 0
    assert rec.end["marker_datagrams_rejected"] == 0
    start, end = rec.time_range_ns()
    got = rec.markers()
    seen = [(m.source, m.kind, m.name, m.step) for m in got]
    api = [s[1:] for s in seen if s[0] == "api"]
    assert api == [
        ("begin", "load", None), ("end", "load", None),
        *(("step", "step", k, ) for k in range(3)), ("mark", "eval", None),
        *(("step", "step", k) for k in range(3, 6)), ("mark", "eval", None),
        ("mark", "from the fork", None),
    ]  # fmt: skip
    output = [s[1:] for s in seen if s[0] == "output"]
    assert output == [
        ("begin", "Epoch 0", None), ("mark", "ckpt-0", None), ("end", "Epoch 0", None),
        ("begin", "Epoch 1", None), ("mark", "ckpt-1", None), ("end", "Epoch 1", None),
    ]  # fmt: skip
    # plausible times: within the job, in order, the load phase about 0.4 s, steps 0.25 s apart
    times = [m.t_ns for m in got]
    assert times == sorted(times)
    assert start <= times[0]
    assert times[-1] <= end
    load = [m.t_ns for m in got if m.name == "load"]
    assert 0.35 < (load[1] - load[0]) / 1e9 < 2.0
    steps = np.diff([m.t_ns for m in got if m.kind == "step"][:3]) / 1e9
    assert ((steps > 0.2) & (steps < 2.0)).all()
    pids = {m.pid for m in got if m.source == "api"}
    assert len(pids) == 2  # the job and its fork
    child_pid = next(m.pid for m in got if m.name == "load")
    assert all(m.pid == child_pid for m in got if m.source == "output")
    # the GPM activity fields are recorded, with samples
    tensor = rec.raw("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0)
    assert len(tensor[0]) > 10
    assert rec.groups[rec.group_index(F.GPM)].fields[0].name.startswith("DCGM_FI_PROF_")
    # the job's processes: about once a second, their memory and SM share as the sim says
    snaps = rec.processes()
    assert len(snaps) >= 2
    sim = SimSource(gpus=len(rec.devices))
    for snap in snaps:
        assert set(snap["gpus"]) == {"0", "1"}
        for gpu, procs in snap["gpus"].items():
            assert child_pid in [p["pid"] for p in procs]
            assert all(p["in_job"] for p in procs)
            truth = sim.value_at("DCGM_FI_DEV_FB_USED", snap["t_ns"])[int(gpu)] * 2**20
            assert sum(p["used_memory_bytes"] for p in procs) == pytest.approx(truth, abs=4)
            assert all(0 < p["sm_util_pct"] <= 100 for p in procs)
    gaps = np.diff([s["t_ns"] for s in snaps]) / 1e9
    assert ((gaps > 0.8) & (gaps < 5.0)).all()


CHATTY = """
import os, sys
chunk = bytes(range(256)) * 256  # every byte value, 64 KiB, no line ends of its own
for i in range(64):
    os.write(1, chunk + b"\\nstep %d\\n" % i)
    os.write(2, chunk[::-1] + b"\\r")
"""


def test_a_chatty_binary_child_passes_through_whole(tmp_path: Path) -> None:
    proc, out = _record(tmp_path, "--mark-pattern", r"^step (?P<step>\d+)$", job=CHATTY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    chunk = bytes(range(256)) * 256
    expected = b"".join(chunk + b"\nstep %d\n" % i for i in range(64))
    assert hashlib.sha256(proc.stdout).hexdigest() == hashlib.sha256(expected).hexdigest()
    assert proc.stderr.count(chunk[::-1] + b"\r") == 64
    steps = [m.step for m in Recording(out).markers()]
    assert steps == list(range(64))


def test_a_step_number_beyond_64_bits_makes_no_marker_and_the_job_runs_on(tmp_path: Path) -> None:
    """A sample counter matched as a step used to make the store fail and end the job."""
    job = """
    import time
    print("step 1", flush=True)
    print("step 184467440737095516160 (global sample counter)", flush=True)
    print("step 9223372036854775808", flush=True)
    time.sleep(1.5)  # a window's store in between
    print("step 2", flush=True)
    """
    proc, out = _record(tmp_path, "--mark-pattern", r"step (?P<step>\d+)", job=job)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines()[-1] == "step 2"
    rec = Recording(out)
    assert rec.complete
    assert [m.step for m in rec.markers()] == [1, 2]


BURST = """
import threading, time
from hfsampler import markers

def steps(base):
    for i in range(300):
        markers.step(base + i)

threads = [threading.Thread(target=steps, args=(k * 1000,)) for k in range(8)]
for t in threads:
    t.start()
for burst in range(20):  # bursts of 16 marks, faster than the socket's queue of 10 datagrams
    for j in range(16):
        markers.mark(f"b{burst}.{j}")
    time.sleep(0.02)
for t in threads:
    t.join()
print(markers.sent(), markers.dropped(), markers.waiting())  # what waits goes at exit
"""


def test_a_burst_from_threads_arrives_whole_or_counted_exactly(tmp_path: Path) -> None:
    proc, out = _record(tmp_path, job=BURST)
    assert proc.returncode == 0, proc.stderr.decode()
    rec = Recording(out)
    assert rec.end is not None
    got = [m for m in rec.markers() if m.source == "api"]
    steps = [m.step for m in got if m.kind == "step"]
    marks = [m.name for m in got if m.kind == "mark"]
    assert len(set(steps)) == len(steps)
    assert len(set(marks)) == len(marks)
    assert len(got) + rec.end["markers_dropped_by_job"] == 8 * 300 + 20 * 16
    assert rec.end["marker_datagrams_rejected"] == 0
    # a backlog of 512 events and batches of up to 1024: nothing lost here (it was 25 %)
    assert rec.end["markers_dropped_by_job"] == 0


def test_a_closed_output_pipe_ends_the_job_as_it_would_unpiped(tmp_path: Path) -> None:
    """`record --mark-pattern ... -- yes | head -2`: once head has gone, yes gets SIGPIPE."""
    out = tmp_path / "run.hfs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
         str(out), "--mark-pattern", "never", "--", "yes"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"y\n"
        proc.stdout.close()  # what head does after its lines
        assert proc.wait(60) == 128 + signal.SIGPIPE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    with proc.stderr:
        assert b"reader has gone" in proc.stderr.read()
    assert Recording(out).complete


def test_a_process_left_behind_is_said_and_its_late_line_stamped_at_the_end(
    tmp_path: Path,
) -> None:
    job = tmp_path / "job.sh"
    job.write_text("( sleep 0.3; echo 'late mark'; sleep 5 ) &\necho 'main done'\n")
    out = tmp_path / "run.hfs"
    proc = subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
         str(out), "--mark-pattern", "(?P<name>late mark)", "--", "sh", str(job)],
        env=_env(), capture_output=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"left behind" in proc.stderr
    rec = Recording(out)
    _, end = rec.time_range_ns()
    (late,) = rec.markers()
    assert late.name == "late mark"
    assert late.t_ns == end  # read after the job's end, which the recording ends at


def test_mark_pattern_without_a_command_is_a_usage_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["record", "--source", "sim", "--quiet", "-o", str(tmp_path / "run.hfs"), "--duration",
            "1s", "--mark-pattern", "step"]  # fmt: skip
    assert main(argv) == 2
    assert "--mark-pattern" in capfd.readouterr().err
    assert not (tmp_path / "run.hfs").exists()


def test_a_bad_pattern_is_a_usage_error_naming_the_flag(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out, script = tmp_path / "run.hfs", tmp_path / "job.py"
    script.write_text("print('never')\n")
    argv = ["record", "--source", "sim", "--quiet", "-o", str(out), "--mark-pattern",
            "(?P<step>[0-9", "--", sys.executable, str(script)]  # fmt: skip
    assert main(argv) == 2
    captured = capfd.readouterr()
    assert "--mark-pattern" in captured.err
    assert "never" not in captured.out
    assert not out.exists()


def test_the_socket_is_private_and_removed_when_a_signal_ends_the_job(tmp_path: Path) -> None:
    where = tmp_path / "socket-path"
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(f"""
        import os, pathlib, stat, time
        path = os.environ["HFSAMPLER_MARKER_SOCKET"]
        mode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
        pathlib.Path({str(where)!r}).write_text(f"{{path}} {{mode:o}}")
        time.sleep(60)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
         str(tmp_path / "run.hfs"), "--", sys.executable, str(job)],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not where.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        path, mode = where.read_text().split()
        assert mode == "700"
        assert Path(path).exists()
        proc.send_signal(signal.SIGTERM)  # passed on to the job, which it ends
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not Path(path).exists()
    assert not Path(path).parent.exists()

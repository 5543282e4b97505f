"""The report's per-process view: the JSON section and the plots, opened in headless Chromium;
and the page of a recording `record` made, drawn by Chromium (plots render, no console error).

The `report` command runs in this process (``inprocess.hfsampler``); `record` and Chromium are
real processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from inprocess import hfsampler
from run_dir import made_once
from test_report import CONSOLE_ERROR, chromium, decode_png, report_json, run_chromium

from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.profiling.report_processes import MAX_POINTS, tracks
from hfsampler.sources.base import DeviceInfo

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A sim recording around a 3.5 s job, and the job's pid (made once: the timing test and the
    page test run on different workers). A real `record` of a real job: the sim lists the job's
    own process, for as long as it ran on the wall clock."""

    def make(where: Path) -> None:
        job = "import os, time; print(os.getpid(), flush=True); time.sleep(3.5)"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        proc = subprocess.run(
            [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
             str(where / "run.hfs"), "--", sys.executable, "-c", job],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (where / "pid").write_text(proc.stdout.split()[0])

    where = made_once("report-processes", tmp_path_factory, make)
    return where / "run.hfs", int((where / "pid").read_text())


@pytest.mark.alone  # it measures time: no other test runs meanwhile
def test_json_lists_the_jobs_processes_per_gpu(recorded: tuple[Path, int]) -> None:
    run, pid = recorded
    procs = report_json(str(run))["processes"]
    assert set(procs) == {"0", "1"}
    for gpu in procs.values():
        assert [p["pid"] for p in gpu] == [pid]
        (p,) = gpu
        assert p["in_job"] is True
        assert p["snapshots"] >= 3
        assert 2.0 < p["last_seen_s"] - p["first_seen_s"] < 4.0
        assert p["memory_high_water_mib"] > 1000  # the sim's single process holds all of it
        assert 0 < p["mean_sm_util_pct"] <= 100


@dataclass(frozen=True, slots=True)
class Drawn:
    """The recording's page, and what one Chromium launch made of it."""

    page: Path
    dom: subprocess.CompletedProcess[str]
    screenshot: Path


@pytest.fixture(scope="module")
def drawn(recorded: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> Drawn:
    """The page drawn once, its DOM and a screenshot from one launch, for the tests below."""
    chromium()
    where = tmp_path_factory.mktemp("drawn")
    page, shot = where / "report.html", where / "shot.png"
    made = hfsampler("report", str(recorded[0]), "-o", str(page))
    assert made.returncode == 0, made.stderr
    dom = run_chromium(page.as_uri(), "--dump-dom", f"--screenshot={shot}",
                       "--window-size=1200,2000")  # fmt: skip
    return Drawn(page, dom, shot)


def test_report_renders_in_chromium(drawn: Drawn) -> None:
    assert "http://" not in drawn.page.read_text().split("<script", 1)[0]  # no external resource
    dom = drawn.dom
    assert dom.returncode == 0, dom.stderr[-2000:]
    errors = [line for line in dom.stderr.splitlines() if CONSOLE_ERROR.search(line)]
    assert errors == []
    assert dom.stdout.count('class="main-svg"') >= 3 * 2  # plotly drew every figure (2 GPUs + 1)
    assert "js-plotly-plot" in dom.stdout

    pixels = decode_png(drawn.screenshot.read_bytes())[:, :, :3]
    plot_area = pixels[900:, :, :]  # below the tables: the first figure
    coloured = (np.ptp(plot_area, axis=2) > 60).mean()  # saturated, not grey text or white
    assert coloured > 0.002, f"only {coloured:.4%} coloured pixels: the plots did not render"


def test_the_page_draws_a_process_figure_per_gpu(recorded: tuple[Path, int], drawn: Drawn) -> None:
    _, pid = recorded
    text = drawn.page.read_text()
    assert "GPU processes" in text
    assert f"pid {pid}" in text
    dom = drawn.dom
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert [line for line in dom.stderr.splitlines() if CONSOLE_ERROR.search(line)] == []
    for gpu in (0, 1):
        drawn_figure = re.search(rf'id="processes-gpu{gpu}".*?class="main-svg"', dom.stdout, re.S)
        assert drawn_figure is not None, f"the process figure of GPU {gpu} was not drawn"


def _synthetic(path: Path, hours: float) -> int:
    """A recording of ``hours`` with a snapshot every second on 2 GPUs: pid 7 steady at 1 GiB
    except one spike to 5 GiB, SM 100 % its first second of every 10 and 0 % the rest, written
    only when it changes (as record does); pid 8 on GPU 1 half the time."""
    start = 1_700_000_000 * 10**9
    devices = [DeviceInfo(i, f"GPU-{i}", "test", f"0:{i}", "1.0", i) for i in range(2)]
    writer = RecordingWriter(path, {"start_ns": start}, devices, [])
    seconds = int(hours * 3600)
    spike = seconds * 3 // 7
    for t in range(seconds):
        if t % 10 > 1 and t != spike and t != spike + 1 and t != seconds // 2:
            continue  # unchanged: not written
        mem = 5 * GIB if t == spike else GIB
        p7 = {"pid": 7, "used_memory_bytes": mem, "sm_util_pct": 100.0 if t % 10 == 0 else 0.0,
              "in_job": True}  # fmt: skip
        p8 = {"pid": 8, "used_memory_bytes": GIB, "sm_util_pct": None, "in_job": False}
        writer.add_processes(start + t * 10**9, {0: [p7], 1: [p8] if t < seconds // 2 else []})
    writer.close({"end_ns": start + seconds * 10**9, "exit_code": 0})
    return seconds


def test_a_long_recording_folds_into_fixed_buckets_keeping_peaks_and_time_weights(
    tmp_path: Path,
) -> None:
    """The state per process is MAX_POINTS buckets whatever the length; peaks survive, and the
    mean SM weighs each snapshot by how long it held (change-only snapshots)."""
    run = tmp_path / "long.hfs"
    seconds = _synthetic(run, hours=6)
    got = tracks(Recording(run))
    (p7,) = got[0]
    (p8,) = got[1]
    for track in (p7, p8):
        assert len(track.bucket_t_s) == len(track.memory_mib) == MAX_POINTS
        x, y = track.points(track.memory_mib)
        assert len(x) == len(y) <= MAX_POINTS
        assert x == sorted(x)
    assert max(v for v in p7.points(p7.memory_mib)[1] if v is not None) == 5 * 1024
    summary = p7.as_dict()
    assert summary["memory_high_water_mib"] == 5 * 1024
    assert summary["mean_sm_util_pct"] == pytest.approx(10.0, abs=0.1)  # not the snapshots' 50
    assert summary["first_seen_s"] == 0.0
    assert p8.as_dict()["mean_sm_util_pct"] is None
    assert p8.as_dict()["last_seen_s"] < seconds / 2

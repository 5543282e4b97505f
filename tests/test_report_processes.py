"""The report's per-process view: the JSON section and the plots, opened in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_report import CONSOLE_ERROR, chromium, run_chromium

from hfsampler.report_processes import MAX_POINTS, _thin

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A sim recording around a 3.5 s job, and the job's pid."""
    tmp = tmp_path_factory.mktemp("proc")
    run = tmp / "run.hfs"
    job = "import os, time; print(os.getpid(), flush=True); time.sleep(3.5)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
         str(run), "--", sys.executable, "-c", job],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return run, int(proc.stdout.split()[0])


def _report(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "hfsampler", "report", str(run), *args],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip


def test_json_lists_the_jobs_processes_per_gpu(recorded: tuple[Path, int]) -> None:
    run, pid = recorded
    made = _report(run, "--format", "json")
    assert made.returncode == 0, made.stderr
    procs = json.loads(made.stdout)["processes"]
    assert set(procs) == {"0", "1"}
    for gpu in procs.values():
        assert [p["pid"] for p in gpu] == [pid]
        (p,) = gpu
        assert p["in_job"] is True
        assert p["snapshots"] >= 3
        assert 2.0 < p["last_seen_s"] - p["first_seen_s"] < 4.0
        assert p["memory_high_water_mib"] > 1000  # the sim's single process holds all of it
        assert 0 < p["mean_sm_util_pct"] <= 100


def test_the_page_draws_a_process_figure_per_gpu(
    recorded: tuple[Path, int], tmp_path: Path
) -> None:
    chromium()
    run, pid = recorded
    page = tmp_path / "report.html"
    made = _report(run, "-o", str(page))
    assert made.returncode == 0, made.stderr
    text = page.read_text()
    assert "GPU processes" in text
    assert f"pid {pid}" in text
    dom = run_chromium(page.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert [line for line in dom.stderr.splitlines() if CONSOLE_ERROR.search(line)] == []
    for gpu in (0, 1):
        drawn = re.search(rf'id="processes-gpu{gpu}".*?class="main-svg"', dom.stdout, re.S)
        assert drawn is not None, f"the process figure of GPU {gpu} was not drawn"


def test_a_long_track_is_thinned_keeping_its_peaks() -> None:
    t = list(np.arange(100_000) / 10)
    y = [float(v) for v in np.zeros(100_000)]
    y[54_321] = 99.0
    y[7] = float("nan")
    tx, ty = _thin(t, y)
    assert len(tx) == len(ty) == MAX_POINTS
    assert max(v for v in ty if v is not None) == 99.0
    assert _thin([0.0, 1.0], [float("nan"), 2.0]) == ([0.0, 1.0], [None, 2.0])

"""Issue 13's whole path as a user runs it: `record` (sim) around a real Python job that sends
markers through ``hfsampler.markers`` and prints lines matched by ``--mark-pattern``, then
`report`: each phase's energy matches the sim's ground truth, the GPM activity is recorded, and
the page shows the phases in a real browser."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from run_dir import made_once
from test_report import CONSOLE_ERROR, FIGURE, chromium, run_chromium, truth_energy_j

from hfsampler.profiling.recording import Recording
from hfsampler.sources.sim.source import SimSource

REPO = Path(__file__).resolve().parents[2]
MS = 1_000_000

JOB = """
import time
from hfsampler import markers

with markers.phase("warmup"):
    time.sleep(1.2)
for epoch in range(2):
    print(f"== epoch {epoch} ==", flush=True)
    for n in range(4):
        markers.step(epoch * 4 + n)
        time.sleep(0.3)
with markers.phase("eval"):
    time.sleep(0.8)
"""


def _hfsampler(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HFSAMPLER_MARKER_SOCKET", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "hfsampler", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Made once: the timing test and the page test run on different workers."""

    def make(where: Path) -> None:
        script = where / "train.py"
        script.write_text(textwrap.dedent(JOB))
        made = _hfsampler("record", "--source", "sim", "--quiet", "-o", str(where / "train.hfs"),
                          "--mark-pattern", r"== (?P<phase>epoch \d+) ==",
                          "--", sys.executable, str(script))  # fmt: skip
        assert made.returncode == 0, made.stderr

    return made_once("e2e", tmp_path_factory, make) / "train.hfs"


@pytest.mark.alone  # it measures time: no other test runs meanwhile
def test_the_phase_table_matches_the_sim_and_gpm_is_recorded(job: Path) -> None:
    made = _hfsampler("report", str(job), "--format", "json")
    assert made.returncode == 0, made.stderr
    d = json.loads(made.stdout)
    phases = {p["label"]: p for p in d["phases"]}
    assert set(phases) == {"warmup", "epoch 0", "epoch 1", "eval"}, list(phases)
    rec = Recording(job)
    start = int(rec.header["start_ns"])
    sim = SimSource(gpus=len(rec.devices))  # the CLI's default seed, as record sampled
    for p in phases.values():
        t0 = start + round(p["start_s"] * 1e3) * MS
        t1 = start + round(p["end_s"] * 1e3) * MS
        assert p["duration_s"] > 0.5, p
        for g in p["gpus"]:
            truth = truth_energy_j(sim, g["gpu"], t0, t1)
            assert g["energy_j"] == pytest.approx(truth, rel=0.01), (p["label"], g["gpu"])
    steps = [m for m in rec.markers() if m.kind == "step"]
    assert [m.step for m in steps] == list(range(8))
    for name in ("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"):
        ts, _ = rec.raw(name, 0)
        assert len(ts) >= 20, name  # 100 ms apart over a job of more than 4 s


def test_the_page_shows_the_phases_in_a_browser(job: Path, tmp_path: Path) -> None:
    chromium()
    page = tmp_path / "train.html"
    made = _hfsampler("report", str(job), "-o", str(page))
    assert made.returncode == 0, made.stderr
    dom = run_chromium(page.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert [line for line in dom.stderr.splitlines() if CONSOLE_ERROR.search(line)] == []
    figures = dom.stdout.count(FIGURE)
    assert figures >= 3  # 2 GPUs and the scrape comparison
    labels = re.findall(r'class="shape-label-text"[^>]*>([^<]*)<', dom.stdout)
    for name in ("warmup", "epoch 0", "epoch 1", "eval"):
        assert labels.count(name) == figures, (name, labels)

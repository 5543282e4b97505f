"""`hfsampler record` around a real child, a crash mid-record, and `report` on what is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import inprocess
import numpy as np
import pytest
from inprocess import start_ns

from hfsampler import fields as F
from hfsampler.cli.main import build_parser
from hfsampler.config.flags import config_from_args
from hfsampler.profiling.recording import Recording
from hfsampler.sampling.plan import build_run
from hfsampler.sampling.stepping import VirtualClock
from hfsampler.sources.sim.source import SimSource

REPO = Path(__file__).resolve().parents[2]
POWER = "DCGM_FI_DEV_POWER_USAGE_INSTANT"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _hfsampler(*args: str) -> list[str]:
    return [sys.executable, "-m", "hfsampler", *args]


@pytest.mark.alone  # it measures time: no other test runs meanwhile
def test_record_passes_exit_code_and_context(tmp_path: Path) -> None:
    out = tmp_path / "run.hfs"
    child = "import time; time.sleep(1.5); raise SystemExit(3)"
    proc = subprocess.run(
        _hfsampler("record", "--source", "sim", "--gpus", "0,2", "--label", "team=ml", "-o",
                   str(out), "--", sys.executable, "-c", child),
        env=_env(SLURM_JOB_ID="4242", SLURM_ARRAY_TASK_ID="7"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "samples" in proc.stderr  # the status line
    # the "recording ... fields" line counts the fields `run` samples from the same flags
    parser, _ = build_parser()
    plan = build_run(config_from_args(parser.parse_args(["run", "--source", "sim", "--gpus", "3"])))
    assert f"recording 2 GPU(s), {len(plan.fields)} fields" in proc.stderr
    rec = Recording(out)
    assert rec.complete
    assert rec.end is not None
    assert rec.end["exit_code"] == 3
    assert rec.header["command"][-1] == child
    assert rec.header["job"] == {"slurm_job_id": "4242", "slurm_array_task_id": "7"}
    assert rec.header["labels"] == {"team": "ml"}
    assert [d.index for d in rec.devices] == [0, 2]
    start, end = rec.time_range_ns()
    assert 1.4 < (end - start) / 1e9 < 5
    # the raw samples are the sim's truth at their driver timestamps
    sim = SimSource(gpus=3)
    ts, v = rec.raw(POWER, 1)  # recorded GPU 1 is sim GPU 2
    assert len(ts) > 1000
    truth = sim.value_at(POWER, ts * 1000, 2)
    assert np.allclose(v, truth.astype(np.float32), rtol=0, atol=1e-3)


def test_crash_leaves_a_readable_file_and_report(tmp_path: Path) -> None:
    out = tmp_path / "crash.hfs"
    proc = subprocess.Popen(
        _hfsampler("record", "--source", "sim", "--quiet", "-o", str(out), "--", sys.executable,
                   "-c", "import time; time.sleep(60)"),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if out.exists() and out.stat().st_size > 50_000:  # a few windows are on disk
                break
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the orphaned child command
    rec = Recording(out)
    assert not rec.complete
    assert len(rec.windows(0).t1_ns) >= 1
    report = subprocess.run(_hfsampler("report", str(out), "--format", "json"), env=_env(),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert summary["complete"] is False
    assert summary["gpus"][0]["peak_power_w"] > 300
    html = tmp_path / "crash.html"
    report = subprocess.run(_hfsampler("report", str(out), "-o", str(html)), env=_env(),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert html.stat().st_size > 100_000
    assert "INCOMPLETE" in html.read_text()


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    """`hfsampler record --source sim` of every field (the opt-in per-link ones too) for 2 s, in
    this process on a virtual clock."""
    out = tmp_path_factory.mktemp("plan") / "x.hfs"
    clock = VirtualClock(start_ns())
    assert inprocess.record("--source", "sim", "--quiet", "--fields", "all", "--duration", "2s",
                            "-o", str(out), clock=clock) == 0  # fmt: skip
    return Recording(out)


def test_record_samples_the_gpm_group_as_run_does(sim_run: Recording) -> None:
    """The twelve DCGM_FI_PROF_* activity fields are recorded, with samples, in the gpm group."""
    rec = sim_run
    prof = [f.name for f in F.CATALOGUE if f.name.startswith("DCGM_FI_PROF_")]
    assert len(prof) == 12
    groups = {g.name: [f.name for f in g.fields] for g in rec.groups}
    assert groups.get(F.GPM) == prof
    assert rec.groups[rec.group_index(F.GPM)].interval_s == pytest.approx(0.1)
    for name in prof:
        ts, _ = rec.raw(name, 0)
        assert len(ts) >= 5, name  # ~20 at 100 ms over 2 s


def test_the_header_lists_what_run_samples_and_what_was_recorded(sim_run: Recording) -> None:
    """The header's groups are the plan `run` builds from the same flags; each field has samples
    (the "recording ... fields" line: test_record_passes_exit_code_and_context)."""
    rec = sim_run
    parser, _ = build_parser()
    plan = build_run(
        config_from_args(parser.parse_args(["run", "--source", "sim", "--fields", "all"]))
    )
    header = [(g.name, g.interval_s, [f.name for f in g.fields]) for g in rec.groups]
    assert header == [(g.name, g.interval_s, [f.name for f in g.fields]) for g in plan.groups]
    recorded = {
        f.name
        for i, g in enumerate(rec.groups)
        for c in rec.raw_chunks(i)
        for f in (g.fields[j] for j in np.unique(c.field))
    }
    assert recorded == {f.name for g in rec.groups for f in g.fields}
    start, end = rec.time_range_ns()
    assert end - start == 2 * 10**9
    assert rec.end is not None
    assert rec.end["exit_code"] == 0


def test_record_takes_max_ring_bytes_from_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cap `run` honours: rings over it are refused (exit 2) before anything is sampled."""
    from hfsampler.cli.main import main

    cfg = tmp_path / "c.yml"
    cfg.write_text("max_ring_bytes: 1MiB\n")
    out = tmp_path / "x.hfs"
    argv = ["record", "--config", str(cfg), "--source", "sim", "--quiet", "--window", "10s",
            "--duration", "1s", "-o", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "hfsampler: error: max_ring_bytes: --window 10s with intervals" in err
    assert not out.exists()


def test_record_keeps_nvlink_per_link_with_its_link_label(sim_run: Recording) -> None:
    """Each link is its own recorded field with its `link` label and its own samples; the link
    the sim has down on GPU 1 has samples on GPU 0 only."""
    rec = sim_run
    group = rec.group_index(F.SLOW)
    fields = rec.groups[group].fields
    tx = [j for j, f in enumerate(fields) if f.name == "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"]
    assert [fields[j].labels for j in tx] == [(("link", str(k)),) for k in range(18)]
    chunks = list(rec.raw_chunks(group))

    def samples(gpu: int, j: int) -> np.ndarray:
        return np.concatenate([c.cell(gpu, j)[1] for c in chunks])

    assert len(samples(0, tx[17])) >= 5
    assert len(samples(1, tx[17])) == 0
    assert samples(0, tx[0]).tolist() != samples(0, tx[1]).tolist()  # each link its own signal
    crc = [j for j, f in enumerate(fields) if f.name.startswith("DCGM_FI_DEV_NVLINK_CRC_FLIT")]
    counts = samples(1, crc[3])
    assert (np.diff(counts) >= 0).all()
    assert counts[-1] > counts[0]

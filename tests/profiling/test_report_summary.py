"""`hfsampler report`'s summary numbers where the recording is unusual: a power limit lowered
mid-run, a one-second job, a wall clock that steps back, no power field, runs of different GPU
counts compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sim_recordings
from sim_recordings import synthesize
from test_report import report, report_json

from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.sampling.ring import RingRows

S = 1_700_000_000 * 10**9
LIMIT = "DCGM_FI_DEV_POWER_MGMT_LIMIT"
POWER = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"


def test_time_above_a_limit_lowered_mid_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sim's cap is 700 W; at 10 s it is lowered to 300 W, below the sim's mean power: the
    time above it is the time above the limit in force, not above the highest limit seen."""
    store = sim_recordings.store_window

    def lowered(writer: RecordingWriter, gi: int, plan: Any, rows: RingRows, t0: int, t1: int,
                keep: Any) -> None:  # fmt: skip
        names = [f.name for f in plan.fields]
        if LIMIT in names and t0 >= S + 10 * 10**9:
            j = names.index(LIMIT)
            v, d = rows.values.copy(), rows.driver_ts_us.copy()
            v[:, :, j], v[0, :, j], d[:, :, j] = np.nan, 300.0, t0 // 1000
            rows = RingRows(rows.time_ns, rows.lateness_ns, v, d)
        store(writer, gi, plan, rows, t0, t1, keep)

    monkeypatch.setattr(sim_recordings, "store_window", lowered)
    path = tmp_path / "limit.hfs"
    synthesize(path, 1, 20, True, start_ns=S)
    rec = Recording(path)
    t, v = rec.raw(POWER, 0)
    lt, lv = rec.raw(LIMIT, 0)
    in_force = lv[(np.searchsorted(lt, t[:-1], side="right") - 1).clip(min=0)]
    truth_s = float((np.diff(t) * (v[:-1] > in_force)).sum()) / 1e6
    assert truth_s > 9.5  # the sim's power is above 300 W most of the time
    (gpu,) = report_json(str(path))["gpus"]
    assert gpu["time_above_power_limit_s"] == pytest.approx(truth_s, abs=1e-6)


def test_energy_counter_of_a_one_second_job(tmp_path: Path) -> None:
    """The driver's energy counter from its first raw sample: the first window counts."""
    path = tmp_path / "one.hfs"
    synthesize(path, 1, 1, True, start_ns=S)
    t, e_mj = Recording(path).raw(ENERGY, 0)
    assert len(t) > 2
    (gpu,) = report_json(str(path))["gpus"]
    assert gpu["energy_j"] == pytest.approx((e_mj[-1] - e_mj[0]) / 1e3, abs=1e-3)
    assert gpu["energy_j"] > 0.8 * gpu["energy_integrated_j"]


def test_wall_clock_stepping_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 10 s the wall clock steps back 5 s: the interval across the step holds for 0 s, energy
    never runs backwards, and the report says the clock stepped back."""
    store = sim_recordings.store_window
    back_ns = 5 * 10**9

    def stepped(writer: RecordingWriter, gi: int, plan: Any, rows: RingRows, t0: int, t1: int,
                keep: Any) -> None:  # fmt: skip
        if t0 >= S + 10 * 10**9:
            rows = RingRows(rows.time_ns - back_ns, rows.lateness_ns, rows.values,
                            rows.driver_ts_us - back_ns // 1000)  # fmt: skip
            t0, t1 = t0 - back_ns, t1 - back_ns
        store(writer, gi, plan, rows, t0, t1, keep)

    monkeypatch.setattr(sim_recordings, "store_window", stepped)
    path = tmp_path / "clockback.hfs"
    synthesize(path, 1, 20, True, start_ns=S)
    t, v = Recording(path).raw(POWER, 0)
    truth_j = float(((v[:-1] + v[1:]) / 2 * np.diff(t).clip(min=0)).sum()) / 1e6
    d = report_json(str(path))
    assert d["clock_steps_back"] == 1
    assert d["clock_stepped_back_s"] == pytest.approx(5.0, abs=0.01)
    assert d["gpus"][0]["energy_integrated_j"] == pytest.approx(truth_j, rel=1e-9)
    page = tmp_path / "clockback.html"
    assert report(str(path), "-o", str(page)).returncode == 0
    assert "the wall clock stepped back (steps: 1, " in page.read_text()


def test_no_power_samples_is_null_not_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU whose power was never read: its integrals are unknown (null), and a comparison of
    two such runs shows no difference for them."""
    store = sim_recordings.store_window

    def unpowered(writer: RecordingWriter, gi: int, plan: Any, rows: RingRows, t0: int, t1: int,
                  keep: Any) -> None:  # fmt: skip
        names = [f.name for f in plan.fields]
        v = rows.values.copy()
        for name in ("DCGM_FI_DEV_POWER_USAGE_INSTANT", "DCGM_FI_DEV_POWER_USAGE"):
            if name in names:
                v[:, :, names.index(name)] = np.nan
        store(writer, gi, plan, RingRows(rows.time_ns, rows.lateness_ns, v, rows.driver_ts_us),
              t0, t1, keep)  # fmt: skip

    monkeypatch.setattr(sim_recordings, "store_window", unpowered)
    base, new = tmp_path / "base.hfs", tmp_path / "new.hfs"
    synthesize(base, 1, 3, True, start_ns=S)
    synthesize(new, 1, 3, True, start_ns=S, seed=3)
    (gpu,) = report_json(str(base))["gpus"]
    assert gpu["power_samples"] == 0
    for key in ("energy_integrated_j", "mean_power_w", "time_above_power_limit_s"):
        assert gpu[key] is None, key
    d = report_json(str(base), str(new))
    (pair,) = d["delta"]["gpus"]
    for key in ("energy_integrated_j", "mean_power_w", "time_above_power_limit_s"):
        assert pair[key]["delta"] is None, key
    assert d["delta"]["job"]["energy_integrated_j"]["delta"] is None


def test_compare_different_gpu_counts_says_what_is_not_compared(tmp_path: Path) -> None:
    base, new = tmp_path / "g1.hfs", tmp_path / "g3.hfs"
    synthesize(base, 1, 2, True, start_ns=S)
    synthesize(new, 3, 2, True, start_ns=S)
    d = report_json(str(base), str(new))
    assert len(d["delta"]["gpus"]) == 1
    assert d["gpus_not_compared"] == {"base": [], "new": [1, 2]}
    page = tmp_path / "diff.html"
    assert report(str(base), str(new), "-o", str(page)).returncode == 0
    assert "Not compared: new's GPU 1, GPU 2" in page.read_text()

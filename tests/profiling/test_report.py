"""`hfsampler report`: phase and step tables against the sim's truth, a torn tail, two runs
compared, bad input, phases shaded on the page in headless Chromium; the helpers the other report
tests use (a recording's page drawn in Chromium: test_report_processes).

The command runs in this process (``inprocess.hfsampler``); the page is drawn by a real Chromium,
from Debian's ``chromium`` package with a fresh profile; where it is missing the test skips,
except under CI, where it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inprocess import Exited, hfsampler
from sim_recordings import start_for, synthesize

from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import Marker
from hfsampler.sources.sim.source import SimSource

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
)  # fmt: skip
FIGURE = 'class="plotly-graph-div js-plotly-plot"'  # a figure plotly drew
CONSOLE_ERROR = re.compile(r"CONSOLE.*(error|uncaught)|Uncaught", re.IGNORECASE)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "chromium not found: apt-get install --no-install-recommends chromium"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {message}", pytrace=False)
        pytest.skip(message)
    return found


def run_chromium(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="hfs-chromium-") as profile:
        return subprocess.run(
            [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL,
        )  # fmt: skip


def decode_png(data: bytes) -> np.ndarray:
    """8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes) to an [h, w, channels] array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8
            assert color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + width * channels)
    out = np.zeros((height, width * channels), np.int64)
    prev = np.zeros(width * channels, np.int64)
    for y in range(height):
        line, kind = raw[y, 1:].astype(np.int64), raw[y, 0]
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) % 256
        else:  # sub, average, paeth: byte by byte, on Python ints (numpy's scalars are slow)
            got, above = line.tolist(), prev.tolist()  # got: decoded up to x, filtered after
            for x in range(len(got)):
                a = got[x - channels] if x >= channels else 0
                b, c = above[x], (above[x - channels] if x >= channels else 0)
                if kind == 1:
                    pred = a
                elif kind == 3:
                    pred = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                got[x] = (got[x] + pred) % 256
            cur = np.array(got, np.int64)
        out[y], prev = cur, cur
    return out.reshape(height, width, channels)


# -- phases, steps, comparison, bad input: on sim recordings made offline (sim_recordings) --

MS = 1_000_000
SECONDS = 20
POWER = "DCGM_FI_DEV_POWER_USAGE_INSTANT"


def _job_markers(start: int) -> list[Marker]:
    """load, then train with 9 steps of 1.3 s and an eval nested inside, a stray end, a mark, and
    a checkpoint the job never ended (it was killed)."""
    at = lambda ms: start + ms * MS  # noqa: E731
    out = [Marker(at(1000), "begin", "load"), Marker(at(3500), "end", "load"),
           Marker(at(3500), "begin", "train", source="output"),
           *(Marker(at(3500 + 1300 * k), "step", "step", step=k) for k in range(9)),
           Marker(at(10250), "begin", "eval"), Marker(at(12100), "end", "eval"),
           Marker(at(15200), "end", "train"), Marker(at(16000), "end", "nothing"),
           Marker(at(17000), "mark", "lr drop")]  # fmt: skip
    return [*out, Marker(at(18000), "begin", "checkpoint")]


@pytest.fixture(scope="module")
def marked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A 20 s recording of 2 sim GPUs with the job's markers, and its start."""
    path = tmp_path_factory.mktemp("marked") / "job.hfs"
    start = start_for(SECONDS)
    synthesize(path, 2, SECONDS, quantize=False, start_ns=start, markers=_job_markers(start))
    return path, start


def report(*args: str) -> Exited:
    """``hfsampler report ARGS`` in this process, its status and output (other test files use
    it; test_report_errors runs one as a real process, with its stdout piped)."""
    return hfsampler("report", *args)


def report_json(*args: str) -> dict[str, Any]:
    made = report(*args, "--format", "json")
    assert made.returncode == 0, made.stderr
    out: dict[str, Any] = json.loads(made.stdout)
    return out


def truth_energy_j(sim: SimSource, gpu: int, t0_ns: int, t1_ns: int) -> float:
    """The sim's instant power holds for each millisecond: energy is its sum over the span."""
    t = np.arange(t0_ns, t1_ns, MS)
    return float(sim.value_at(POWER, t, gpu).sum()) * 1e-3


def test_phase_tables_match_the_sim_truth(marked: tuple[Path, int]) -> None:
    path, start = marked
    d = report_json(str(path))
    sim, rec = SimSource(gpus=2), Recording(path)
    phases = {p["label"]: p for p in d["phases"]}
    assert list(phases) == ["load", "train", "eval", "checkpoint"]
    assert [phases[k]["depth"] for k in phases] == [0, 0, 1, 0]  # eval is inside train
    assert phases["checkpoint"]["ended"] is False  # killed: it runs to the end
    assert phases["checkpoint"]["end_s"] == pytest.approx(SECONDS)
    assert phases["train"]["duration_s"] == pytest.approx(11.7)
    assert any("'nothing'" in p and "ignored" in p for p in d["marker_problems"])
    assert [m["name"] for m in d["marks"]] == ["lr drop"]
    for g in d["gpus"]:  # the whole run's p99 comes from the same 0.5 W histogram
        _, v = rec.raw(POWER, g["gpu"])
        assert abs(g["p99_power_w"] - float(np.percentile(v, 99))) <= g["p99_resolution_w"]
    for p in phases.values():
        t0, t1 = start + round(p["start_s"] * 1e3) * MS, start + round(p["end_s"] * 1e3) * MS
        total = 0.0
        for g in p["gpus"]:
            truth = truth_energy_j(sim, g["gpu"], t0, t1)
            total += truth
            assert g["energy_j"] == pytest.approx(truth, rel=0.01), (p["label"], g["gpu"])
            assert g["energy_wh"] == pytest.approx(g["energy_j"] / 3600, rel=1e-6)
            ts, v = rec.raw(POWER, g["gpu"])
            inside = v[(ts >= t0 // 1000) & (ts < t1 // 1000)]
            assert g["peak_power_w"] == pytest.approx(float(inside.max()))
            # the histogram's bins are 0.5 W: its p99 is within one of numpy's exact one
            assert abs(g["p99_power_w"] - float(np.percentile(inside, 99))) <= 0.5
            fb_ts, fb = rec.raw("DCGM_FI_DEV_FB_USED", g["gpu"])
            assert g["memory_high_water_mib"] == pytest.approx(
                float(fb[(fb_ts >= t0 // 1000) & (fb_ts < t1 // 1000)].max())
            )
            for key, name in (("mean_sm_active", "SM_ACTIVE"),
                              ("mean_tensor_active", "PIPE_TENSOR_ACTIVE")):  # fmt: skip
                # the driver's value holds for its refresh period (value_at takes the period's
                # start): the time-weighted mean over the phase, millisecond by millisecond
                field_name = f"DCGM_FI_PROF_{name}"
                every_ms = np.arange(t0, t1, MS)
                held = every_ms - every_ms % sim.refresh_ns(field_name)
                activity = sim.value_at(field_name, held, g["gpu"])
                # (the recording starts on a whole second, so the phases' edges fall on the
                # 100 ms refresh grid; a job's own edges need not, hence the margin)
                assert g[key] == pytest.approx(float(activity.mean()), abs=0.015), key
            # the reasons are read every 100 ms: each throttling episode is known to within that
            episodes = [(max(e.start_ns, t0), min(e.end_ns, t1))
                        for e in sim.throttles(g["gpu"], t0, t1)]  # fmt: skip
            throttled = sum(max(0, b - a) for a, b in episodes) / 1e9
            slack = 0.2 * len(episodes)
            assert abs(g["throttled_s"].get("sw_power_cap", 0.0) - throttled) <= slack
        assert p["energy_j"] == pytest.approx(total, rel=0.01)


def test_energy_per_step_matches_the_sim_truth(marked: tuple[Path, int]) -> None:
    path, start = marked
    (steps,) = report_json(str(path))["steps"]
    sim = SimSource(gpus=2)
    assert steps["steps"] == 9
    assert steps["step_numbers"] == list(range(9))
    assert steps["duration_s"]["mean"] == pytest.approx(1.3)  # the last ends with train
    truth = [sum(truth_energy_j(sim, g, start + (3500 + 1300 * k) * MS,
                                 start + (4800 + 1300 * k) * MS) for g in range(2))
             for k in range(9)]  # fmt: skip
    assert steps["step_energy_j"] == pytest.approx(truth, rel=0.01)
    assert steps["energy_per_step_j"]["mean"] == pytest.approx(float(np.mean(truth)), rel=0.01)
    assert steps["energy_per_step_j"]["std"] == pytest.approx(float(np.std(truth)), abs=1.0)


def test_torn_tail_reports_what_was_written(tmp_path: Path) -> None:
    """A recorder killed mid-write: no end chunk and half a frame; the phase still open runs to
    the last readable data."""
    path = tmp_path / "killed.hfs"
    start = start_for(SECONDS)
    synthesize(path, 2, SECONDS, quantize=False, start_ns=start, markers=_job_markers(start),
               end=False)  # fmt: skip
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    d = report_json(str(path))
    assert d["torn_tail"] is True
    assert d["complete"] is False
    assert 18.5 < d["duration_s"] < SECONDS  # the last whole windows before the cut
    phases = {p["label"]: p for p in d["phases"]}
    assert phases["checkpoint"]["ended"] is False
    assert phases["checkpoint"]["end_s"] == pytest.approx(d["duration_s"])
    sim = SimSource(gpus=2)
    train = phases["train"]
    truth = truth_energy_j(sim, 0, start + 3500 * MS, start + 15200 * MS)
    assert train["gpus"][0]["energy_j"] == pytest.approx(truth, rel=0.01)


def test_phases_are_shaded_on_every_plot_in_chromium(marked: tuple[Path, int],
                                                     tmp_path: Path) -> None:  # fmt: skip
    chromium()
    html = tmp_path / "job.html"
    made = report(str(marked[0]), "-o", str(html))
    assert made.returncode == 0, made.stderr
    assert html.stat().st_size < 15e6
    dom = run_chromium(html.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert [line for line in dom.stderr.splitlines() if CONSOLE_ERROR.search(line)] == []
    figures = dom.stdout.count(FIGURE)
    assert figures >= 3  # 2 GPUs and the scrape comparison
    labels = re.findall(r'class="shape-label-text"[^>]*>([^<]*)<', dom.stdout)
    for name in ("load", "train", "eval", "checkpoint", "lr drop"):
        assert labels.count(name) == figures, name  # drawn on every figure
    for h3 in ("load: 1.000 s to 3.500 s", "checkpoint: 18.000 s to 20.000 s"):
        assert h3 in dom.stdout  # the phase's own table
    assert "NO: runs to the end of the recording" in dom.stdout


def test_compare_two_runs(marked: tuple[Path, int], tmp_path: Path) -> None:
    """BASE NEW: numbers side by side with their difference, and the power overlaid."""
    base = marked[0]
    new = tmp_path / "new.hfs"
    start = start_for(SECONDS)
    markers = [m for m in _job_markers(start) if m.name != "eval"]
    synthesize(new, 2, SECONDS, quantize=False, seed=7, start_ns=start, markers=markers)
    b, n = report_json(str(base)), report_json(str(new))
    d = report_json(str(base), str(new))
    assert d["base"]["gpus"] == b["gpus"]
    assert d["new"]["gpus"] == n["gpus"]
    job = d["delta"]["job"]
    want_j = sum(g["energy_integrated_j"] for g in n["gpus"]) - sum(
        g["energy_integrated_j"] for g in b["gpus"]
    )
    assert job["energy_integrated_j"]["delta"] == pytest.approx(want_j, abs=1e-4)
    assert job["peak_power_w"]["new"] == max(g["peak_power_w"] for g in n["gpus"])
    g0 = d["delta"]["gpus"][0]
    want = n["gpus"][0]["energy_integrated_j"] - b["gpus"][0]["energy_integrated_j"]
    assert g0["energy_integrated_j"]["delta"] == pytest.approx(want, abs=1e-5)
    assert g0["peak_power_w"]["base"] == b["gpus"][0]["peak_power_w"]
    phases = {p["label"]: p for p in d["delta"]["phases"]}
    assert phases["eval"]["in_new"] is False
    assert phases["eval"]["energy_j"]["delta"] is None
    train_b = next(p for p in b["phases"] if p["label"] == "train")
    train_n = next(p for p in n["phases"] if p["label"] == "train")
    assert phases["train"]["energy_j"]["delta"] == pytest.approx(
        train_n["energy_j"] - train_b["energy_j"], abs=1e-5
    )
    (steps,) = d["delta"]["steps"]
    assert steps["energy_mean_j"]["new"] == n["steps"][0]["energy_per_step_j"]["mean"]

    chromium()
    html = tmp_path / "diff.html"
    made = report(str(base), str(new), "-o", str(html))
    assert made.returncode == 0, made.stderr
    dom = run_chromium(html.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert [line for line in dom.stderr.splitlines() if CONSOLE_ERROR.search(line)] == []
    assert dom.stdout.count(FIGURE) == 1
    assert dom.stdout.count('class="main-svg"') >= 2
    legend = re.findall(r'class="legendtext"[^>]*>([^<]*)<', dom.stdout)
    assert {"base", "new"} <= set(legend)
    assert "train: energy, all GPUs" in dom.stdout
    assert "energy, integrated, all GPUs" in dom.stdout
    assert "step: energy per step (mean)" in dom.stdout


@pytest.mark.parametrize("case", ["missing", "not a recording", "three files", "empty"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, case: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from hfsampler.cli.main import main

    junk = tmp_path / "notes.hfs"
    junk.write_text("not a recording\n")
    empty = tmp_path / "empty.hfs"
    empty.write_bytes(b"")
    argv = {"missing": [str(tmp_path / "gone.hfs")], "not a recording": [str(junk)],
            "three files": [str(junk)] * 3, "empty": [str(empty)]}[case]  # fmt: skip
    assert main(["report", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    want = {"missing": "gone.hfs: no such recording", "not a recording": "not an hfsampler "
            "recording", "three files": "one recording, or two to compare (BASE.hfs NEW.hfs); "
            "got 3", "empty": "not an hfsampler recording"}[case]  # fmt: skip
    assert err.startswith("hfsampler: error: ")
    assert want in err

"""End to end on Jetson trees: ``hfsampler run --source jetson`` against each fixture board's
sysfs (tests/support/jetson_trees.py, rewritten in place as the clock moves) pushes to a real
Prometheus,
and Prometheus's API is checked as the NVML path's is: the series and their labels (one per rail
and zone), each field's real refresh period, and the spike planted on the GPU rail every second
as that window's ``_max``.

One run per board pushes to every Prometheus version at once; each version's tests then read
what it stored (a run per board and version started hfsampler twice for the same data).
"""

from __future__ import annotations

import itertools
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import receivers as rx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import jetson_trees as jt  # tests/, beside fake_nvml

pytestmark = [pytest.mark.integration, pytest.mark.long]  # half a minute together

DURATION_S = 5
WINDOW_MS = 1000
POWER = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
RAIL_POWER = "hfsampler_jetson_rail_power_watts"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
REFRESH = "hfsampler_field_refresh_seconds"
STALL_TICKS = 25  # a 30 ms spike read every ~3.5 ms: a window missing this many ticks may miss it


@dataclass(frozen=True)
class JetsonRun:
    board: jt.Board
    root: Path
    run: rx.CliRun
    spikes: tuple[jt.Spike, ...]
    cluster: str
    log_at: dict[str, int]  # per Prometheus version: where its log stood before the run

    @property
    def span(self) -> tuple[float, float]:
        return self.run.started_ns / 1e9 - 1, self.run.ended_ns / 1e9 + 1

    def sel(self, extra: str = "") -> str:
        return f'{{cluster="{self.cluster}"{extra}}}'


@pytest.fixture(scope="module")
def jetson_runs() -> dict[str, JetsonRun]:
    """The runs made so far, by board: however pytest orders boards and versions, one each."""
    return {}


@pytest.fixture(scope="module", params=sorted(jt.BOARDS))
def jetson_run(
    request: pytest.FixtureRequest,
    jetson_runs: dict[str, JetsonRun],
    every_prometheus: dict[str, rx.Prometheus],
    tmp_path_factory: pytest.TempPathFactory,
) -> JetsonRun:
    board = jt.BOARDS[request.param]
    if board.name in jetson_runs:
        return jetson_runs[board.name]
    root = tmp_path_factory.mktemp("jetson") / board.name
    config = root.parent / "hfsampler.yml"
    config.write_text(f"source: jetson\njetson: {{sysfs_root: {root}}}\n")
    cluster = f"jetson-{board.name}"
    args = ["run", "--config", str(config), "--window", "1s", "--duration", f"{DURATION_S}s",
            "--listen", "", "--label", f"cluster={cluster}"]  # fmt: skip
    for prom in every_prometheus.values():
        args += ["--remote-write", prom.write_url]
    log_at = {name: len(prom.log_text()) for name, prom in every_prometheus.items()}
    with jt.running(board, root) as writer:
        try:
            run = rx.run_cli(args, timeout_s=DURATION_S + 45)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"hfsampler {' '.join(args)} did not exit in time\n{exc.stderr!r}")
    run.check()
    jetson_runs[board.name] = JetsonRun(board, root, run, tuple(writer.spikes), cluster, log_at)
    return jetson_runs[board.name]


def _expected(r: JetsonRun) -> list[tuple[str, dict[str, str]]]:
    """Every (series name, own labels) a default run on this tree exports: what discovery
    keeps, but a zone that reads nothing (kept, and retried) has no sample to export."""
    from hfsampler.config.settings import Config
    from hfsampler.sampling.plan import discover
    from hfsampler.sampling.window import exported_names
    from hfsampler.sources.base import SourceSpec

    inv = discover(SourceSpec("jetson", jetson_root=str(r.root)), Config().selected_fields())
    silent = {v for f in inv.fields for v in dict(f.labels).values()
              if f"{v} temperature" in r.board.unreadable}  # fmt: skip
    return [(name, dict(f.labels)) for f in inv.fields for name in exported_names(f)
            if not silent & set(dict(f.labels).values())]  # fmt: skip


def _windows(prom: rx.Prometheus, selector: str, r: JetsonRun) -> list[tuple[int, float]]:
    raw = prom.raw_samples(selector, *r.span)
    assert len(raw) == 1, f"{selector}: {sorted(raw)}"
    (samples,) = raw.values()
    return samples


def test_series_and_labels(prometheus: rx.Prometheus, jetson_run: JetsonRun) -> None:
    r, board = jetson_run, jetson_run.board
    expected = _expected(r)
    assert len(expected) > 40
    hostname = socket.gethostname()
    missing = []
    uuids = set()
    for name, own in expected:
        extra = "".join(f',{k}="{v}"' for k, v in own.items())
        found = prometheus.series(name + r.sel(extra), *r.span)
        if len(found) != 1:
            missing.append(f"{name}{own}: {len(found)} series")
            continue
        labels = found[0]
        assert labels["gpu"] == "0"
        assert labels["device"] == "nvidia0"
        assert labels["modelName"] == board.model
        assert labels["DCGM_FI_DRIVER_VERSION"] == board.l4t
        assert labels["pci_bus_id"] == board.gpu_device
        assert labels["hostname"] == hostname
        uuids.add(labels["UUID"])
    assert not missing, "\n".join(missing)
    assert len(uuids) == 1
    rails = {dict(s)["rail"] for s in prometheus.series(RAIL_POWER + r.sel(), *r.span)}
    assert rails == set(board.rails)
    # (a zone that never read has a series all the same: the stale marker sent at shutdown)
    temps = prometheus.raw_samples("hfsampler_jetson_temp_celsius" + r.sel(), *r.span)
    silent = {z for z in board.zones if f"{z} temperature" in board.unreadable}
    assert {dict(k)["zone"] for k, v in temps.items() if v} == set(board.zones) - silent


@pytest.mark.parametrize(
    ("field", "own", "period_s"),
    [
        ("hfsampler_jetson_rail_current_amperes", "gpu_rail", jt.INA_S),
        (POWER, None, jt.INA_S),
        ("DCGM_FI_DEV_GPU_UTIL", None, jt.LOAD_S),
        ("DCGM_FI_DEV_GPU_TEMP", None, jt.TEMP_S),
    ],
)
def test_refresh_periods_are_the_hardware_s(
    prometheus: rx.Prometheus, jetson_run: JetsonRun, field: str, own: str | None, period_s: float
) -> None:
    """hfsampler_field_refresh_seconds shows each field's real resolution, not the tick's."""
    r = jetson_run
    extra = f',field="{field}"' + (f',rail="{r.board.gpu_rail}"' if own else "")
    samples = _windows(prometheus, REFRESH + r.sel(extra), r)
    typical = statistics.median(v for _, v in samples[1:-1])
    # a window's samples are whole periods, and a tick can be late: judge the typical window
    assert typical == pytest.approx(period_s, rel=0.3), samples


def _missed(prometheus: rx.Prometheus, r: JetsonRun) -> dict[int, float]:
    fast = r.sel(',group="fast"')
    raw = prometheus.raw_samples(f"hfsampler_missed_ticks_total{fast}", *r.span)
    (samples,) = raw.values()
    return {ts: b - a for (_, a), (ts, b) in itertools.pairwise(samples)}


@pytest.mark.parametrize("metric", [POWER, RAIL_POWER])
def test_the_planted_spike_is_the_window_max(
    prometheus: rx.Prometheus, jetson_run: JetsonRun, metric: str
) -> None:
    r = jetson_run
    extra = f',rail="{r.board.gpu_rail}"' if metric == RAIL_POWER else ""
    samples = _windows(prometheus, f"{metric}_max" + r.sel(extra), r)
    missed = _missed(prometheus, r)
    lowest = min(r.board.spike_watts(s) for s in r.spikes)
    checked = excused = 0
    for ts_ms, value in samples[1:-1]:  # complete windows
        t1 = ts_ms * 1_000_000
        t0 = t1 - WINDOW_MS * 1_000_000
        inside = [s for s in r.spikes if t0 <= s.on_ns and s.off_ns <= t1]
        if not inside:
            assert value < lowest, f"window ending {ts_ms}: _max {value} without a spike"
            continue
        want = max(r.board.spike_watts(s) for s in inside)
        if value != pytest.approx(want, rel=1e-9) and missed.get(ts_ms, 0) >= STALL_TICKS:
            excused += 1  # the sampler reported the stall that hid the spike
            continue
        assert value == pytest.approx(want, rel=1e-9), f"window ending {ts_ms}: {inside}"
        checked += 1
    assert checked >= 2, f"{checked} spikes checked, {excused} hidden by reported stalls"


def test_energy_counts_the_gpu_rail(prometheus: rx.Prometheus, jetson_run: JetsonRun) -> None:
    """The integrated counter's rate is the GPU rail's mean power (spikes included)."""
    r = jetson_run
    energy = _windows(prometheus, ENERGY + r.sel(), r)
    values = [v for _, v in energy]
    assert all(b >= a for a, b in itertools.pairwise(values)), values
    (t_a, e_a), (t_b, e_b) = energy[1], energy[-1]
    watts = (e_b - e_a) / (t_b - t_a)  # mJ per ms
    means = [v for ts, v in _windows(prometheus, POWER + r.sel(), r) if t_a < ts <= t_b]
    assert watts == pytest.approx(statistics.mean(means), rel=0.1)


def test_logs_clean(prometheus: rx.Prometheus, jetson_run: JetsonRun) -> None:
    problems = prometheus.log_problems(since=jetson_run.log_at[prometheus.name])
    assert problems == [], "\n".join(problems)
    text = jetson_run.run.stderr
    assert "Traceback" not in text
    assert "jetson: refresh periods:" in text  # the periods it measured, said once at start
    warned = [ln for ln in text.splitlines() if " WARNING " in ln and "jetson" in ln]
    expected = len(jetson_run.board.unreadable) + (not jetson_run.board.emc)
    expected += not jetson_run.board.nvmap
    # each missing or unreadable file once: the sampler process, opened with only the fields
    # discovery kept, has nothing to say again
    assert len(warned) == expected, warned

"""End to end: ``hfsampler run --source sim`` pushes to real Prometheus (2, 3) and VictoriaMetrics.

The harness checks first (a hand-built Remote-Write request goes in and comes back out of each
receiver, and a rejected sample shows up in the log scan), so a failure below them is the
package's. Then one 8 s sim run pushes to every receiver at once, and each receiver's HTTP API is
checked against the sim source's ground truth: series and labels, spike peaks, window means,
counters, and a clean receiver log.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pytest
import receivers as rx

if TYPE_CHECKING:
    from hfsampler.fields import Field
    from hfsampler.sources.sim.source import SimSource

pytestmark = pytest.mark.integration

GPUS = 2
WINDOW_MS = 1000
DURATION_S = 8
EXTERNAL = {"cluster": "ci"}
DEVICE_LABELS = ("gpu", "UUID", "device", "modelName", "hostname", "pci_bus_id",
                 "DCGM_FI_DRIVER_VERSION")  # fmt: skip
POWER_INSTANT = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"


# --------------------------------------------------------------------------------------------
# The harness itself


@pytest.mark.parametrize("name", rx.RECEIVER_NAMES)
def test_receiver_round_trip(receivers: dict[str, rx.Receiver], name: str) -> None:
    """A hand-encoded, snappy-compressed WriteRequest is stored and queryable, samples exact."""
    receiver = receivers[name]
    log_at = len(receiver.log_text())
    now_ms = int(time.time() * 1000)
    samples = [(now_ms - 3000 + 250 * i, float(i) + 0.5) for i in range(8)]
    labels = {"job": "harness", "probe": name, "cluster": "ci"}
    status, body = rx.push(
        receiver.write_url, rx.encode_write_request([("harness_probe", labels, samples)])
    )
    assert 200 <= status < 300, f"{name} answered {status}: {body}"

    receiver.flush()
    selector = f'harness_probe{{probe="{name}"}}'
    found = receiver.wait_for(selector, time_s=now_ms / 1000)
    assert [r["metric"] for r in found] == [{"__name__": "harness_probe", **labels}]
    assert float(found[0]["value"][1]) == samples[-1][1]

    raw = receiver.raw_samples(selector, (now_ms - 10_000) / 1000, now_ms / 1000)
    assert list(raw.values()) == [samples]

    step = receiver.query_range(f"max({selector})", (now_ms - 3000) / 1000, now_ms / 1000, 1)
    assert step
    assert step[0]["values"]

    assert receiver.series(selector) == [{"__name__": "harness_probe", **labels}]
    assert receiver.log_problems(since=log_at) == []


def test_log_scan_sees_rejected_samples(prometheus: rx.Prometheus) -> None:
    """An out-of-order sample is refused by Prometheus and caught by ``log_problems``."""
    log_at = len(prometheus.log_text())
    now_ms = int(time.time() * 1000)
    series = ("harness_ooo", {"job": "harness"}, [(now_ms, 1.0)])
    status, _ = rx.push(prometheus.write_url, rx.encode_write_request([series]))
    assert status == 204
    late = ("harness_ooo", {"job": "harness"}, [(now_ms - 60_000, 2.0)])
    status, _ = rx.push(prometheus.write_url, rx.encode_write_request([late]))
    assert status == 400
    deadline = time.monotonic() + 5
    while not prometheus.log_problems(since=log_at) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("out of order" in line.lower() for line in prometheus.log_problems(since=log_at))


def test_log_scan_sees_rejected_requests(victoria_metrics: rx.VictoriaMetrics) -> None:
    """A request VictoriaMetrics cannot decode is refused and caught by ``log_problems``."""
    log_at = len(victoria_metrics.log_text())
    status, _ = rx.push(victoria_metrics.write_url, b"\xff not a WriteRequest")
    assert status == 400
    deadline = time.monotonic() + 5
    while not victoria_metrics.log_problems(since=log_at) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("cannot unmarshal" in line for line in victoria_metrics.log_problems(since=log_at))


def test_hfsampler_cli_runs() -> None:
    """``python -m hfsampler run --help`` works (else the end-to-end tests below cannot)."""
    result = rx.run_cli(["run", "--help"], timeout_s=30)
    result.check()
    for flag in ("--source", "--gpus", "--window", "--duration", "--remote-write", "--label"):
        assert flag in result.stdout, f"run --help does not mention {flag}"


# --------------------------------------------------------------------------------------------
# One sim run, pushed to every receiver


@dataclass(frozen=True)
class SimPush:
    run: rx.CliRun
    log_at: dict[str, int]  # each receiver's log length before the run
    listen: str


NVLINK_TX = "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"
NVLINK_CRC = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL"


@pytest.fixture(scope="module")
def sim_push(receivers: dict[str, rx.Receiver]) -> SimPush:
    log_at = {name: len(r.log_text()) for name, r in receivers.items()}
    listen = f"127.0.0.1:{rx.free_port()}"
    args = rx.sim_run_args(
        [r.write_url for r in receivers.values()],
        listen=listen,
        gpus=GPUS,
        window=f"{WINDOW_MS // 1000}s",
        duration=f"{DURATION_S}s",
        labels=EXTERNAL,
        # the default selection, and two of the opt-in per-link NVLink families: a gauge, a counter
        extra=["--fields", f"fast,slow,gpm,{NVLINK_TX},{NVLINK_CRC}"],
    )
    try:
        run = rx.run_cli(args, timeout_s=DURATION_S + 45)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"hfsampler {' '.join(args)} did not exit in time\n{exc.stdout!r}\n{exc.stderr!r}"
        )
    run.check()
    return SimPush(run, log_at, listen)


# hfsampler is imported lazily, so the harness tests above still run when the package is broken.


def _sim() -> SimSource:
    """The ground truth: the same seeded source the run sampled (the CLI's default seed)."""
    from hfsampler.config.settings import Config
    from hfsampler.sources.sim.source import SimSource

    return SimSource(gpus=GPUS, seed=Config().seed)


def _group(metric: str) -> str:
    """The sampling group (fast, slow, ...) of a catalogue field."""
    from hfsampler.fields import BY_NAME

    return BY_NAME[metric].group


def _default_fields() -> tuple[Field, ...]:
    from hfsampler.config.settings import Config

    # what a sim run samples by default: the catalogue less what only a Jetson's sysfs has
    return tuple(f for f in Config().selected_fields() if f.nvml_readable)


def _expected_names() -> list[str]:
    """Every series name a default run exports: each default field's name and siblings."""
    from hfsampler.sampling.window import exported_names

    return [name for f in _default_fields() for name in exported_names(f)]


def _span(push: SimPush) -> tuple[float, float]:
    return push.run.started_ns / 1e9 - 1, push.run.ended_ns / 1e9 + 1


def _by_gpu(raw: dict[rx.Labels, list[tuple[int, float]]]) -> dict[int, list[tuple[int, float]]]:
    out: dict[int, list[tuple[int, float]]] = {}
    for labels, samples in raw.items():
        gpu = int(dict(labels)["gpu"])
        assert gpu not in out, f"two series for gpu {gpu}: {sorted(raw)}"
        out[gpu] = samples
    return out


def _full_windows(samples: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The samples of complete windows: the first (started mid-window) and last dropped."""
    return samples[1:-1]


@dataclass(frozen=True)
class TickCounts:
    """Per sampling group and window end (ms): ticks taken and ticks missed in that window."""

    taken: dict[str, dict[int, float]]
    missed: dict[str, dict[int, float]]

    def _groups(self, group: str) -> list[str]:
        # A group the self-metrics do not name (renamed, split): be conservative, take them all.
        return [group] if group in self.missed else sorted(self.missed)

    def missed_ticks(self, group: str, ts_ms: int) -> float:
        return max(self.missed[g].get(ts_ms, 0.0) for g in self._groups(group))

    def missed_fraction(self, group: str, ts_ms: int) -> float:
        fractions = []
        for g in self._groups(group):
            taken = self.taken.get(g, {}).get(ts_ms)
            missed = self.missed[g].get(ts_ms)
            assert taken is not None, f"no hfsampler_ticks_total{{group={g!r}}} at {ts_ms}"
            assert missed is not None, f"no hfsampler_missed_ticks_total{{group={g!r}}} at {ts_ms}"
            fractions.append(missed / max(1.0, taken + missed))
        return max(fractions)


def _tick_counts(receiver: rx.Receiver, push: SimPush) -> TickCounts:
    """The sampler's own per-window tick accounting, as pushed in its ``hfsampler_*`` series.

    On a loaded 2-core runner the sampler process can be descheduled for longer than a spike's
    4 ms plateau; it counts those ticks as missed, and the checks below allow for what it says.
    """
    start_s, end_s = _span(push)
    out: list[dict[str, dict[int, float]]] = []
    for metric in ("hfsampler_ticks_total", "hfsampler_missed_ticks_total"):
        raw = receiver.raw_samples(f'{metric}{{cluster="ci"}}', start_s, end_s)
        assert raw, f"{metric} was not pushed"
        per_group: dict[str, dict[int, float]] = {}
        for labels, samples in raw.items():
            group = dict(labels).get("group", "")
            per_group[group] = {
                ts: after - before for (_, before), (ts, after) in itertools.pairwise(samples)
            }
        out.append(per_group)
    return TickCounts(*out)


# A spike's plateau lasts 4 ms: a window that missed fewer ticks cannot have slept through it.
STALL_TICKS = 3


RECEIVERS = rx.RECEIVER_NAMES


@pytest.mark.parametrize("name", RECEIVERS)
def test_series_and_labels(receivers: dict[str, rx.Receiver], sim_push: SimPush, name: str) -> None:
    receiver = receivers[name]
    start_s, end_s = _span(sim_push)
    receiver.flush()
    inventory = _sim().open(_default_fields())
    devices = {str(d.index): d for d in inventory.devices}
    hostname = socket.gethostname()
    missing = []
    for metric in _expected_names():
        found = receiver.series(f'{metric}{{cluster="ci"}}', start_s, end_s)
        # one series per GPU, or several where a field has instances (the XID counter per code)
        gpus = sorted({s.get("gpu", "?") for s in found})
        if gpus != sorted(devices):
            missing.append(f"{metric}: gpus {gpus}")
            continue
        for labels in found:
            absent = [k for k in DEVICE_LABELS if not labels.get(k)]
            assert not absent, f"{metric} lacks {absent}: {labels}"
            dev = devices[labels["gpu"]]
            assert labels["UUID"] == dev.uuid
            assert labels["device"] == dev.device
            assert labels["modelName"] == dev.model_name
            assert labels["pci_bus_id"] == dev.pci_bus_id
            assert labels["DCGM_FI_DRIVER_VERSION"] == dev.driver_version
            assert labels["hostname"] == hostname
            assert labels["cluster"] == "ci"
    assert not missing, f"{name} lacks series:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", RECEIVERS)
def test_window_timestamps(receivers: dict[str, rx.Receiver], sim_push: SimPush, name: str) -> None:
    """One sample per window per series, at window ends a window apart, within the run."""
    start_s, end_s = _span(sim_push)
    raw = receivers[name].raw_samples(f'{POWER_INSTANT}_max{{cluster="ci"}}', start_s, end_s)
    for gpu, samples in _by_gpu(raw).items():
        stamps = [ts for ts, _ in samples]
        assert len(stamps) >= DURATION_S * 1000 // WINDOW_MS - 2, f"gpu {gpu}: {stamps}"
        steps = set(np.diff(stamps).tolist())
        assert steps == {WINDOW_MS}, f"gpu {gpu}: window ends {stamps}"
        assert sim_push.run.started_ns / 1e6 < stamps[0]
        assert stamps[-1] <= sim_push.run.ended_ns / 1e6


@pytest.mark.parametrize("name", RECEIVERS)
def test_spike_peaks(receivers: dict[str, rx.Receiver], sim_push: SimPush, name: str) -> None:
    """Every sim spike inside a complete window is that window's exact power ``_max``.

    Unless the sampler itself reported at least ``STALL_TICKS`` missed ticks in that window
    (then it may have slept through the plateau, and said so).
    """
    sim = _sim()
    start_s, end_s = _span(sim_push)
    raw = receivers[name].raw_samples(f'{POWER_INSTANT}_max{{cluster="ci"}}', start_s, end_s)
    ticks = _tick_counts(receivers[name], sim_push)
    group = _group(POWER_INSTANT)
    checked = excused = 0
    for gpu, samples in _by_gpu(raw).items():
        for ts_ms, value in _full_windows(samples):
            t1 = ts_ms * 1_000_000
            t0 = t1 - WINDOW_MS * 1_000_000
            spikes = [
                s
                for s in sim.spikes(gpu, t0 - 10_000_000, t1)
                if s.start_ns >= t0 and s.end_ns <= t1
            ]
            missed = ticks.missed_ticks(group, ts_ms)
            if spikes and value != max(s.peak_w for s in spikes) and missed >= STALL_TICKS:
                excused += 1  # the sampler reported the stall that hid the plateau
                continue
            if spikes:
                assert value == max(s.peak_w for s in spikes), (
                    f"gpu {gpu} window ending {ts_ms}: _max {value}, spikes {spikes}"
                )
                checked += 1
            elif not sim.spikes(gpu, t0 - 10_000_000, t1 + 10_000_000):
                assert value < 700, f"gpu {gpu} window ending {ts_ms}: _max {value}, no spike"
    assert checked >= 2, f"only {checked} spikes checked ({excused} hidden by reported stalls)"


@pytest.mark.parametrize(
    ("metric", "rel_tol"),
    [
        # On top of the allowance for reported missed ticks; a window shifted by one period
        # would move FB_USED (a 20 MiB/s leak) by 4.5e-4.
        (POWER_INSTANT, 3e-3),
        ("DCGM_FI_DEV_POWER_USAGE", 1e-3),
        ("DCGM_FI_DEV_FB_USED", 1e-4),
        ("DCGM_FI_DEV_GPU_TEMP", 5e-3),
    ],
)
@pytest.mark.parametrize("name", RECEIVERS)
def test_window_means(
    receivers: dict[str, rx.Receiver], sim_push: SimPush, name: str, metric: str, rel_tol: float
) -> None:
    """Each complete window's mean is the sim's mean over the window's distinct samples.

    The tolerance widens by what the ticks the sampler reported missing could have moved it.
    """
    sim = _sim()
    start_s, end_s = _span(sim_push)
    raw = receivers[name].raw_samples(f'{metric}{{cluster="ci"}}', start_s, end_s)
    ticks = _tick_counts(receivers[name], sim_push)
    group = _group(metric)
    windows = 0
    for gpu, samples in _by_gpu(raw).items():
        for ts_ms, value in _full_windows(samples):
            # The window's distinct samples: one per refresh of the field in [t0, t1).
            refresh_ns = sim.refresh_ns(metric)
            t1_ns = ts_ms * 1_000_000
            t0_ns = t1_ns - WINDOW_MS * 1_000_000
            first = -(-t0_ns // refresh_ns) * refresh_ns
            instants = np.arange(first, t1_ns, refresh_ns, dtype=np.int64)
            truth_values = sim.value_at(metric, instants, gpu)
            truth = float(np.mean(truth_values))
            # Missing a fraction f of the samples moves the mean by at most f * (max - min).
            spread = float(np.max(truth_values) - np.min(truth_values))
            allowance = ticks.missed_fraction(group, ts_ms) * spread
            assert value == pytest.approx(truth, rel=rel_tol, abs=allowance), (
                f"{metric} gpu {gpu} window ending {ts_ms}: pushed {value}, sim {truth}"
            )
            windows += 1
    assert windows >= GPUS * (DURATION_S - 4)


@pytest.mark.parametrize("name", RECEIVERS)
def test_counters_monotonic(
    receivers: dict[str, rx.Receiver], sim_push: SimPush, name: str
) -> None:
    start_s, end_s = _span(sim_push)
    raw = receivers[name].raw_samples(f'{ENERGY}{{cluster="ci"}}', start_s, end_s)
    by_gpu = _by_gpu(raw)
    assert sorted(by_gpu) == list(range(GPUS))
    for gpu, samples in by_gpu.items():
        values = [v for _, v in samples]
        assert len(values) >= DURATION_S - 2
        assert all(b >= a for a, b in itertools.pairwise(values)), (gpu, values)
        assert values[-1] > values[0], f"gpu {gpu}: energy never grew: {values}"
    # The counter is exported as a counter: rate() over it is the power draw, about 330 W.
    result = receivers[name].query(f'rate({ENERGY}{{cluster="ci"}}[5s]) / 1000', time_s=end_s - 1.5)
    for item in result:
        assert 200 < float(item["value"][1]) < 500, item


@pytest.mark.parametrize("name", RECEIVERS)
def test_nvlink_per_link(receivers: dict[str, rx.Receiver], sim_push: SimPush, name: str) -> None:
    """Every link is a series of one family told apart by ``link``, queried per link: the sim's
    18 links on GPU 0, 17 on GPU 1 (its last one is down); each window's mean is the sim's for
    that link; the error counters are counters, rate() per link their rate."""
    from hfsampler.sources.sim.source import NVLINKS, nvlink_up

    receiver, sim = receivers[name], _sim()
    start_s, end_s = _span(sim_push)
    raw = receiver.raw_samples(f'{NVLINK_TX}{{cluster="ci"}}', start_s, end_s)
    by_link = {(int(dict(k)["gpu"]), int(dict(k)["link"])): v for k, v in raw.items()}
    assert sorted(by_link) == [(g, k) for g in range(GPUS) for k in range(NVLINKS)
                               if nvlink_up(g, k)]  # fmt: skip
    ticks = _tick_counts(receiver, sim_push)
    refresh_ns = sim.refresh_ns(NVLINK_TX)
    windows = 0
    for (gpu, link), samples in by_link.items():
        for ts_ms, value in _full_windows(samples):
            t1_ns = ts_ms * 1_000_000
            first = -(-(t1_ns - WINDOW_MS * 1_000_000) // refresh_ns) * refresh_ns
            instants = np.arange(first, t1_ns, refresh_ns, dtype=np.int64)
            truth = sim.value_at(NVLINK_TX, instants, gpu, labels=(("link", str(link)),))
            allowance = ticks.missed_fraction("slow", ts_ms) * float(np.ptp(truth))
            assert value == pytest.approx(float(np.mean(truth)), rel=1e-6, abs=allowance), (
                f"gpu {gpu} link {link} window ending {ts_ms}: pushed {value}"
            )
            windows += 1
    assert windows >= len(by_link) * (DURATION_S - 4)
    # per link, as a dashboard asks: both GPUs on link 0, only GPU 0 on the last link. Asked at
    # the last full window: the run's end (its exit, later on a loaded machine) is after the
    # stale markers that end every series, where an instant query finds none.
    at = max(ts for samples in by_link.values() for ts, _ in _full_windows(samples)) / 1000
    count = receiver.query(f'count by (link) ({NVLINK_TX}{{cluster="ci"}})', time_s=at)
    per_link = {item["metric"]["link"]: float(item["value"][1]) for item in count}
    assert per_link["0"] == GPUS
    assert per_link[str(NVLINKS - 1)] == 1
    assert len(per_link) == NVLINKS
    rate = receiver.query(f'rate({NVLINK_CRC}{{cluster="ci",link="4"}}[5s])', time_s=at)
    assert len(rate) == GPUS
    for item in rate:  # the sim's 0.2 CRC errors per second on every link
        assert 0.1 < float(item["value"][1]) < 0.3, item


@pytest.mark.parametrize("name", RECEIVERS)
def test_receiver_logs_clean(
    receivers: dict[str, rx.Receiver], sim_push: SimPush, name: str
) -> None:
    """No out-of-order, duplicate or rejected sample: the receiver logged nothing about the run."""
    problems = receivers[name].log_problems(since=sim_push.log_at[name])
    assert problems == [], "\n".join(problems)


def test_cli_output_clean(sim_push: SimPush) -> None:
    """The run reported no send failure."""
    text = (sim_push.run.stdout + sim_push.run.stderr).lower()
    for word in ("traceback", "error", "failed"):
        assert word not in text, sim_push.run.stderr[-3000:]

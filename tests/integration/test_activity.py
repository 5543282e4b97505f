"""Activity metrics end to end: a sim run with ``--intervals auto`` pushes DCGM_FI_PROF_* series
and their refresh gauges to a real Prometheus, in dcgm-exporter's units. The one run pushes to
every Prometheus version at once; each version's tests read what it stored."""

from __future__ import annotations

import statistics
import subprocess

import pytest
import receivers as rx

pytestmark = pytest.mark.integration

DURATION_S = 5


@pytest.fixture(scope="module")
def activity_run(every_prometheus: dict[str, rx.Prometheus]) -> rx.CliRun:
    args = rx.sim_run_args(
        [prom.write_url for prom in every_prometheus.values()],
        listen="",
        gpus=2,
        duration=f"{DURATION_S}s",
        labels={"cluster": "activity"},
        extra=["--fields", "gpm,power_usage_instant", "--intervals", "auto"],
    )
    try:
        return rx.run_cli(args, timeout_s=DURATION_S + 45).check()
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hfsampler {' '.join(args)} did not exit in time\n{exc.stderr!r}")


def _last(prometheus: rx.Prometheus, selector: str, run: rx.CliRun) -> dict[str, float]:
    """Per gpu label: the last sample of ``selector`` pushed by the run (a full window)."""
    start_s, end_s = run.started_ns / 1e9 - 1, run.ended_ns / 1e9 + 1
    raw = prometheus.raw_samples(selector, start_s, end_s)
    assert raw, f"no {selector} in Prometheus"
    out = {}
    for labels, samples in raw.items():
        assert len(samples) >= 3, (selector, samples)
        out[dict(labels)["gpu"]] = samples[-2][1]  # the last window may be cut short
    return out


def test_activity_series_in_dcgm_units(prometheus: rx.Prometheus, activity_run: rx.CliRun) -> None:
    sel = '{cluster="activity"}'
    sm = _last(prometheus, "DCGM_FI_PROF_SM_ACTIVE" + sel, activity_run)
    assert set(sm) == {"0", "1"}
    for v in sm.values():
        assert 0.75 <= v <= 0.85  # a ratio (sim: 0.80 +- 0.05), not GPM's percent
    for v in _last(prometheus, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE_max" + sel, activity_run).values():
        assert 0.4 <= v <= 0.6
    for v in _last(prometheus, "DCGM_FI_PROF_PCIE_TX_BYTES" + sel, activity_run).values():
        assert 0.9e9 <= v <= 1.1e9  # bytes per second
    for v in _last(prometheus, "DCGM_FI_PROF_NVLINK_RX_BYTES_p99" + sel, activity_run).values():
        assert 5.4e10 <= v <= 6.6e10


def test_refresh_gauge_tells_the_real_resolution(
    prometheus: rx.Prometheus, activity_run: rx.CliRun
) -> None:
    sel = 'hfsampler_field_refresh_seconds{cluster="activity",field="%s"}'
    start_s, end_s = activity_run.started_ns / 1e9 - 1, activity_run.ended_ns / 1e9 + 1
    gpm = prometheus.raw_samples(sel % "DCGM_FI_PROF_SM_ACTIVE", start_s, end_s)
    assert gpm
    for samples in gpm.values():
        # GPM refreshes every 100 ms; one window can read more where the loaded machine made the
        # sampler miss a tick, so judge the field by its typical window
        typical = statistics.median(v for _, v in samples)
        assert typical == pytest.approx(0.1, rel=0.15)
    ticks = prometheus.raw_samples('hfsampler_ticks_total{cluster="activity"}', start_s, end_s)
    groups = {dict(labels)["group"] for labels in ticks}
    assert "gpm" in groups
    (fast_group,) = groups - {"gpm"}
    # the sim refreshes POWER_USAGE_INSTANT every 1 ms; the probe samples it every 1 ms unless
    # this machine's tick cost forced a coarser step; the gauge shows whichever is coarser
    interval_s = float(fast_group.removeprefix("every_").removesuffix("ms")) / 1e3
    fast = _last(prometheus, sel % "DCGM_FI_DEV_POWER_USAGE_INSTANT", activity_run)
    for v in fast.values():
        assert interval_s <= v <= interval_s * 1.3  # a little more where ticks were missed

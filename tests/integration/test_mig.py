"""MIG end to end: `run --source nvml` on a fake NVML with one GPU in MIG mode (three instances)
and one without, pushed to real Prometheus and to the strict conformance receiver, with a layout
change halfway (GPU instance 5 destroyed, 6 created): per-instance series as dcgm-exporter labels
them, GPU-level series once per GPU, the destroyed instance's series ended by stale markers.

The fake libnvidia-ml is put under pynvml in the CLI and in the sampler process it spawns by
``fake_nvml_site/sitecustomize.py``; both change the layout at the same wall-clock time. One run
pushes to every Prometheus version at once (each version's tests read what it stored), and each
run is stopped, as Ctrl-C does, once its receivers hold what the tests read: a fixed duration
either waited for nothing or, on a loaded machine, ended before the change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import receivers as rx
from conformance import ConformanceReceiver

pytestmark = [pytest.mark.integration, pytest.mark.long]

CHANGE_DELAY_S = 1.0  # from the moment the receiver holds the first layout
WAIT_S = 30.0  # for the first layout, then for the new one, however loaded the machine
# Windows of the new instance before the run is stopped: the layout test queries 1.5 s after
# its first one, which must be well before the stale markers the shutdown sends.
AFTER_WINDOWS = 4
CLUSTER = 'cluster="mig"'
BEFORE = [[1, "3g.40gb"], [5, "2g.20gb"], [13, "1g.10gb"]]
AFTER = [[1, "3g.40gb"], [13, "1g.10gb"], [6, "1g.10gb"]]
FIELDS = "power_usage,gpu_temp,fb_used,fb_free,fb_total,sm_active"
PROFILE_MIB = {"3g.40gb": 40 * 1024, "2g.20gb": 20 * 1024, "1g.10gb": 10 * 1024}


def _scenario(change_file: Path) -> dict[str, Any]:
    after = {"0": AFTER}
    return {"gpus": 2, "mig": {"0": BEFORE}, "change_file": str(change_file), "mig_after": after}


def _change_once_stored(holds_the_first_layout: Callable[[], bool], change_file: Path) -> int:
    """Tell the fake (in every process of the run) to change the layout a moment from now, once
    the receiver holds instance 5: a wall-clock time fixed in advance was missed whenever a
    loaded machine started hfsampler slowly. Returns the change's time (ns)."""
    deadline = time.monotonic() + WAIT_S
    while not holds_the_first_layout():
        assert time.monotonic() < deadline, "the first MIG layout never reached the receiver"
        time.sleep(0.1)
    change_ns = time.time_ns() + int(CHANGE_DELAY_S * 1e9)
    written = change_file.with_suffix(".tmp")
    written.write_text(str(change_ns))
    written.replace(change_file)
    return change_ns


def _args(urls: list[str], cluster: str) -> list[str]:
    args = [
        "run", "--source", "nvml", "--fields", FIELDS, "--window", "1s", "--listen", "",
        "--label", f"cluster={cluster}",
    ]  # fmt: skip
    for url in urls:
        args += ["--remote-write", url]
    return args


@pytest.fixture(scope="module")
def mig_run(
    every_prometheus: dict[str, rx.Prometheus], tmp_path_factory: pytest.TempPathFactory
) -> tuple[rx.CliRun, int]:
    tmp = tmp_path_factory.mktemp("mig")
    change_file, log = tmp / "change", tmp / "run.log"
    proms = list(every_prometheus.values())
    args = _args([p.write_url for p in proms], "mig")
    started_ns = time.time_ns()
    proc = rx.spawn_cli(args, log, env=rx.fake_nvml_env(_scenario(change_file)))
    try:
        first = f'DCGM_FI_DEV_FB_TOTAL{{{CLUSTER},GPU_I_ID="5"}}'
        change_ns = _change_once_stored(lambda: bool(proms[0].wait_for(first, 0)), change_file)
        new = f'count_over_time(DCGM_FI_DEV_FB_USED{{{CLUSTER},GPU_I_ID="6"}}[1m])'
        for prom in proms:
            stored = prom.wait_for(f"{new} >= {AFTER_WINDOWS}", WAIT_S)
            assert stored, f"{prom.name}: not {AFTER_WINDOWS} windows of instance 6 yet"
    finally:
        code = rx.stop_cli(proc)
    run = rx.CliRun(tuple(args), code, "", log.read_text(), started_ns, time.time_ns())
    return run.check(), change_ns


def test_per_instance_series_as_dcgm_exporter_labels_them(
    prometheus: rx.Prometheus, mig_run: tuple[rx.CliRun, int]
) -> None:
    run, _ = mig_run
    start_s, end_s = run.started_ns / 1e9 - 1, run.ended_ns / 1e9 + 1
    fb = prometheus.raw_samples(f'DCGM_FI_DEV_FB_TOTAL{{{CLUSTER},GPU_I_ID!=""}}', start_s, end_s)
    by_gi = {dict(k)["GPU_I_ID"]: (dict(k), samples) for k, samples in fb.items()}
    assert set(by_gi) == {"1", "5", "6", "13"}  # before and after the change
    for labels, samples in by_gi.values():
        assert labels["gpu"] == "0"
        assert labels["UUID"] == "GPU-00000000-1111-2222-3333-444455556666"  # the parent's
        assert labels["MIG_UUID"].startswith("MIG-00000000-")
        assert labels["device"] == "nvidia0"
        assert labels["modelName"] == "NVIDIA H100 80GB HBM3"
        assert labels["hostname"]
        assert {v for _, v in samples} == {PROFILE_MIB[labels["GPU_I_PROFILE"]]}
    assert by_gi["5"][0]["GPU_I_PROFILE"] == "2g.20gb"
    assert by_gi["6"][0]["GPU_I_PROFILE"] == "1g.10gb"
    used = prometheus.raw_samples(f'DCGM_FI_DEV_FB_USED{{{CLUSTER},GPU_I_ID="1"}}', start_s, end_s)
    (samples,) = used.values()
    assert all(0.2 * 40960 <= v <= 0.3 * 40960 for _, v in samples)
    # GPM per instance (nvmlGpmMigSampleGet): the 3g instance has 3/7 of the fake GPU's activity
    sm = prometheus.raw_samples(f'DCGM_FI_PROF_SM_ACTIVE{{{CLUSTER},GPU_I_ID="1"}}', start_s, end_s)
    (samples,) = sm.values()
    assert all(0.8 * 3 / 7 <= v <= 0.85 * 3 / 7 for _, v in samples[1:-1]), samples


def test_gpu_fields_once_per_gpu_and_the_mig_off_gpu_as_before(
    prometheus: rx.Prometheus, mig_run: tuple[rx.CliRun, int]
) -> None:
    run, _ = mig_run
    start_s, end_s = run.started_ns / 1e9 - 1, run.ended_ns / 1e9 + 1
    for name in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP"):
        series = prometheus.raw_samples(f"{name}{{{CLUSTER}}}", start_s, end_s)
        assert sorted(dict(k)["gpu"] for k in series) == ["0", "1"], name
        assert not any("GPU_I_ID" in dict(k) for k in series), name
    other = prometheus.raw_samples(f'DCGM_FI_DEV_FB_USED{{{CLUSTER},gpu="1"}}', start_s, end_s)
    assert len(other) == 1
    assert "GPU_I_ID" not in dict(next(iter(other)))
    up = prometheus.raw_samples(f"hfsampler_gpu_up{{{CLUSTER}}}", start_s, end_s)
    assert sorted(dict(k)["gpu"] for k in up) == ["0", "1"]  # slots are no GPUs
    assert all(v == 1 for samples in up.values() for _, v in samples)


def test_a_layout_change_ends_the_old_instance_and_starts_the_new(
    prometheus: rx.Prometheus, mig_run: tuple[rx.CliRun, int]
) -> None:
    run, change_ns = mig_run
    start_s, end_s = run.started_ns / 1e9 - 1, run.ended_ns / 1e9 + 1
    fb = prometheus.raw_samples(f'DCGM_FI_DEV_FB_USED{{{CLUSTER},GPU_I_ID!=""}}', start_s, end_s)
    times = {dict(k)["GPU_I_ID"]: [t for t, _ in s] for k, s in fb.items()}
    assert max(times["5"]) <= change_ns / 1e6 + 2000  # found within the rescan, then no more
    assert min(times["6"]) >= change_ns / 1e6
    assert max(times["1"]) > min(times["6"])  # the others went on through the change
    # Without a stale marker an instant query would return instance 5 for five minutes more.
    at_s = min(times["6"]) / 1e3 + 1.5
    assert at_s < run.ended_ns / 1e9
    now = prometheus.query(f'DCGM_FI_DEV_FB_USED{{{CLUSTER},GPU_I_ID!=""}}', time_s=at_s)
    assert sorted(r["metric"]["GPU_I_ID"] for r in now) == ["1", "13", "6"]
    assert "MIG layout changed" in run.stderr


def test_mig_run_copying_device_fields_is_conformant(tmp_path: Path) -> None:
    """The strict receiver, with dcgm-exporter's copying on: GPU fields on every instance too."""
    config = tmp_path / "hfsampler.yml"
    config.write_text("mig: {copy_device_fields: true}\n")
    change_file = tmp_path / "change"
    with ConformanceReceiver() as receiver:
        args = [*_args([receiver.url], "mig-conformance"), "--config", str(config)]
        env = rx.fake_nvml_env(_scenario(change_file))
        proc = rx.spawn_cli(args, tmp_path / "run.log", env=env)
        try:
            fb_of_5 = partial(receiver.series_named, "DCGM_FI_DEV_FB_USED", GPU_I_ID="5")
            _change_once_stored(lambda: bool(fb_of_5()), change_file)
            # the new instance's series, the GPU fields copied onto it too, for a few windows
            power_of_6 = partial(receiver.series_named, "DCGM_FI_DEV_POWER_USAGE", GPU_I_ID="6")
            receiver.wait(lambda _: sum(len(s) for s in power_of_6().values()) >= 2, WAIT_S)
        finally:
            code = rx.stop_cli(proc)
        assert code == 0, (tmp_path / "run.log").read_text()
    receiver.assert_conformant()
    fb = receiver.series_named("DCGM_FI_DEV_FB_USED")
    assert {dict(k).get("GPU_I_ID") for k in fb} == {None, "1", "5", "6", "13"}
    power = receiver.series_named("DCGM_FI_DEV_POWER_USAGE")
    by_gpu = {(dict(k)["gpu"], dict(k).get("GPU_I_ID")) for k in power}
    assert by_gpu == {("0", None), ("1", None), ("0", "1"), ("0", "5"), ("0", "6"), ("0", "13")}
    assert receiver.report()["stale_markers"] > 0

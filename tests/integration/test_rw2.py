"""Remote-Write 2.0 against real receivers: Prometheus 3 stores it; Prometheus 2 makes the sender
fall back to 1.0 with one log line, and nothing is lost.

One sim run pushes to both with ``protobuf_message: io.prometheus.write.v2.Request``. Prometheus
3 (which takes 2.0 by default) must hold every default series and every window of each; Prometheus
2.42 decodes a 2.0 body as an empty 1.0 message and answers 204 without the Written header: the
sender must notice, resend as 1.0, and say so once. (Prometheus 3.5's /api/v1/metadata lists
scraped metadata only, so the metadata every 2.0 series carries is checked by the conformance
receiver, in test_conformance_paths.py.)
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import receivers as rx

pytestmark = pytest.mark.integration

V2 = "io.prometheus.write.v2.Request"
DURATION_S = 6
POWER_MAX = "DCGM_FI_DEV_POWER_USAGE_max"


@dataclass(frozen=True)
class Pushed:
    run: rx.CliRun
    log_at: dict[str, int]

    def span(self) -> tuple[float, float]:
        return self.run.started_ns / 1e9 - 1, self.run.ended_ns / 1e9 + 1


@pytest.fixture(scope="module")
def pushed(receivers: dict[str, rx.Receiver], tmp_path_factory: pytest.TempPathFactory) -> Pushed:
    names = ("prometheus-3", "prometheus-2")
    config = {
        "external_labels": {"cluster": "rw2"},
        "remote_write": [
            {"url": receivers[n].write_url, "name": n, "protobuf_message": V2} for n in names
        ],
    }
    path = tmp_path_factory.mktemp("rw2") / "hfsampler.yml"
    path.write_text(json.dumps(config))
    log_at = {n: len(receivers[n].log_text()) for n in names}
    args = rx.sim_run_args([], duration=f"{DURATION_S}s", extra=["--config", str(path)])
    try:
        run = rx.run_cli(args, timeout_s=DURATION_S + 45)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hfsampler did not exit in time\n{exc.stdout!r}\n{exc.stderr!r}")
    return Pushed(run.check(), log_at)


def _expected_names() -> list[str]:
    from hfsampler.config.settings import Config
    from hfsampler.sampling.window import exported_names

    return [n for f in Config().selected_fields() if f.nvml_readable for n in exported_names(f)]


def _windows(receiver: rx.Receiver, pushed: Pushed) -> dict[rx.Labels, list[tuple[int, float]]]:
    start, end = pushed.span()
    return receiver.raw_samples(f'{POWER_MAX}{{cluster="rw2"}}', start, end)


def test_prometheus3_stores_every_series_sent_as_2_0(
    receivers: dict[str, rx.Receiver], pushed: Pushed
) -> None:
    p3 = receivers["prometheus-3"]
    start, end = pushed.span()
    missing = [
        name
        for name in _expected_names()
        if {s["gpu"] for s in p3.series(f'{name}{{cluster="rw2"}}', start, end)} != {"0", "1"}
    ]
    assert not missing, f"Prometheus 3 lacks: {missing}"
    fell_back = [line for line in pushed.run.stderr.splitlines()
                 if "does not take Remote-Write 2.0" in line]  # fmt: skip
    assert not [line for line in fell_back if "prometheus-3" in line]
    assert p3.log_problems(since=pushed.log_at["prometheus-3"]) == []
    # both receivers hold the same windows: 2.0 lost nothing that 1.0 (after the fallback) kept
    assert _windows(p3, pushed) == _windows(receivers["prometheus-2"], pushed)


def test_prometheus2_makes_the_sender_fall_back_once(
    receivers: dict[str, rx.Receiver], pushed: Pushed
) -> None:
    lines = [ln for ln in pushed.run.stderr.splitlines() if "does not take Remote-Write 2.0" in ln]
    assert len(lines) == 1, pushed.run.stderr[-3000:]
    assert "prometheus-2" in lines[0]
    assert "X-Prometheus-Remote-Write-Samples-Written" in lines[0]
    windows = _windows(receivers["prometheus-2"], pushed)
    assert len(windows) == 2  # both GPUs
    stamps = {tuple(t for t, _ in samples) for samples in windows.values()}
    assert len(stamps) == 1  # every GPU has every window
    (got,) = stamps
    assert len(got) >= DURATION_S - 1  # the first window, sent as 2.0 and refused, was resent
    assert receivers["prometheus-2"].log_problems(since=pushed.log_at["prometheus-2"]) == []


def test_prometheus3_without_2_0_answers_415_and_the_sender_falls_back(tmp_path: Path) -> None:
    """Prometheus 3 told to take 1.0 only refuses 2.0 with 415: resent as 1.0, kept."""
    build = rx.PROMETHEUS_BUILDS["prometheus-3"]
    if rx.binary_path(build.binary) is None:
        pytest.skip("no Prometheus 3 here")
    prom = rx.start_prometheus(
        tmp_path,
        name="prometheus-3-v1only",
        binary=build.binary,
        extra_flags=[rx.ACCEPT_RW1_ONLY_FLAG],
    )
    try:
        config = {"remote_write": [{"url": prom.write_url, "name": "p3v1", "protobuf_message": V2}]}
        path = tmp_path / "hfsampler.yml"
        path.write_text(json.dumps(config))
        run = rx.run_cli(rx.sim_run_args([], duration="4s", extra=["--config", str(path)]), 60)
        run.check()
        lines = [ln for ln in run.stderr.splitlines() if "does not take Remote-Write 2.0" in ln]
        assert len(lines) == 1
        assert "415" in lines[0]
        got = prom.raw_samples(POWER_MAX, run.started_ns / 1e9 - 1, run.ended_ns / 1e9 + 1)
        assert len(got) == 2
        assert all(len(samples) >= 3 for samples in got.values())
    finally:
        prom.stop()

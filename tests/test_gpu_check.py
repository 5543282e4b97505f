"""benchmarks/gpu_check.py's measurements, run against the fake NVML (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from fake_nvml import FakeNvml, install, make_fake, remove_library

from hfsampler.sources.base import SourceSpec

# It measures the machine's time (lateness, deadlines, rates): it runs alone.
pytestmark = pytest.mark.alone


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return install(monkeypatch, make_fake(2))


def test_call_and_batched_latency(gpu_check: ModuleType, fake: FakeNvml) -> None:
    handles = gpu_check.open_handles()
    fake.missing.add("nvmlDeviceGetCurrentClocksEventReasons")
    fake.gpus[1].errors["nvmlDeviceGetFanSpeed"] = 3  # NOT_SUPPORTED
    try:
        lat = gpu_check.call_latency(handles, repeats=20, budget_s=0.01)
        ids = gpu_check.catalogue_field_ids()
        batched = gpu_check.batched_latency(handles, list(ids.values()), repeats=20)
    finally:
        import pynvml

        pynvml.nvmlShutdown()
    assert set(lat) >= {"clock_sm", "memory", "utilization", "clocks_event_reasons"}
    assert lat["clock_sm"][0]["n"] > 0
    assert lat["clocks_event_reasons"][0]["n"] > 0  # measured on the older call
    assert lat["fan"][1] == {"error": "Not Supported"}
    assert [b["supported"] for b in batched] == [len(ids), len(ids)]
    assert all(b["n"] > 0 for b in batched)


def test_refresh_periods_found(gpu_check: ModuleType, fake: FakeNvml) -> None:
    now = [0]

    def clock() -> int:
        now[0] += 250  # each driver read advances the fake clock 250 us: no sleeping
        return now[0]

    fake.clock_us = clock
    handles = gpu_check.open_handles()
    ids = gpu_check.catalogue_field_ids()

    def fake_s() -> float:  # the benchmark's clock is the fake's too: no machine's speed matters
        return clock() / 1e6

    try:
        fields = gpu_check.field_refresh(handles[0], ids, duration_s=0.5, now=fake_s)
        keys = ["clock_sm", "fb_used", "pstate"]
        calls = gpu_check.call_refresh(handles[0], keys, duration_s=0.5, now=fake_s)
    finally:
        import pynvml

        pynvml.nvmlShutdown()
    # The fake's POWER_INSTANT refreshes every 20 ms, POWER_AVERAGE every 100 ms.
    assert fields["DCGM_FI_DEV_POWER_USAGE_INSTANT"]["period_ms"] == pytest.approx(20.0)
    assert fields["DCGM_FI_DEV_POWER_USAGE"]["period_ms"] == pytest.approx(100.0)
    assert fields["reads"] > 0
    assert calls["clock_sm"]["changes"] > 0
    assert calls["pstate"]["changes"] == 0  # constant: no change to see


def test_tick_rate_and_deadline_loop(gpu_check: ModuleType, fake: FakeNvml) -> None:
    fast = gpu_check.fast_fields()
    rate = gpu_check.max_tick_rate(fast, duration_s=0.05)
    assert rate["gpus"] == 2
    assert rate["ticks_per_s"] > 0
    loop = gpu_check.deadline_loop(fast, rate_hz=1000.0, duration_s=0.05)
    assert loop["n"] > 10
    assert fake.initialised == 0  # every open was closed


def test_sampler_lateness_through_the_sampler(gpu_check: ModuleType) -> None:
    # The sampler runs in its own (spawned) process, which the fake cannot follow: use sim.
    fast = gpu_check.fast_fields()
    result = gpu_check.sampler_lateness(SourceSpec("sim", gpus=2), fast, 1000.0, duration_s=0.3)
    assert result["ticks"] > 0
    assert result["n"] > 0


def test_main_without_driver(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    remove_library(monkeypatch)
    assert gpu_check.main([str(tmp_path)]) == gpu_check.NO_DRIVER_EXIT
    assert list(tmp_path.iterdir()) == []


def test_table_and_json(
    gpu_check: ModuleType,
    fake: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The whole run, at a hundredth of its durations, without the spawned sampler (see above).
    monkeypatch.setattr(gpu_check, "sampler_lateness", lambda *a, **k: {"error": "skipped"})
    result = gpu_check.run(scale=0.01)
    gpu_check.print_table(result)
    out = capsys.readouterr().out
    assert "batched read" in out
    assert "DCGM_FI_DEV_POWER_USAGE_INSTANT" in out
    assert "ticks/s" in out
    json.dumps(result, default=str)

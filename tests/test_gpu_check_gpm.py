"""benchmarks/gpu_check.py's GPM and probe measurements: fake NVML, virtual clock."""

from __future__ import annotations

from types import ModuleType

import pytest
from fake_nvml import FakeNvml, gpm_value, install, make_fake

from hfsampler.sampling import probe as P
from hfsampler.sources.base import SourceSpec

# It measures the machine's time (lateness, deadlines, rates): it runs alone.
pytestmark = pytest.mark.alone


@pytest.fixture
def clock() -> list[int]:
    return [5_000_000]  # us


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, clock: list[int]) -> FakeNvml:
    f = install(monkeypatch, make_fake(2))
    f.clock_us = lambda: clock[0]
    return f


def test_gpm_finest_valid_spacing(
    gpu_check: ModuleType, fake: FakeNvml, clock: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def sleep(seconds: float) -> None:  # virtual time: no real sleep in a unit test
        clock[0] += round(seconds * 1e6)

    monkeypatch.setattr(gpu_check.time, "sleep", sleep)
    fake.gpus[1].gpm_supported = False
    handles = gpu_check.open_handles()
    try:
        result = gpu_check.gpm_check(handles, repeats=1)
    finally:
        gpu_check.calls.shutdown()
    assert result[1] == {"supported": False, "error": "not a GPM device"}
    g0 = result[0]
    # the fake's counters refresh every 100 ms: shorter pairs fall inside one refresh
    assert g0["finest_valid_spacing_ms"] == 100
    assert g0["spacing"]["50ms"]["valid"] == 0
    # the 200 ms pair ends 386 ms in (1+5+10+20+50+100+200 ms of virtual sleeps)
    assert g0["spacing"]["200ms"]["sm_util"] == [gpm_value("NVML_GPM_METRIC_SM_UTIL", 0, 5_386_000)]
    assert fake.gpm_samples == {}  # both buffers freed
    assert g0["sample"]["n"] == 7  # one first sample per spacing


def test_probe_json_round_trips_to_the_table(gpu_check: ModuleType, fake: FakeNvml) -> None:
    result = P.probe(SourceSpec("nvml"), duration_s=0.05)
    again = gpu_check._probe_result(result.to_json(), P.ProbeResult)
    assert again == result
    assert "recommended groups" in P.format_table(again)

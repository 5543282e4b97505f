"""`hfsampler probe` against fake GPUs whose refresh periods are known, on a virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fake_nvml import FakeGpu, FakeNvml, FakeReading, install, make_fake

from hfsampler import fields as F
from hfsampler.cli import main as cli
from hfsampler.sampling import probe as P
from hfsampler.sources.base import SourceSpec

# It measures the machine's time (lateness, deadlines, rates): it runs alone.
pytestmark = pytest.mark.alone

STEP_NS = 997_000  # the virtual clock advances this much between refresh reads


class VirtualClock:
    def __init__(self, start_ns: int = 5_000_000_000) -> None:
        self.ns = start_ns

    def __call__(self) -> int:
        return self.ns

    def advance(self) -> None:
        self.ns += STEP_NS


def _changing(base: float, period_us: int) -> FakeReading:
    # a new value at every refresh, so value changes reveal the period where timestamps cannot
    return FakeReading(lambda ts: base + (ts // period_us) % 7, period_us)


def known_periods(gpu: FakeGpu) -> dict[str, float]:
    """Give every reading a changing value and return each catalogue field's true period (s)."""
    for table in (gpu.fields, gpu.readings):
        for r in table.values():
            r.value = _changing(100.0, r.period_us).value
    truth: dict[str, float] = {}
    for f in F.CATALOGUE:
        if f.per == "link":
            continue  # per link: this GPU has no NVLink (test_nvml_nvlink has links)
        if f.gpm_metric:
            truth[f.name] = gpu.gpm_period_us / 1e6
        elif f.nvml_field:
            import pynvml

            truth[f.name] = gpu.fields[getattr(pynvml, f.nvml_field)].period_us / 1e6
        elif f.nvml_call and f.nvml_call in gpu.readings:
            truth[f.name] = gpu.readings[f.nvml_call].period_us / 1e6
    return truth


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, clock: VirtualClock) -> FakeNvml:
    f = install(monkeypatch, make_fake(1))
    f.clock_us = lambda: clock.ns // 1000
    return f


def test_probe_recovers_known_refresh_periods(fake: FakeNvml, clock: VirtualClock) -> None:
    truth = known_periods(fake.gpus[0])
    result = P.probe(SourceSpec("nvml"), F.CATALOGUE, 3.0, clock_ns=clock, pace=clock.advance)
    print("\n" + P.format_table(result))
    by_name = {p.name: p for p in result.fields}
    checked = 0
    for name, true_s in truth.items():
        p = by_name[name]
        assert p.supported, name
        got = p.refresh_first_s
        assert got is not None, name
        assert got == pytest.approx(true_s, rel=0.10), (name, got, true_s)
        checked += 1
    assert checked >= 30
    # fields read by id carry the driver's timestamps; calls and GPM need value changes
    assert by_name["DCGM_FI_DEV_POWER_USAGE_INSTANT"].method == "timestamps"
    assert by_name["DCGM_FI_DEV_SM_CLOCK"].method == "values"
    assert by_name["DCGM_FI_PROF_SM_ACTIVE"].method == "values"
    # the finest GPM interval is the measured counter refresh (100 ms on this fake)
    assert result.intervals_s[F.GPM] == pytest.approx(0.1)
    assert result.field_groups["DCGM_FI_DEV_POWER_USAGE_INSTANT"] == "every_20ms"
    assert result.intervals_s["every_20ms"] == pytest.approx(0.02)
    assert result.batched_read_us
    assert result.batched_read_us[0] > 0
    assert result.max_tick_hz > 0
    json.dumps(result.to_json())


def test_gpm_refresh_follows_the_device(fake: FakeNvml, clock: VirtualClock) -> None:
    fake.gpus[0].gpm_period_us = 50_000
    for r in fake.gpus[0].gpm.values():
        r.value = _changing(10.0, 50_000).value
    activity = tuple(f for f in F.CATALOGUE if f.group == F.GPM)
    result = P.probe(SourceSpec("nvml"), activity, 1.0, clock_ns=clock, pace=clock.advance)
    for p in result.fields:
        assert p.refresh_first_s == pytest.approx(0.05, rel=0.10), p.name
    assert result.intervals_s == {F.GPM: pytest.approx(0.05)}


def test_recommend_respects_tick_cost_window_and_defaults() -> None:
    def fp(name: str, group: str, refresh: float | None) -> P.FieldProbe:
        return P.FieldProbe(name, group, True, 1.0, 2.0, (refresh,), "timestamps", 5)

    probes = [
        fp("A", F.FAST, 0.0004),  # faster than the ladder: 1 ms
        fp("B", F.FAST, 0.0167),  # 16.7 ms: sampled every 10 ms
        fp("C", F.SLOW, None),  # no change seen: the catalogue default
        fp("D", F.SLOW, 30.0),  # capped at the window
    ]
    intervals, groups = P.recommend(probes, tick_us=100.0, window_s=1.0)
    assert groups == {"A": "every_1ms", "B": "every_10ms", "C": "every_100ms", "D": "every_1000ms"}
    assert intervals["every_1000ms"] == 1.0
    slow_tick, _ = P.recommend(probes, tick_us=3000.0, window_s=1.0)
    assert min(slow_tick.values()) == pytest.approx(0.01)  # a 3 ms read fits 10 ms, not 5 ms


def test_instances_of_one_field_share_the_fastest_group() -> None:
    """A Jetson's rails are one field, several instances: the fastest rail decides its group."""
    name = "hfsampler_jetson_rail_power_watts"

    def rail(label: str, refresh: float) -> P.FieldProbe:
        return P.FieldProbe(name, F.FAST, True, 1.0, 2.0, (refresh,), "timestamps", 5,
                            (("rail", label),))  # fmt: skip

    for order in ([rail("A", 0.02), rail("B", 0.0066)], [rail("B", 0.0066), rail("A", 0.02)]):
        intervals, groups = P.recommend(order, tick_us=10.0)
        assert groups == {name: "every_5ms"}
        assert intervals["every_5ms"] == pytest.approx(0.005)
    assert order[0].display == f'{name}{{rail="B"}}'


def test_sim_probe_and_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["probe", "--source", "sim", "--gpus", "1", "--duration", "300ms",
                     "--fields", "power_usage_instant,gpu_temp", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    fields = {f["name"]: f for f in out["fields"]}
    assert fields["DCGM_FI_DEV_POWER_USAGE_INSTANT"]["refresh_s"][0] == pytest.approx(
        0.001, rel=0.1
    )
    # which ladder step depends on this machine's tick cost; that logic is tested above
    group = out["field_groups"]["DCGM_FI_DEV_POWER_USAGE_INSTANT"]
    assert group == P.group_name(out["intervals_s"][group])


def test_intervals_auto_applies_the_recommendation() -> None:
    from hfsampler.config.loader import from_mapping
    from hfsampler.config.settings import Config

    assert from_mapping({"intervals": "auto"}).auto_intervals
    args = cli.build_parser()[0].parse_args(["run", "--intervals", "auto", "--source", "sim"])
    config = cli.config_from_args(args)
    assert config.auto_intervals
    probes = [P.FieldProbe("DCGM_FI_DEV_GPU_TEMP", F.SLOW, True, 1, 2, (0.1,), "timestamps", 9)]
    intervals, groups = P.recommend(probes, 10.0)
    result = P.ProbeResult("sim", ("x",), 1.0, tuple(probes), (), 1.0, 2.0, 5e5, intervals, groups)
    applied = P.apply_recommendation(Config(fields=("gpu_temp",)), result)
    assert applied.intervals_s == {"every_100ms": 0.1}
    assert [f.group for f in applied.selected_fields()] == ["every_100ms"]
    assert np.isfinite(result.max_tick_hz)


def test_intervals_auto_leaves_out_a_field_the_probe_found_unsupported() -> None:
    """A GPU without GPM: the probe places no gpm field, so the applied config does not select
    them (rather than select fields whose group has no interval); nothing placed: unchanged."""
    from hfsampler.config.settings import Config

    probes = [
        P.FieldProbe("DCGM_FI_DEV_GPU_TEMP", F.SLOW, True, 1, 2, (0.1,), "timestamps", 9),
        P.FieldProbe("DCGM_FI_PROF_SM_ACTIVE", F.GPM, False, None, None, (), "none", 0),
    ]
    intervals, groups = P.recommend(probes, 10.0)
    result = P.ProbeResult("sim", ("x",), 1.0, tuple(probes), (), 1.0, 2.0, 5e5, intervals, groups)
    config = Config(fields=("gpu_temp", "gpm"))
    applied = P.apply_recommendation(config, result)
    assert applied.fields == ("DCGM_FI_DEV_GPU_TEMP",)
    assert [(f.name, f.group) for f in applied.selected_fields()] == [
        ("DCGM_FI_DEV_GPU_TEMP", "every_100ms")
    ]
    nothing = P.ProbeResult("sim", ("x",), 1.0, tuple(probes[1:]), (), 1.0, 2.0, 5e5, {}, {})
    assert P.apply_recommendation(config, nothing) is config


def test_intervals_auto_leaves_out_of_a_counters_file_what_the_probe_found_unsupported(
    tmp_path: Path,
) -> None:
    """`fields_csv` and `intervals: auto` on a GPU without GPM: the file's profiling row leaves
    the selection with the probe's verdict, and its other rows keep the file's help."""
    from hfsampler.config.loader import from_mapping

    path = tmp_path / "counters.csv"
    path.write_text("DCGM_FI_DEV_GPU_TEMP, gauge, Die (in C)\nDCGM_FI_PROF_SM_ACTIVE, gauge, a\n")
    probes = [
        P.FieldProbe("DCGM_FI_DEV_GPU_TEMP", F.SLOW, True, 1, 2, (0.1,), "timestamps", 9),
        P.FieldProbe("DCGM_FI_PROF_SM_ACTIVE", F.GPM, False, None, None, (), "none", 0),
    ]
    intervals, groups = P.recommend(probes, 10.0)
    result = P.ProbeResult("sim", ("x",), 1.0, tuple(probes), (), 1.0, 2.0, 5e5, intervals, groups)
    applied = P.apply_recommendation(from_mapping({"fields_csv": str(path)}), result)
    assert [(f.name, f.group, f.help) for f in applied.selected_fields()] == [
        ("DCGM_FI_DEV_GPU_TEMP", "every_100ms", "Die (in C)")
    ]


def test_recommend_keeps_per_link_nvlink_off_the_fastest_groups() -> None:
    """A per-link field refreshing every millisecond still goes to 100 ms or slower."""
    tx = "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"
    probes = [
        P.FieldProbe("DCGM_FI_DEV_POWER_USAGE_INSTANT", F.FAST, True, 1.0, 2.0, (0.001,),
                     "timestamps", 5),
        P.FieldProbe(tx, F.SLOW, True, 1.0, 2.0, (0.001,), "timestamps", 5, (("link", "0"),)),
    ]  # fmt: skip
    _, groups = P.recommend(probes, tick_us=10.0)
    assert groups == {"DCGM_FI_DEV_POWER_USAGE_INSTANT": "every_1ms", tx: "every_100ms"}


def test_probe_of_a_mig_gpu_times_its_batched_read(fake: FakeNvml, clock: VirtualClock) -> None:
    """A MIG GPU is a GPU row and its instance slots: the probe reads them all, never crashes."""
    from fake_nvml import enable_mig

    enable_mig(fake.gpus[0], 0, [(1, "3g.71gb"), (2, "2g.35gb"), (5, "1g.18gb")])
    result = P.probe(SourceSpec("nvml"), F.CATALOGUE, 1.0, clock_ns=clock, pace=clock.advance)
    assert len(result.batched_read_us) == 1
    assert result.batched_read_us[0] > 0
    assert {p.name: p for p in result.fields}["DCGM_FI_DEV_POWER_USAGE_INSTANT"].supported

"""The jetson source against real files: three boards' sysfs trees (tests/support/jetson_trees.py).

Nothing inside hfsampler is faked: the source opens and preads files under a fixture root, and
the tests change those files in place, as the kernel does, to drive it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jetson_trees as jt
import numpy as np
import pytest
from fake_nvml import install, make_fake, remove_library

from hfsampler import fields as F
from hfsampler.config.loader import from_mapping
from hfsampler.config.settings import Config
from hfsampler.errors import ConfigError
from hfsampler.fields import Field
from hfsampler.sampling.plan import discover
from hfsampler.sampling.resolve import resolve_source
from hfsampler.sources.base import SourceSpec
from hfsampler.sources.jetson.source import JetsonSource
from hfsampler.sources.jetson.sysfs import find_layout, gpu_rail, is_tegra

MS = 1_000_000
T0 = 1_800_000_000 * 1_000_000_000
BOARDS = sorted(jt.BOARDS)


@pytest.fixture(params=BOARDS)
def board(request: pytest.FixtureRequest) -> jt.Board:
    return jt.BOARDS[request.param]


@pytest.fixture
def tree(board: jt.Board, tmp_path: Path) -> Path:
    return jt.build(board, tmp_path / board.name)


def _open(root: Path, measure_s: float = 0.0) -> tuple[JetsonSource, tuple[Field, ...]]:
    source = JetsonSource(root, measure_s=measure_s)
    inv = source.open(F.CATALOGUE)
    return source, tuple(f for f, ok in zip(inv.fields, inv.supported[0], strict=True) if ok)


def _read(source: JetsonSource, fields: tuple[Field, ...], now_ns: int) -> dict[str, float]:
    values = np.full((1, len(fields)), np.nan)
    ts = np.zeros((1, len(fields)), dtype=np.int64)
    source.read(fields, values, ts, now_ns)
    return {_key(f): float(v) for f, v in zip(fields, values[0], strict=True)}


def _key(f: Field) -> str:
    return f.name + "".join(f"/{v}" for _, v in f.labels)


def _write(root: Path, rel: str, value: int | str) -> None:
    """Rewrite a fixture file in place (same inode), as sysfs changes under an open reader."""
    fd = os.open(root / rel, os.O_WRONLY)
    try:
        os.pwrite(fd, (f"{value:>{jt.WIDTH}}\n").encode(), 0)
    finally:
        os.close(fd)


@pytest.fixture
def source(tree: Path) -> Iterator[tuple[JetsonSource, tuple[Field, ...]]]:
    src, live = _open(tree)
    yield src, live
    src.close()


# -- finding the files ----------------------------------------------------------------------------


def test_layout_is_found_not_assumed(board: jt.Board, tree: Path) -> None:
    lay = find_layout(tree)
    assert lay.gpu_device == board.gpu_device
    assert [r.name for r in lay.rails] == list(board.rails)  # NC channels and the sum skipped
    assert lay.gpu_rail == board.gpu_rail
    assert lay.gpu_zone == board.gpu_zone
    assert lay.model == board.model
    assert lay.l4t == board.l4t
    assert (lay.emc_rate is not None) is board.emc
    assert lay.load is not None
    assert is_tegra(tree)


def test_not_a_tegra(tmp_path: Path) -> None:
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/compatible").write_bytes(b"raspberrypi,4-model-b\0brcm,bcm2711\0")
    assert not is_tegra(tmp_path)
    lay = find_layout(tmp_path)
    assert lay.load is None
    assert not lay.rails


def test_gpu_rail_prefers_the_rail_with_the_fewest_other_loads() -> None:
    assert gpu_rail(["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]) == "VDD_CPU_GPU_CV"
    assert gpu_rail(["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"]) == "VDD_GPU_SOC"
    assert gpu_rail(["POM_5V_IN", "POM_5V_GPU", "POM_5V_CPU"]) == "POM_5V_GPU"  # Nano, JetPack 4
    assert gpu_rail(["GPU", "CPU", "SOC", "CV", "VDDRQ", "SYS5V"]) == "GPU"  # AGX Xavier
    assert gpu_rail(["VDD_IN", "VDD_SOC"]) is None


# -- open: devices, fields, labels ----------------------------------------------------------------


def test_open_labels_the_gpu_and_expands_rails_and_zones(board: jt.Board, tree: Path) -> None:
    src = JetsonSource(tree, measure_s=0.0)
    inv = src.open(F.CATALOGUE)
    src.close()
    (dev,) = inv.devices
    assert dev.index == 0
    assert dev.model_name == board.model
    assert dev.driver_version == board.l4t
    assert dev.pci_bus_id == board.gpu_device
    assert dev.device == "nvidia0"
    assert dev.uuid.startswith("GPU-")
    again = JetsonSource(tree, measure_s=0.0).open(F.CATALOGUE[:1]).devices[0]
    assert again.uuid == dev.uuid  # stable: derived from the module's serial number
    ok = {_key(f) for f, s in zip(inv.fields, inv.supported[0], strict=True) if s}
    rails = {k.split("/")[1] for k in ok if k.startswith("hfsampler_jetson_rail_power_watts/")}
    assert rails == set(board.rails)
    zones = {k.split("/")[1] for k in ok if k.startswith("hfsampler_jetson_temp_celsius/")}
    assert zones == set(board.zones)
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_TEMP",
                 "DCGM_FI_DEV_POWER_USAGE_INSTANT", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                 "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "hfsampler_jetson_gpu_railgated",
                 "hfsampler_jetson_gpu_max_clock_mhz"):  # fmt: skip
        assert name in ok, name
    assert ("DCGM_FI_DEV_MEM_CLOCK" in ok) is board.emc
    assert ("hfsampler_jetson_nvmap_used_mib" in ok) is board.nvmap
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" not in ok  # an NVML field a Jetson has no file for


def test_discover_drops_what_the_board_lacks(tree: Path, board: jt.Board) -> None:
    """The service's discovery, through the spec the sampler process gets: the inventory holds
    one labelled field per rail and zone, and the child reopens exactly those."""
    spec = SourceSpec("jetson", jetson_root=str(tree))
    inv = discover(spec, F.CATALOGUE)
    assert inv.supported.all()
    child = JetsonSource(tree, measure_s=0.0)
    reopened = child.open(inv.fields)
    child.close()
    assert reopened.fields == inv.fields
    assert reopened.supported.all()


# -- reading --------------------------------------------------------------------------------------


def test_values_are_the_files_in_exported_units(
    board: jt.Board, tree: Path, source: tuple[JetsonSource, tuple[Field, ...]]
) -> None:
    src, live = source
    lay = find_layout(tree)
    assert lay.load is not None
    _write(tree, str(lay.load.relative_to(tree.resolve())), 731)
    spiky = board.spike_signal_path()
    _write(tree, spiky, 1500)
    v = _read(src, live, T0)
    assert v["DCGM_FI_DEV_GPU_UTIL"] == pytest.approx(73.1)  # per-mille -> %
    assert v["DCGM_FI_DEV_SM_CLOCK"] == pytest.approx(1300.5)  # Hz -> MHz
    assert v["hfsampler_jetson_gpu_min_clock_mhz"] == pytest.approx(306.0)
    assert v["hfsampler_jetson_gpu_railgated"] == 0.0
    rail = f"hfsampler_jetson_rail_power_watts/{board.gpu_rail}"
    if "in_power" in spiky:  # JetPack 4: the driver's mW
        assert v[rail] == pytest.approx(1.5)
    else:  # JetPack 5+: mV x mA
        assert v[rail] == pytest.approx(board.gpu_rail_mv * 1500 * 1e-6)
        assert v[f"hfsampler_jetson_rail_current_amperes/{board.gpu_rail}"] == pytest.approx(1.5)
        volts = v[f"hfsampler_jetson_rail_voltage_volts/{board.gpu_rail}"]
        assert volts == pytest.approx(board.gpu_rail_mv / 1000)
    assert v["DCGM_FI_DEV_POWER_USAGE_INSTANT"] == v[rail]
    assert v["DCGM_FI_DEV_GPU_TEMP"] == v[f"hfsampler_jetson_temp_celsius/{board.gpu_zone}"]
    assert 20.0 < v["DCGM_FI_DEV_GPU_TEMP"] < 90.0  # m°C -> °C
    meminfo = (tree / "proc/meminfo").read_text().split("\n")
    kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in meminfo if ln}
    assert v["DCGM_FI_DEV_FB_USED"] == pytest.approx((kb["MemTotal"] - kb["MemAvailable"]) / 1024)
    assert v["DCGM_FI_DEV_FB_FREE"] == pytest.approx(kb["MemAvailable"] / 1024)
    if board.nvmap:
        assert v["hfsampler_jetson_nvmap_used_mib"] == pytest.approx(kb["NvMapMemUsed"] / 1024)
    if board.emc:
        assert lay.emc_rate is not None
        rate = int(lay.emc_rate.read_text())
        assert v["DCGM_FI_DEV_MEM_CLOCK"] == pytest.approx(rate / 1e6)
        _write(tree, "sys/kernel/actmon_avg_activity/mc_all", rate // 1000 // 4)  # a quarter busy
        assert _read(src, live, T0 + 1000 * MS)["DCGM_FI_DEV_MEM_COPY_UTIL"] == pytest.approx(25.0)


def test_repeats_keep_their_timestamp(tree: Path) -> None:
    """A reading is a new sample when the value changed, or when a whole refresh period passed
    (a steady value still counts once a period); otherwise its timestamp does not move, and the
    sampler keeps it out of the window statistics."""
    src, live = _open(tree)
    util = next(k for k, f in enumerate(live) if f.name == "DCGM_FI_DEV_GPU_UTIL")
    load = find_layout(tree).load
    assert load is not None
    rel = str(load.relative_to(tree.resolve()))
    values = np.zeros((1, len(live)))
    ts = np.zeros((1, len(live)), dtype=np.int64)
    stamps = []
    for step, value in enumerate((400, 400, 401, 401)):
        _write(tree, rel, value)
        src.read(live, values, ts, T0 + step * MS)
        stamps.append(int(ts[0, util]))
    assert stamps[0] == T0 // 1000
    assert stamps[1] == stamps[0]  # same value, 1 ms later: a repeat
    assert stamps[2] == (T0 + 2 * MS) // 1000  # changed
    assert stamps[3] == stamps[2]
    src.read(live, values, ts, T0 + 1003 * MS)  # unchanged, but a (default) period later
    assert int(ts[0, util]) == (T0 + 1003 * MS) // 1000
    src.close()


def test_a_rail_is_not_reread_before_its_converter_can_refresh(board: jt.Board, tree: Path) -> None:
    """An INA3221 read is an I2C transaction: inside half the chip's conversion cycle
    (JetPack 5+'s update_interval, 7 ms here; JetPack 4's ina3221x declares none, and the chip's
    default 6.6 ms stands in) the last reading stands."""
    src, live = _open(tree)
    k = next(i for i, f in enumerate(live) if f.name == "DCGM_FI_DEV_POWER_USAGE_INSTANT")
    path = board.spike_signal_path()
    _write(tree, path, 1000)
    first = _read(src, live, T0)["DCGM_FI_DEV_POWER_USAGE_INSTANT"]
    _write(tree, path, 2000)
    assert _read(src, live, T0 + 2 * MS)["DCGM_FI_DEV_POWER_USAGE_INSTANT"] == first
    later = _read(src, live, T0 + 4 * MS)["DCGM_FI_DEV_POWER_USAGE_INSTANT"]
    assert later == pytest.approx(2 * first)
    assert live[k].name == "DCGM_FI_DEV_POWER_USAGE_INSTANT"
    src.close()


def test_a_signal_quiet_at_start_is_not_read_less_often_later(tmp_path: Path) -> None:
    """Where no driver declares a period (the GPU load; JetPack 4's rails) the period measured
    at start is no reason to read less often: a load that changed every 60 ms then is read on
    every tick later, and a JetPack 4 rail every half of the chip's default cycle (3.3 ms)."""
    board = jt.BOARDS["xavier-nx-jp4"]
    root = jt.build(board, tmp_path / board.name)
    load, power = "sys/devices/gpu.0/load", board.spike_signal_path()
    stop = threading.Event()

    def quiet() -> None:
        k = 0
        while not stop.wait(0.06):
            k += 1
            _write(root, load, 400 + k % 2)
            _write(root, power, 3500 + k % 2)

    writer = threading.Thread(target=quiet)
    writer.start()
    try:
        src = JetsonSource(root, measure_s=0.3)
        inv = src.open(
            (F.BY_NAME["DCGM_FI_DEV_GPU_UTIL"], F.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"])
        )
    finally:
        stop.set()
        writer.join()
    assert {f.what: f.period_ns for f in src.files}["GPU load"] > 30 * MS  # as it was at start
    fields = inv.fields
    values = np.zeros((1, 2))
    ts = np.zeros((1, 2), dtype=np.int64)
    seen_load, power_stamps = [], set()
    for ms in range(200):  # now both change on every 1 ms tick
        _write(root, load, 100 + ms)
        _write(root, power, 1000 + ms)
        src.read(fields, values, ts, T0 + ms * MS)
        seen_load.append(values[0, 0])
        power_stamps.add(int(ts[0, 1]))
    src.close()
    assert seen_load == pytest.approx([(100 + ms) / 10 for ms in range(200)])
    assert len(power_stamps) == pytest.approx(200 / 4, abs=2)  # re-read every 4th 1 ms tick


def test_energy_integrates_the_gpu_rail(board: jt.Board, tree: Path) -> None:
    src, live = _open(tree)
    path = board.spike_signal_path()
    energy = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
    watts = []
    for step, value in enumerate((1000, 2000, 3000)):
        _write(tree, path, value)
        got = _read(src, live, T0 + step * 10 * MS)
        watts.append(got["DCGM_FI_DEV_POWER_USAGE_INSTANT"])
    # trapezoids between consecutive samples, in mJ: W x ms
    assert got[energy] == pytest.approx(
        (watts[0] + watts[1]) / 2 * 10 + (watts[1] + watts[2]) / 2 * 10
    )
    src.close()


def test_measured_refresh_periods_follow_the_hardware(board: jt.Board, tmp_path: Path) -> None:
    """At open, each file's period is the median gap between its value changes."""
    with jt.running(board, tmp_path / board.name) as writer:
        src = JetsonSource(tmp_path / board.name, measure_s=0.6)
        src.open(F.CATALOGUE)
        periods = {f.what: f.period_ns / 1e6 for f in src.files}
        src.close()
    assert writer.writes > 100
    assert periods["GPU load"] == pytest.approx(jt.LOAD_S * 1e3, rel=0.3)
    assert periods[f"{board.gpu_rail} current"] == pytest.approx(jt.INA_S * 1e3, rel=0.3)
    assert periods[f"{board.gpu_zone} temperature"] == pytest.approx(jt.TEMP_S * 1e3, rel=0.3)
    assert periods["GPU max clock"] == 1000.0  # never changed: counted once a second


# -- what is missing or breaks --------------------------------------------------------------------


def test_missing_and_unreadable_files_cost_one_log_line_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    board = jt.BOARDS["orin-nano-jp5"]  # tj-therm reads nothing, no EMC clock, no NvMap
    root = jt.build(board, tmp_path / board.name)
    (root / "sys/devices/platform/17000000.ga10b/power/runtime_status").unlink()
    caplog.set_level(logging.INFO, logger="hfsampler")
    src, live = _open(root)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("tj-therm" in m for m in lines) == 1
    assert sum("NvMapMemUsed" in m for m in lines) == 1
    assert sum("EMC clock" in m for m in lines) == 1
    assert sum("runtime_status" in m for m in lines) == 1
    assert len(lines) == 4, lines
    assert "hfsampler_jetson_gpu_railgated" not in {f.name for f in live}
    # a file that goes bad later: one line, NaN while bad, back when it reads again
    caplog.clear()
    load = "sys/devices/platform/17000000.ga10b/load"
    for step in range(5):
        _write(root, load, "garbage")
        assert np.isnan(_read(src, live, T0 + step * 100 * MS)["DCGM_FI_DEV_GPU_UTIL"])
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failed) == 1
    assert "GPU load" in failed[0]
    _write(root, load, 500)
    assert _read(src, live, T0 + 600 * MS)["DCGM_FI_DEV_GPU_UTIL"] == pytest.approx(50.0)
    src.close()


def test_a_directory_where_a_file_should_be(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """open() succeeds on a directory and pread fails (EISDIR): logged once and skipped."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    zone = root / "sys/devices/virtual/thermal/thermal_zone3/temp"
    zone.unlink()
    zone.mkdir()
    caplog.set_level(logging.WARNING, logger="hfsampler")
    src, live = _open(root)
    src.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "cv1-thermal" in lines[0]
    zones = {dict(f.labels).get("zone") for f in live if f.name == "hfsampler_jetson_temp_celsius"}
    assert "cv1-thermal" not in zones
    assert "cv0-thermal" in zones


# -- choosing the source --------------------------------------------------------------------------


def test_auto_picks_nvml_first_then_jetson_then_sim(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = jt.build(jt.BOARDS["agx-orin-jp6"], tmp_path / "orin")
    config = from_mapping({"source": "auto", "jetson": {"sysfs_root": str(root)}})
    remove_library(monkeypatch)  # no libnvidia-ml: as on a Jetson before Thor
    spec = resolve_source(config)
    assert spec.kind == "jetson"
    assert spec.jetson_root == str(root)
    not_tegra = tmp_path / "pc"
    not_tegra.mkdir()
    assert resolve_source(Config(jetson_sysfs_root=str(not_tegra))).kind == "sim"
    install(monkeypatch, make_fake(1))  # NVML answers: it wins, Tegra or not
    assert resolve_source(config).kind == "nvml"


def test_config_keys(tmp_path: Path) -> None:
    config = from_mapping({"source": "jetson", "jetson": {"sysfs_root": str(tmp_path)}})
    assert config.source == "jetson"
    assert config.jetson_sysfs_root == str(tmp_path)
    with pytest.raises(ConfigError, match=r"^jetson\.sysfs_rot: unknown key.*'sysfs_root'"):
        from_mapping({"jetson": {"sysfs_rot": "/x"}})
    with pytest.raises(ConfigError, match=r"^jetson\.sysfs_root: .*absolute"):
        from_mapping({"jetson": {"sysfs_root": "rel/tree"}})
    with pytest.raises(ConfigError, match=r"^jetson\.sysfs_root: .*not a directory"):
        from_mapping({"jetson": {"sysfs_root": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"^jetsn: unknown key.*'jetson'"):
        from_mapping({"jetsn": {}})


def test_check_config_shows_what_a_jetson_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check-config on a jetson config counts the fields a Jetson has files for (not NVML's)
    and shows jetson.sysfs_root."""
    from hfsampler.cli.main import main

    cfg = tmp_path / "c.yml"
    cfg.write_text(f"source: jetson\njetson: {{sysfs_root: {tmp_path}}}\n")
    assert main(["check-config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"jetson.sysfs_root: {tmp_path}" in out
    for group in (F.FAST, F.SLOW):
        n = sum(f.group == group and f.jetson is not None for f in F.CATALOGUE)
        assert f"group {group}: {n} fields every" in out


def test_the_jetson_fields_can_be_selected_by_name() -> None:
    """--fields took names by upper-casing them, which only the DCGM names survive."""
    names = ["hfsampler_jetson_rail_power_watts", "HFSAMPLER_JETSON_TEMP_CELSIUS", "power_usage"]
    assert [f.name for f in F.select(names)] == [
        "DCGM_FI_DEV_POWER_USAGE",
        "hfsampler_jetson_rail_power_watts",
        "hfsampler_jetson_temp_celsius",
    ]


def test_reading_is_cheap(tree: Path) -> None:
    """A fast tick is a few preads on open descriptors: well under the 1 ms interval."""
    src, live = _open(tree)
    fast = tuple(f for f in live if f.group == F.FAST)
    values = np.zeros((1, len(fast)))
    ts = np.zeros((1, len(fast)), dtype=np.int64)
    took = []
    for k in range(300):
        t = time.perf_counter_ns()
        src.read(fast, values, ts, T0 + k * MS)
        took.append(time.perf_counter_ns() - t)
    src.close()
    assert float(np.median(took)) < 300_000


@pytest.mark.alone  # it measures time: no other test runs meanwhile
def test_power_from_voltage_and_current_counts_each_conversion_once(tmp_path: Path) -> None:
    """The INA3221 converts a channel's voltage and current in the same cycle: V x I is one
    sample per cycle, even though the steady voltage alone is re-counted once a period."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    src, live = _open(root)
    k = next(i for i, f in enumerate(live) if f.name == "DCGM_FI_DEV_POWER_USAGE_INSTANT")
    values = np.zeros((1, len(live)))
    ts = np.zeros((1, len(live)), dtype=np.int64)
    stamps = set()
    cycle_ms = 7  # the fixture chip's update_interval
    for ms in range(700):  # the sampler's 1 ms ticks, on a clock the test moves
        if ms % cycle_ms == 0:
            _write(root, board.spike_signal_path(), 600 + ms // cycle_ms % 50)
        src.read(live, values, ts, T0 + ms * MS)
        stamps.add(int(ts[0, k]))
    src.close()
    assert len(stamps) == pytest.approx(700 / cycle_ms, abs=2)


def test_cli_takes_source_jetson_and_lists_how_each_field_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hfsampler.cli.main import build_parser, main
    from hfsampler.config.flags import config_from_args

    root = jt.build(jt.BOARDS["xavier-nx-jp4"], tmp_path / "nx")
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"jetson: {{sysfs_root: {root}}}\n")
    args = build_parser()[0].parse_args(["run", "--source", "jetson", "--config", str(cfg)])
    spec = resolve_source(config_from_args(args))
    assert (spec.kind, spec.jetson_root) == ("jetson", str(root))
    assert main(["fields"]) == 0
    out = capsys.readouterr().out
    rail = next(ln for ln in out.splitlines() if ln.startswith("hfsampler_jetson_rail_power"))
    assert "rail_power per rail" in rail
    util = next(ln for ln in out.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_UTIL "))
    assert "gpu_load" in util
    assert "call:util_gpu" in util


def test_probe_and_record_take_the_config_s_sysfs_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jetson.sysfs_root`` is a config key: probe and record take --config like run."""
    import json

    from hfsampler.cli.main import build_parser, main
    from hfsampler.cli.record import options

    board = jt.BOARDS["xavier-nx-jp4"]
    root = jt.build(board, tmp_path / "nx")
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"jetson: {{sysfs_root: {root}}}\n")
    fields = "DCGM_FI_DEV_GPU_UTIL,hfsampler_jetson_rail_power_watts"
    argv = ["probe", "--config", str(cfg), "--source", "jetson", "--duration", "0.2s",
            "--fields", fields, "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "jetson"
    probed = {(f["name"], dict(f["labels"]).get("rail")): f["supported"] for f in out["fields"]}
    assert probed[("DCGM_FI_DEV_GPU_UTIL", None)]
    assert {rail for (name, rail), ok in probed.items() if name.endswith("watts") and ok} == set(
        board.rails
    )
    args = build_parser()[0].parse_args(["record", "--config", str(cfg), "--duration", "1s"])
    assert options(args).config.jetson_sysfs_root == str(root)


def test_a_value_missing_from_meminfo_leaves_the_others(tmp_path: Path) -> None:
    """No NvMapMemUsed in this kernel's meminfo: that field goes, MemTotal/MemAvailable stay,
    whichever is asked for first."""
    board = jt.BOARDS["orin-nano-jp5"]
    root = jt.build(board, tmp_path / board.name)
    nvmap, used = F.BY_NAME["hfsampler_jetson_nvmap_used_mib"], F.BY_NAME["DCGM_FI_DEV_FB_USED"]
    src = JetsonSource(root, measure_s=0.0)
    inv = src.open((nvmap, used))
    src.close()
    assert inv.supported[0].tolist() == [False, True]


def test_a_clock_stepped_back_does_not_stall_reading(board: jt.Board, tree: Path) -> None:
    """The sampler's clock is the wall clock: an NTP step back must not hold a rail's last
    reading, nor stop the energy counter, until the clock catches up."""
    src, live = _open(tree)
    path = board.spike_signal_path()
    power, energy = "DCGM_FI_DEV_POWER_USAGE_INSTANT", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
    _write(tree, path, 1000)
    first = _read(src, live, T0)[power]
    _write(tree, path, 2000)
    stepped = T0 - 10_000 * MS  # 10 s back
    got = _read(src, live, stepped)
    assert got[power] == pytest.approx(2 * first)
    _write(tree, path, 3000)
    later = _read(src, live, stepped + 10 * MS)
    assert later[power] == pytest.approx(3 * first)
    # the step back restarts the integral (no credit for it), 10 ms from 2x to 3x later
    assert later[energy] == pytest.approx(got[energy] + (2 + 3) / 2 * first * 10.0)
    src.close()


def test_a_fast_read_never_waits_for_a_file_only_the_slow_lane_reads(tree: Path) -> None:
    """A slow group's file held mid-read (its lock taken, as a slow I2C sensor's read holds it):
    the fast group's read, on the other lane, completes meanwhile."""
    src, live = _open(tree)
    try:
        fast = tuple(f for f in live if f.group == F.FAST)
        slow = tuple(f for f in live if f.group != F.FAST)
        only_slow = set(map(id, src.files_for(slow))) - set(map(id, src.files_for(fast)))
        held = [f.blob.lock for f in src.files_for(slow) if id(f) in only_slow]
        assert held, "no file only the slow group reads"
        for lock in held:
            lock.acquire()
        done = threading.Event()
        try:
            reader = threading.Thread(
                target=lambda: (_read(src, fast, T0), done.set()), daemon=True
            )
            reader.start()
            assert done.wait(5.0), "the fast read waited for a slow group's file"
        finally:
            for lock in held:
                lock.release()
    finally:
        src.close()

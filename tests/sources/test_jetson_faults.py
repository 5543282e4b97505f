"""The jetson source where the tree is not as it should be: permissions, odd file types, files
that vanish, fail, come back or are replaced, readings out of range.

As in tests/sources/test_jetson_source.py, nothing inside hfsampler is faked: the source reads real
files
under a fixture root (tests/support/jetson_trees.py), and the tests damage that tree.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jetson_trees as jt
import numpy as np
import pytest

import hfsampler
from hfsampler import fields as F
from hfsampler.cli.main import main
from hfsampler.fields import Field
from hfsampler.sampling.groups import plan_groups
from hfsampler.sampling.plan import discover
from hfsampler.sampling.sampler import Sampler
from hfsampler.sources.base import SourceSpec
from hfsampler.sources.jetson.files import Blob
from hfsampler.sources.jetson.source import JetsonSource
from hfsampler.sources.jetson.sysfs import find_layout, is_tegra

REPO = Path(hfsampler.__file__).resolve().parents[1]
NOBODY = 65534


@pytest.fixture
def open_tree() -> Iterator[Path]:
    """A directory any user can read (pytest's tmp_path is root's alone)."""
    top = Path(tempfile.mkdtemp(prefix="hfsampler-jetson-"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        for path in top.rglob("*"):  # give back what a test took away, so it can be removed
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(top)


# Imports first: the interpreter may live where only root can read (here, under /root).
def _open(root: Path) -> tuple[JetsonSource, tuple[Field, ...]]:
    source = JetsonSource(root, measure_s=0.0)
    inv = source.open(F.CATALOGUE)
    return source, tuple(f for f, ok in zip(inv.fields, inv.supported[0], strict=True) if ok)


_CHILD = """
import hashlib, json, logging, os, sys  # hashlib: uuid5 imports it late
from hfsampler import fields as F
from hfsampler.sources.jetson.source import JetsonSource
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
if os.geteuid() == 0:
    os.setuid(int(sys.argv[2]))  # the shipped unit's DynamicUser: no root, no capability
src = JetsonSource(sys.argv[1], measure_s=0.0)
inv = src.open(F.CATALOGUE)
src.close()
print(json.dumps([f.name for f, ok in zip(inv.fields, inv.supported[0]) if ok]))
"""


def _open_unprivileged(root: Path) -> subprocess.CompletedProcess[str]:
    """Open the source on ``root`` in a child that is not root: as root, it drops to nobody
    once the tree is built and its modules are loaded; as another user it is one already."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(NOBODY)],
        capture_output=True, text=True, timeout=60, env=env, cwd="/",
    )  # fmt: skip


def test_a_non_root_start_skips_debugfs_with_one_line(open_tree: Path) -> None:
    """Under the shipped unit (DynamicUser) debugfs cannot be read: stat raises EACCES, which
    ``Path.is_file()`` raised before Python 3.14. The EMC fields go, with one line."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, open_tree / board.name)
    (root / "sys/kernel/debug").chmod(0o000)
    done = _open_unprivileged(root)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    supported = set(json.loads(done.stdout))
    assert "DCGM_FI_DEV_MEM_CLOCK" not in supported
    assert "DCGM_FI_DEV_MEM_COPY_UTIL" not in supported
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE_INSTANT"} <= supported
    warned = [ln for ln in done.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warned) == 1, warned
    assert "EMC clock" in warned[0]
    assert "permission denied" in warned[0]


@pytest.mark.timeout(20)
def test_fifos_in_the_tree_neither_hang_nor_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO where a file should be would block a plain open() forever: the layout skips it with
    a note, and a file that turns into one after the layout is refused at open, not waited on."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    for rel in ("sys/devices/virtual/thermal/thermal_zone3/temp",
                "sys/firmware/devicetree/base/gpu@17000000/compatible",
                "proc/device-tree/serial-number"):  # fmt: skip
        (root / rel).unlink()
        os.mkfifo(root / rel)
    caplog.set_level(logging.WARNING, logger="hfsampler")
    src, live = _open(root)
    src.close()
    zones = {dict(f.labels).get("zone") for f in live if f.name == "hfsampler_jetson_temp_celsius"}
    assert "cv1-thermal" not in zones
    assert "cv0-thermal" in zones
    lines = [r.getMessage() for r in caplog.records]
    assert sum("cv1-thermal" in m for m in lines) == 1, lines
    # the race: the layout saw a regular file, the open finds a FIFO
    load = root / "sys/devices/platform/bus@0/17000000.gpu/load"
    load.unlink()
    os.mkfifo(load)
    with pytest.raises(OSError, match="not a regular file"):
        Blob(load, 64).open()


def test_a_rail_missing_a_file_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each file a rail lacks is one line naming the rail and what it costs; a channel without
    its label cannot be named, and says so; a GPU rail without power says what that costs."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    chip = root / "sys/devices/platform/bus@0/c240000.i2c/i2c-1"
    (chip / "1-0040/hwmon/hwmon3/in1_input").unlink()  # VDD_GPU_SOC, the GPU rail: no voltage
    (chip / "1-0040/hwmon/hwmon3/curr2_input").unlink()  # VDD_CPU_CV: no current
    (chip / "1-0040/hwmon/hwmon3/in3_label").unlink()  # VIN_SYS_5V0: no name
    (chip / "1-0041/hwmon/hwmon4/curr2_input").unlink()  # VDDQ_VDD2_1V8AO: a directory
    (chip / "1-0041/hwmon/hwmon4/curr2_input").mkdir()
    caplog.set_level(logging.WARNING, logger="hfsampler")
    src, live = _open(root)
    src.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines
    for rail, what in (("VDD_GPU_SOC", "in1_input missing"), ("VDD_CPU_CV", "curr2_input missing"),
                       ("VDDQ_VDD2_1V8AO", "curr2_input not a regular file")):  # fmt: skip
        assert sum(rail in m and what in m for m in lines) == 1, (rail, lines)
    assert sum("channel 3" in m and "in3_label missing" in m for m in lines) == 1, lines
    assert sum("GPU rail VDD_GPU_SOC has no power" in m for m in lines) == 1, lines
    have = {(f.name, dict(f.labels).get("rail")) for f in live}
    assert ("hfsampler_jetson_rail_current_amperes", "VDD_GPU_SOC") in have
    assert ("hfsampler_jetson_rail_voltage_volts", "VDD_CPU_CV") in have
    assert ("hfsampler_jetson_rail_power_watts", "VDD_CPU_CV") not in have
    assert ("DCGM_FI_DEV_POWER_USAGE_INSTANT", None) not in have
    assert not any(rail == "VIN_SYS_5V0" for _, rail in have)


def _mali_board(root: Path) -> Path:
    """A Rockchip RK3588 board's devfreq GPU, as Mali has it: of_node name ``gpu``, a load file."""
    dev = root / "sys/devices/platform/fb000000.gpu"
    (dev / "devfreq/fb000000.gpu").mkdir(parents=True)
    for name, text in (("cur_freq", "300000000\n"), ("min_freq", "300000000\n"),
                       ("max_freq", "1000000000\n")):  # fmt: skip
        (dev / "devfreq/fb000000.gpu" / name).write_text(text)
    (dev / "load").write_text("12@300000000Hz\n")
    node = root / "sys/firmware/devicetree/base/gpu@fb000000"
    node.mkdir(parents=True)
    (node / "name").write_bytes(b"gpu\0")
    (node / "compatible").write_bytes(b"rockchip,rk3588-mali\0arm,mali-valhall-csf\0")
    (dev / "of_node").symlink_to("../../../firmware/devicetree/base/gpu@fb000000")
    (dev / "devfreq/fb000000.gpu/device").symlink_to("../..")
    (root / "sys/class/devfreq").mkdir(parents=True)
    (root / "sys/class/devfreq/fb000000.gpu").symlink_to(
        "../../devices/platform/fb000000.gpu/devfreq/fb000000.gpu"
    )
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "proc/device-tree/compatible").write_bytes(b"radxa,rock-5b\0rockchip,rk3588\0")
    return root


def test_a_gpu_named_gpu_is_a_tegra_s_only_on_a_tegra(tmp_path: Path) -> None:
    """Mali and Adreno devfreq nodes are named ``gpu`` too: without ``nvidia,tegra`` in the
    device tree that name alone is not a Jetson; NVIDIA's own node names (gv11b...) are."""
    mali = _mali_board(tmp_path / "rk3588")
    assert (mali / "sys/class/devfreq/fb000000.gpu/device/of_node/name").read_bytes() == b"gpu\0"
    assert not is_tegra(mali)
    lay = find_layout(mali)
    assert lay.gpu_device is None
    assert lay.load is None
    orin = jt.build(jt.BOARDS["agx-orin-jp6"], tmp_path / "orin")  # its node is named gpu
    assert is_tegra(orin)
    assert find_layout(orin).gpu_device == "17000000.gpu"
    (orin / "proc/device-tree/compatible").write_bytes(b"nvidia,p3737-0000+p3701-0005\0")
    assert not is_tegra(orin)
    nx = jt.build(jt.BOARDS["xavier-nx-jp4"], tmp_path / "nx")  # gv11b: NVIDIA's by name
    (nx / "proc/device-tree/compatible").unlink()
    assert is_tegra(nx)
    assert find_layout(nx).gpu_device == "17000000.gv11b"


@pytest.mark.parametrize("command", ["run", "probe", "record"])
def test_source_jetson_where_there_is_none_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """No phantom GPU: ``--source jetson`` off a Jetson is one line naming what was looked for
    and the fix, exit 2 (as a config mistake; the unit does not restart on it)."""
    pc = tmp_path / "pc"
    (pc / "proc").mkdir(parents=True)
    (pc / "proc/meminfo").write_text("MemTotal: 100 kB\nMemAvailable: 50 kB\n")
    config = tmp_path / "c.yml"
    config.write_text(f"jetson: {{sysfs_root: {pc}}}\n")
    extra = {"run": ["--listen", ""], "record": []}.get(command, [])
    argv = [command, "--source", "jetson", "--config", str(config), "--duration", "1s", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "source: jetson" in err[0]
    assert "is not a Jetson" in err[0]
    assert "nvidia,tegra" in err[0]
    assert "ga10b" in err[0]
    assert "--source auto" in err[0]


def test_what_open_finds_is_logged_once_per_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Discovery logs what is missing or unreadable; the sampler process, which opens the
    source again, does not repeat it: not a note that costs no field (no nv_tegra_release),
    nor a file that failed for one field of a rail another of its fields still needs."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    (root / "etc/nv_tegra_release").unlink()
    hwmon = root / "sys/devices/platform/bus@0/c240000.i2c/i2c-1/1-0040/hwmon/hwmon3"
    (hwmon / "curr2_input").write_text("abc\n")  # VDD_CPU_CV: its voltage still reads
    spec = SourceSpec("jetson", jetson_root=str(root))
    caplog.set_level(logging.INFO, logger="hfsampler")
    inventory = discover(spec, F.CATALOGUE)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("nv_tegra_release" in m for m in said) == 1, said
    assert sum("VDD_CPU_CV current" in m for m in said) == 1, said
    assert any(dict(f.labels).get("rail") == "VDD_CPU_CV" for f in inventory.fields)
    capfd.readouterr()
    with Sampler(spec, inventory, plan_groups(inventory.fields, {"fast": 0.001, "slow": 0.1}),
                 window_s=1.0, spin_s=0.0) as sampler:  # fmt: skip
        sampler.start()
    child = capfd.readouterr().err
    assert "jetson:" not in child, child


MS = 1_000_000
T0 = 1_800_000_000 * 1_000_000_000


def _reader(src: JetsonSource, *names: str) -> Callable[[int], list[float]]:
    fields = tuple(F.BY_NAME[n] for n in names)
    values = np.zeros((1, len(fields)))
    ts = np.zeros((1, len(fields)), dtype=np.int64)

    def read(now_ns: int) -> list[float]:
        src.read(fields, values, ts, now_ns)
        return [float(v) for v in values[0]]

    return read


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    """What was logged; but the energy counter's gaps, which a made-up clock's jumps make."""
    said = [r.getMessage() for r in caplog.records if r.levelno >= level]
    return [m for m in said if not m.startswith("jetson: GPU rail energy")]


def test_a_file_unreadable_at_open_is_sampled_once_it_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure at open is not for good: the zone that reads nothing at start is kept, NaN,
    and sampled once it reads, with one line when it fails and one when it comes back."""
    board = jt.BOARDS["orin-nano-jp5"]  # tj-therm's temp is empty
    root = jt.build(board, tmp_path / board.name)
    caplog.set_level(logging.INFO, logger="hfsampler")
    src, live = _open(root)
    tj = F.BY_NAME["hfsampler_jetson_temp_celsius"].instance("tj-therm")
    assert tj in live
    values = np.zeros((1, 1))
    ts = np.zeros((1, 1), dtype=np.int64)
    src.read((tj,), values, ts, T0)
    assert np.isnan(values[0, 0])
    caplog.clear()
    (root / "sys/devices/virtual/thermal/thermal_zone8/temp").write_text("48500\n")
    src.read((tj,), values, ts, T0 + 2000 * MS)
    src.close()
    assert values[0, 0] == pytest.approx(48.5)
    said = _lines(caplog)
    assert len(said) == 1, said
    assert "tj-therm temperature" in said[0]
    assert "reads again" in said[0]


def test_a_replaced_or_vanished_file_is_reopened_off_the_fast_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A descriptor keeps reading the inode it opened: a file replaced by a rename (or a driver
    rebound: new sysfs inodes) would read the old one for ever. About once a second, on a slow
    group's read (never a fast tick's, unless no slow read comes for two seconds), each path's
    inode is checked: replaced, it is reopened (one line); gone, it fails (one line) until it
    is back."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    load = root / "sys/devices/platform/bus@0/17000000.gpu/load"
    load.write_text("100\n")
    caplog.set_level(logging.INFO, logger="hfsampler")
    src, _ = _open(root)
    caplog.clear()
    fast = _reader(src, "DCGM_FI_DEV_GPU_UTIL")
    slow = _reader(src, "hfsampler_jetson_gpu_max_clock_mhz")
    assert fast(T0) == [10.0]
    new = load.with_name("load.new")
    new.write_text("200\n")
    new.rename(load)
    assert all(fast(T0 + ms * MS) == [10.0] for ms in range(1, 1500))  # fast ticks: no check
    assert _lines(caplog) == []
    slow(T0 + 1500 * MS)
    assert fast(T0 + 1501 * MS) == [20.0]
    said = _lines(caplog)
    assert len(said) == 1, said
    assert "was replaced" in said[0]
    caplog.clear()
    load.unlink()
    slow(T0 + 2600 * MS)
    assert np.isnan(fast(T0 + 2601 * MS)[0])
    assert np.isnan(fast(T0 + 2602 * MS)[0])
    load.write_text("300\n")
    slow(T0 + 3700 * MS)
    assert fast(T0 + 3701 * MS) == [30.0]
    src.close()
    said = _lines(caplog)
    assert len(said) == 2, said
    assert said[0].startswith("jetson: reading GPU load")
    assert "gone since it was opened" in said[0]
    assert said[1].startswith("jetson: GPU load")
    assert said[1].endswith("reads again")


def test_implausible_readings_are_none_with_one_line_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A disabled zone's sentinel (below -100 C), a temperature over 200 C, a negative voltage
    or current, a power over 10 kW: no reading, one line per field, back when it is plausible."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    hwmon = root / "sys/devices/platform/bus@0/c240000.i2c/i2c-1/1-0040/hwmon/hwmon3"
    zone = root / "sys/devices/virtual/thermal/thermal_zone0/temp"  # cpu-thermal
    caplog.set_level(logging.INFO, logger="hfsampler")
    src, _ = _open(root)
    caplog.clear()
    fields = (F.BY_NAME["hfsampler_jetson_temp_celsius"].instance("cpu-thermal"),
              F.BY_NAME["hfsampler_jetson_rail_current_amperes"].instance("VDD_CPU_CV"),
              F.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"])  # fmt: skip
    values = np.zeros((1, 3))
    ts = np.zeros((1, 3), dtype=np.int64)
    steps = [  # cpu-thermal m°C, VDD_CPU_CV mA, VDD_GPU_SOC mV and mA
        (-1_000_000, -5, 5000, 1000),
        (250_000, -5, 20_000, 600_000),  # 12 kW
        (45_000, 900, 5000, 1000),
    ]
    got = []
    for k, (temp, cpu_ma, gpu_mv, gpu_ma) in enumerate(steps):
        zone.write_text(f"{temp}\n")
        (hwmon / "curr2_input").write_text(f"{cpu_ma}\n")
        (hwmon / "in1_input").write_text(f"{gpu_mv}\n")
        (hwmon / "curr1_input").write_text(f"{gpu_ma}\n")
        src.read(fields, values, ts, T0 + k * 100 * MS)
        got.append([float(v) for v in values[0]])
    src.close()
    assert np.isnan(got[0][:2]).all()
    assert got[0][2] == pytest.approx(5.0)
    assert np.isnan(got[1]).all()
    assert got[2] == pytest.approx([45.0, 0.9, 5.0])
    said = _lines(caplog, logging.WARNING)
    assert len(said) == 3, said
    assert said[0].startswith("jetson: reading cpu-thermal temperature")
    assert "-1e+06 is outside the plausible -100000 to 200000" in said[0]
    assert said[1].startswith("jetson: reading VDD_CPU_CV current")
    assert "-5 is outside the plausible 0 to inf" in said[1]
    assert said[2].startswith("jetson: VDD_GPU_SOC power (W) 12000 is outside")
    assert sum("reads again" in m for m in _lines(caplog)) == 2


GPU_MV = 4992  # the AGX Orin fixture's GPU rail (VDD_GPU_SOC) bus voltage


@pytest.mark.alone  # it measures time: no other test runs meanwhile
def test_no_energy_is_credited_across_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the GPU rail cannot be read the counter stands still: the last power is not
    held across the gap, which is counted and said once."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    current = root / "sys/devices/platform/bus@0/c240000.i2c/i2c-1/1-0040/hwmon/hwmon3/curr1_input"
    src = JetsonSource(root, measure_s=0.0)
    (energy,) = src.open((F.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"],)).fields
    caplog.set_level(logging.INFO, logger="hfsampler")
    values = np.zeros((1, 1))
    ts = np.zeros((1, 1), dtype=np.int64)
    for ms in range(0, 430, 10):
        current.write_text("N/A\n" if 20 <= ms < 410 else "1000\n")
        src.read((energy,), values, ts, T0 + ms * MS)
    src.close()
    watts = GPU_MV * 1000 * 1e-6
    assert values[0, 0] == pytest.approx(watts * 10 + watts * 10)  # [0, 10] and [410, 420] ms
    said = [m for r in caplog.records if (m := r.getMessage()).startswith("jetson: GPU rail ene")]
    assert said == [
        "jetson: GPU rail energy: 0.4 s without a reading left uncounted (0.4 s in all)"
    ]


@pytest.mark.alone  # it measures time: no other test runs meanwhile
def test_energy_counts_every_conversion_when_only_a_slow_group_reads_it(tmp_path: Path) -> None:
    """With the counter in the 100 ms group alone, reads see one conversion in 14: a 30 ms
    spike between two of them was missed whole (or, caught, held for 100 ms). A thread then
    reads the rail at its cycle, and the counter is the energy (real time: the thread's)."""
    board = jt.BOARDS["agx-orin-jp6"]
    root = jt.build(board, tmp_path / board.name)
    fd = os.open(root / jt.agx_orin().spike_signal_path(), os.O_WRONLY)
    src = JetsonSource(root, measure_s=0.0)
    (energy,) = src.open((F.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"],)).fields
    values = np.zeros((1, 1))
    ts = np.zeros((1, 1), dtype=np.int64)
    writes: list[tuple[int, int]] = []  # (wall ns, mA)

    def put(ma: int) -> None:
        os.pwrite(fd, f"{ma:>12d}\n".encode(), 0)
        writes.append((time.time_ns(), ma))

    reads: list[tuple[int, float]] = []
    try:
        put(1000)
        for _ in range(16):  # the slow group's reads, a spike between each two
            now = time.time_ns()
            src.read((energy,), values, ts, now)
            reads.append((now, float(values[0, 0])))
            time.sleep(0.035)
            put(5000)
            time.sleep(0.030)
            put(1000)
            time.sleep(0.035)
        threads = {t.name for t in threading.enumerate()}
    finally:
        src.close()
        os.close(fd)
    assert "jetson-energy" in threads
    assert "jetson-energy" not in {t.name for t in threading.enumerate()}
    (t_a, e_a), (t_b, e_b) = reads[5], reads[-1]  # once the thread runs
    got_w = (e_b - e_a) / ((t_b - t_a) / 1e6)
    truth = 0.0
    for (t0, ma), (t1, _) in itertools.pairwise([*writes, (t_b, 0)]):
        lo, hi = max(t0, t_a), min(t1, t_b)
        truth += max(hi - lo, 0) * GPU_MV * ma * 1e-12  # ns x mV x mA -> mJ
    truth_w = truth / ((t_b - t_a) / 1e6)  # mJ per ms
    assert truth_w > 9  # the spikes are a third of each 100 ms at five times the power
    assert got_w == pytest.approx(truth_w, rel=0.05)

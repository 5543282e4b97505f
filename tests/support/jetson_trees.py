"""Jetson sysfs trees for tests: three real boards' layouts, written as real files under a root,
with the files that change rewritten in place as the clock moves.

Each ``Board`` is a small description: static files (device tree, L4T release, devfreq limits),
relative symlinks as sysfs has them (``/sys/class/devfreq/*``, ``/sys/class/thermal/*``, the I2C
driver's device links), and ``Signal``s: files whose integer value changes every ``period_s``, the
way the hardware behind them refreshes (an INA3221 channel every conversion cycle, the GPU load
when the PMU updates it). ``TreeWriter`` runs those signals on a thread: at each period boundary
it rewrites the file in place with ``os.pwrite`` on one descriptor (the same inode, so a reader
holding the file open sees the new value, as with sysfs), right-aligned to a fixed width so a
shorter number never leaves a stale digit. Once a second it plants a spike on the board's GPU
rail current (and on JetPack 4 its power), held ``SPIKE_HOLD_S``, each with its own value, and
records when it was on the file, so a test can tell which window's ``_max`` it must be.

The layouts follow the real boards (paths as L4T's kernels expose them; values are plausible, not
recorded): AGX Orin on JetPack 6 (r36), Orin Nano on JetPack 5 (r35), Xavier NX on JetPack 4 (r32).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

WIDTH = 12  # every rewritten value takes this many characters plus a newline
SPIKE_OFFSET_S = 0.4  # into each wall-clock second
SPIKE_HOLD_S = 0.03


@dataclass(frozen=True)
class Signal:
    """A file holding ``base`` plus deterministic noise in [-noise, noise], new each period."""

    path: str
    period_s: float
    base: int
    noise: int = 0
    spike: int | None = None  # the value of the first spike; each later one adds spike_step
    spike_step: int = 0

    def value(self, bucket: int, salt: int) -> int:
        if not self.noise:
            return self.base
        h = (bucket * 0x9E3779B97F4A7C15 + salt * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        return self.base + (h % (2 * self.noise + 1)) - self.noise


@dataclass(frozen=True)
class Board:
    name: str
    files: dict[str, bytes]
    links: dict[str, str]  # link path -> relative target, as sysfs's
    signals: tuple[Signal, ...]
    # what a test expects the source to find
    model: str
    l4t: str
    gpu_device: str
    rails: tuple[str, ...]
    gpu_rail: str
    gpu_rail_mv: int  # the GPU rail's (constant) bus voltage: spike power = mV x spike mA
    zones: tuple[str, ...]  # every zone the source samples, readable or not
    gpu_zone: str
    emc: bool
    nvmap: bool
    # what reads nothing: the source logs it once and retries it, and it exports no sample
    unreadable: tuple[str, ...] = ()

    def spike_signal_path(self) -> str:
        """The file the source takes the GPU rail's power from: JetPack 4's in_power (mW), else
        the rail's current (mA, times its constant voltage)."""
        spiky = [s.path for s in self.signals if s.spike is not None]
        return next((p for p in spiky if "in_power" in p), spiky[0])

    def spike_watts(self, spike: Spike) -> float:
        """The GPU rail's power while ``spike`` was on: the driver's own power file where it has
        one (JetPack 4, mW), else the rail's voltage x the spiked current, as the source reads."""
        for path, value in spike.values.items():
            if "in_power" in path:
                return value * 1e-3
        (current,) = spike.values.values()
        return self.gpu_rail_mv * current * 1e-6


def _devfreq(dev: str, node: str, dev_dir: str, load_dir: str | None) -> dict[str, bytes]:
    """A devfreq GPU node: frequencies in Hz, the device's of_node name, runtime PM state."""
    freq = f"{dev_dir}/devfreq/{dev}"
    out = {
        f"{freq}/min_freq": b"306000000\n",
        f"{freq}/max_freq": b"1300500000\n",
        f"{freq}/cur_freq": b"1300500000\n",
        f"{freq}/polling_interval": b"25\n",
        f"{freq}/governor": b"nvhost_podgov\n",
        f"{dev_dir}/power/runtime_status": b"active\n",
        f"{dev_dir}/power/control": b"auto\n",
        f"{dev_dir}/railgate_enable": b"1\n",
        f"sys/firmware/devicetree/base/{node}@17000000/name": node.encode() + b"\0",
        f"sys/firmware/devicetree/base/{node}@17000000/compatible": b"nvidia,gpu\0",
    }
    if load_dir is not None:
        out[f"{load_dir}/load"] = b"0\n"
    return out


def _devfreq_links(dev: str, node: str, dev_dir: str) -> dict[str, str]:
    depth = "../" * dev_dir.count("/")  # from the device's directory up to sys/
    return {
        f"sys/class/devfreq/{dev}": f"../../{dev_dir.removeprefix('sys/')}/devfreq/{dev}",
        f"{dev_dir}/devfreq/{dev}/device": "../..",
        f"{dev_dir}/of_node": f"{depth}firmware/devicetree/base/{node}@17000000",
    }


def _zones(types: list[str]) -> tuple[dict[str, bytes], dict[str, str]]:
    files, links = {}, {}
    for n, t in enumerate(types):
        files[f"sys/devices/virtual/thermal/thermal_zone{n}/type"] = t.encode() + b"\n"
        files[f"sys/devices/virtual/thermal/thermal_zone{n}/temp"] = b"40000\n"
        zone = f"devices/virtual/thermal/thermal_zone{n}"
        links[f"sys/class/thermal/thermal_zone{n}"] = f"../../{zone}"
    return files, links


def _meminfo(total_kb: int, avail_kb: int, nvmap_kb: int | None) -> bytes:
    lines = [
        f"MemTotal:       {total_kb} kB",
        f"MemFree:        {avail_kb // 2} kB",
        f"MemAvailable:   {avail_kb} kB",
        "Buffers:           61440 kB",
        "Cached:          2345678 kB",
        "SwapCached:            0 kB",
    ]
    if nvmap_kb is not None:
        lines += ["NvMapMemFree:      94784 kB", f"NvMapMemUsed:   {nvmap_kb} kB"]
    lines += ["CmaTotal:         753664 kB", "HugePages_Total:       0",
              "Hugepagesize:       2048 kB"]  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


def _hwmon(chip: str, hwmon: str, channels: list[str]) -> dict[str, bytes]:
    """JetPack 5+'s INA3221 under hwmon: labels, the sum channel (in7), the conversion config."""
    base = f"sys/devices/platform/bus@0/c240000.i2c/i2c-1/{chip}/hwmon/{hwmon}"
    out = {
        f"{base}/name": b"ina3221\n",
        f"{base}/samples": b"1\n",
        # enabled channels x samples x (bus + shunt conversion, 1.1 ms each), rounded: 6.6 ms
        f"{base}/update_interval": b"7\n",
        f"{base}/in7_label": b"sum of shunt voltages\n",
        f"{base}/in7_input": b"1234\n",
        f"{base}/curr4_input": b"1234\n",
    }
    for n, label in enumerate(channels, start=1):
        out[f"{base}/in{n}_label"] = label.encode() + b"\n"
        out[f"{base}/in{n}_input"] = b"0\n"
        out[f"{base}/curr{n}_input"] = b"0\n"
        out[f"{base}/curr{n}_max"] = b"32760\n"
        out[f"{base}/curr{n}_crit"] = b"32760\n"
    return out


def _ina_links(driver: str, chips: list[str]) -> dict[str, str]:
    return {
        f"sys/bus/i2c/drivers/{driver}/{chip}": (
            f"../../../../devices/platform/bus@0/c240000.i2c/i2c-1/{chip}"
        )
        for chip in chips
    }


INA_S = 0.0066  # 3 channels x 1 sample x (1.1 ms + 1.1 ms)
LOAD_S = 0.02
EMC_S = 0.02
MEM_S = 0.01
TEMP_S = 0.1


def agx_orin() -> Board:
    """Jetson AGX Orin developer kit, JetPack 6 (L4T r36.3): devfreq ``17000000.gpu``."""
    dev, dev_dir = "17000000.gpu", "sys/devices/platform/bus@0/17000000.gpu"
    hw = "sys/devices/platform/bus@0/c240000.i2c/i2c-1"
    zone_types = ["cpu-thermal", "gpu-thermal", "cv0-thermal", "cv1-thermal", "cv2-thermal",
                  "soc0-thermal", "soc1-thermal", "soc2-thermal", "tj-thermal"]  # fmt: skip
    zfiles, zlinks = _zones(zone_types)
    files = {
        **_devfreq(dev, "gpu", dev_dir, dev_dir),
        **_hwmon("1-0040", "hwmon3", ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"]),
        **_hwmon("1-0041", "hwmon4", ["NC", "VDDQ_VDD2_1V8AO", "NC"]),
        **zfiles,
        "proc/device-tree/model": b"NVIDIA Jetson AGX Orin Developer Kit\0",
        "proc/device-tree/compatible": (
            b"nvidia,p3737-0000+p3701-0005\0nvidia,p3701-0005\0nvidia,tegra234\0"
        ),
        "proc/device-tree/serial-number": b"1421622012345\0",
        "proc/sys/kernel/osrelease": b"5.15.136-tegra\n",
        "proc/meminfo": _meminfo(30_536_340, 24_000_000, 805_068),
        "etc/nv_tegra_release": (
            b"# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, "
            b"DATE: Mon May  6 17:34:21 UTC 2024\n"
        ),
        "sys/kernel/debug/bpmp/debug/clk/emc/rate": b"3199000000\n",
        "sys/kernel/actmon_avg_activity/mc_all": b"0\n",
    }
    links = {
        **_devfreq_links(dev, "gpu", dev_dir),
        **_ina_links("ina3221", ["1-0040", "1-0041"]),
        **zlinks,
    }
    signals = (
        Signal(f"{dev_dir}/load", LOAD_S, 450, 50),
        Signal(f"{hw}/1-0040/hwmon/hwmon3/in1_input", 0, 4992),
        Signal(f"{hw}/1-0040/hwmon/hwmon3/curr1_input", INA_S, 620, 30, spike=3000, spike_step=100),
        Signal(f"{hw}/1-0040/hwmon/hwmon3/in2_input", 0, 4984),
        Signal(f"{hw}/1-0040/hwmon/hwmon3/curr2_input", INA_S, 900, 40),
        Signal(f"{hw}/1-0040/hwmon/hwmon3/in3_input", 0, 4976),
        Signal(f"{hw}/1-0040/hwmon/hwmon3/curr3_input", INA_S, 1000, 20),
        Signal(f"{hw}/1-0041/hwmon/hwmon4/in2_input", 0, 4984),
        Signal(f"{hw}/1-0041/hwmon/hwmon4/curr2_input", INA_S, 220, 10),
        Signal("sys/kernel/actmon_avg_activity/mc_all", EMC_S, 640_000, 100_000),
        Signal("sys/devices/virtual/thermal/thermal_zone1/temp", TEMP_S, 52_000, 300),
        Signal("sys/devices/virtual/thermal/thermal_zone0/temp", TEMP_S, 55_000, 300),
    )
    return Board("agx-orin-jp6", files, links, signals, "NVIDIA Jetson AGX Orin Developer Kit",
                 "L4T 36.3.0", dev, ("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0",
                 "VDDQ_VDD2_1V8AO"), "VDD_GPU_SOC", 4992, tuple(zone_types), "gpu-thermal",
                 emc=True, nvmap=True)  # fmt: skip


def orin_nano() -> Board:
    """Jetson Orin Nano developer kit, JetPack 5 (L4T r35.5): devfreq ``17000000.ga10b``.

    As on the real p3767, the tj-therm zone reads nothing; debugfs is not mounted (no EMC clock),
    and this kernel's /proc/meminfo has no NvMap lines.
    """
    dev, dev_dir = "17000000.ga10b", "sys/devices/platform/17000000.ga10b"
    hw = "sys/devices/platform/bus@0/c240000.i2c/i2c-1"
    zone_types = ["CPU-therm", "GPU-therm", "CV0-therm", "CV1-therm", "CV2-therm", "SOC0-therm",
                  "SOC1-therm", "SOC2-therm", "tj-therm"]  # fmt: skip
    zfiles, zlinks = _zones(zone_types)
    zfiles["sys/devices/virtual/thermal/thermal_zone8/temp"] = b""
    files = {
        **_devfreq(dev, "ga10b", dev_dir, dev_dir),
        **_hwmon("1-0040", "hwmon1", ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]),
        **zfiles,
        "proc/device-tree/model": b"NVIDIA Jetson Orin Nano Developer Kit\0",
        "proc/device-tree/compatible": (
            b"nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0"
        ),
        "proc/device-tree/serial-number": b"1424323054321\0",
        "proc/meminfo": _meminfo(7_619_500, 5_100_000, None),
        "etc/nv_tegra_release": (
            b"# R35 (release), REVISION: 5.0, GCID: 35550185, BOARD: t186ref, EABI: aarch64, "
            b"DATE: Tue Feb 20 04:46:31 UTC 2024\n"
        ),
        "sys/kernel/actmon_avg_activity/mc_all": b"0\n",
    }
    links = {**_devfreq_links(dev, "ga10b", dev_dir), **_ina_links("ina3221", ["1-0040"]), **zlinks}
    signals = (
        Signal(f"{dev_dir}/load", LOAD_S, 300, 60),
        Signal(f"{hw}/1-0040/hwmon/hwmon1/in1_input", 0, 5032),
        Signal(f"{hw}/1-0040/hwmon/hwmon1/curr1_input", INA_S, 1200, 50),
        Signal(f"{hw}/1-0040/hwmon/hwmon1/in2_input", 0, 5024),
        Signal(f"{hw}/1-0040/hwmon/hwmon1/curr2_input", INA_S, 500, 30, spike=2000, spike_step=50),
        Signal(f"{hw}/1-0040/hwmon/hwmon1/in3_input", 0, 5016),
        Signal(f"{hw}/1-0040/hwmon/hwmon1/curr3_input", INA_S, 300, 20),
        Signal("sys/devices/virtual/thermal/thermal_zone1/temp", TEMP_S, 47_000, 300),
    )
    return Board("orin-nano-jp5", files, links, signals, "NVIDIA Jetson Orin Nano Developer Kit",
                 "L4T 35.5.0", dev, ("VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"), "VDD_CPU_GPU_CV",
                 5024, tuple(zone_types), "GPU-therm", emc=False, nvmap=False,
                 unreadable=("tj-therm temperature",))  # fmt: skip


def xavier_nx() -> Board:
    """Jetson Xavier NX developer kit, JetPack 4 (L4T r32.7): ``ina3221x`` under iio, rails by
    ``rail_name_<N>`` with ``in_power<N>_input`` in mW, devfreq ``17000000.gv11b``; the GPU load
    under ``/sys/devices/gpu.0`` as on the boards before it."""
    dev, dev_dir = "17000000.gv11b", "sys/devices/17000000.gv11b"
    iio = "sys/devices/3160000.i2c/i2c-0/7-0040/iio:device0"
    zone_types = ["CPU-therm", "GPU-therm", "AUX-therm", "AO-therm", "PMIC-Die",
                  "thermal-fan-est"]  # fmt: skip
    zfiles, zlinks = _zones(zone_types)
    zfiles["sys/devices/virtual/thermal/thermal_zone4/temp"] = b"100000\n"  # PMIC-Die: fixed
    rails = {"VDD_IN": (5040, 2500), "VDD_CPU_GPU_CV": (5032, 700), "VDD_SOC": (5024, 450)}
    files = {
        **_devfreq(dev, "gv11b", dev_dir, None),
        "sys/devices/gpu.0/load": b"0\n",
        **zfiles,
        f"{iio}/name": b"ina3221x\n",
        f"{iio}/running_mode": b"0\n",
        "proc/device-tree/model": b"NVIDIA Jetson Xavier NX Developer Kit\0",
        "proc/device-tree/compatible": (
            b"nvidia,p3509-0000+p3668-0000\0nvidia,p3668-0000\0nvidia,tegra194\0"
        ),
        "proc/device-tree/serial-number": b"1422919087654\0",
        "proc/meminfo": _meminfo(7_772_572, 4_900_000, 401_200),
        "etc/nv_tegra_release": (
            b"# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t186ref, EABI: aarch64, "
            b"DATE: Sat Feb 19 17:05:08 UTC 2022\n"
        ),
        "sys/kernel/debug/clk/emc/clk_rate": b"1600000000\n",
        "sys/kernel/actmon_avg_activity/mc_all": b"0\n",
    }
    signals: list[Signal] = [Signal("sys/devices/gpu.0/load", LOAD_S, 600, 80)]
    for n, (label, (mv, ma)) in enumerate(rails.items()):
        files[f"{iio}/rail_name_{n}"] = label.encode() + b"\n"
        files[f"{iio}/in_voltage{n}_input"] = f"{mv}\n".encode()
        files[f"{iio}/crit_current_limit_{n}"] = b"32760\n"
        spike = 3500 if label == "VDD_CPU_GPU_CV" else None
        signals.append(Signal(f"{iio}/in_current{n}_input", INA_S, ma, 20, spike, 100))
        # the driver's power is its own voltage x current: the spike shows there too
        signals.append(Signal(f"{iio}/in_power{n}_input", INA_S, mv * ma // 1000, 100,
                              mv * spike // 1000 if spike else None, mv * 100 // 1000))  # fmt: skip
    signals += [
        Signal("sys/kernel/actmon_avg_activity/mc_all", EMC_S, 480_000, 80_000),
        Signal("sys/devices/virtual/thermal/thermal_zone1/temp", TEMP_S, 44_500, 300),
    ]
    links = {
        **_devfreq_links(dev, "gv11b", dev_dir),
        "sys/bus/i2c/drivers/ina3221x/7-0040": "../../../../devices/3160000.i2c/i2c-0/7-0040",
        **zlinks,
    }
    return Board("xavier-nx-jp4", files, links, tuple(signals),
                 "NVIDIA Jetson Xavier NX Developer Kit", "L4T 32.7.1", dev, tuple(rails),
                 "VDD_CPU_GPU_CV", 5032, tuple(zone_types), "GPU-therm", emc=True,
                 nvmap=True)  # fmt: skip


BOARDS = {b.name: b for b in (agx_orin(), orin_nano(), xavier_nx())}


def build(board: Board, root: Path) -> Path:
    """Write ``board``'s tree under ``root`` (created) and return ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in board.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for s in board.signals:
        path = root / s.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_fixed(s.value(0, 0)))
    for rel, target in sorted(board.links.items(), key=lambda kv: kv[0].count("/")):
        link = root / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
        assert link.resolve().is_relative_to(root.resolve()), (rel, target)
        assert link.exists(), (rel, target)
    return root


def _fixed(value: int) -> bytes:
    return f"{value:>{WIDTH}d}\n".encode()


@dataclass(frozen=True)
class Spike:
    """One planted spike: on the files over [on_ns, off_ns) wall clock, with these values."""

    on_ns: int
    off_ns: int
    values: dict[str, int]  # signal path -> value


@dataclass
class TreeWriter:
    """Rewrites a built tree's signals as the clock moves, on a thread, until stopped."""

    board: Board
    root: Path
    spikes: list[Spike] = field(default_factory=list)
    writes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeWriter:
        self._thread = threading.Thread(target=self._run, name="jetson-tree", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        sig = self.board.signals
        fds = [os.open(self.root / s.path, os.O_WRONLY) for s in sig]
        spiky = [k for k, s in enumerate(sig) if s.spike is not None]
        last = [-1] * len(sig)
        spike_k = 0
        spike_on: int | None = None  # monotonic ns the current spike went up
        spike_wall = 0
        next_spike = _next_spike_wall(time.time_ns())
        t0 = time.monotonic_ns()
        try:
            while not self._stop.is_set():
                now = time.monotonic_ns()
                wall = time.time_ns()
                if spike_on is None and wall >= next_spike:
                    values = {}
                    for k in spiky:
                        s = sig[k]
                        assert s.spike is not None
                        values[s.path] = s.spike + spike_k * s.spike_step
                        os.pwrite(fds[k], _fixed(values[s.path]), 0)
                    spike_on, spike_wall = now, time.time_ns()
                    continue
                if spike_on is not None and now - spike_on >= SPIKE_HOLD_S * 1e9:
                    self.spikes.append(Spike(spike_wall, time.time_ns(), values))
                    spike_on, spike_k = None, spike_k + 1
                    next_spike = _next_spike_wall(wall)
                    last = [-1] * len(sig)  # back to the signal at once
                nearest = 10_000_000
                for k, s in enumerate(sig):
                    if s.period_s <= 0 or (spike_on is not None and k in spiky):
                        continue
                    period = int(s.period_s * 1e9)
                    bucket = (now - t0) // period
                    if bucket != last[k]:
                        os.pwrite(fds[k], _fixed(s.value(bucket, k)), 0)
                        self.writes += 1
                        last[k] = bucket
                    nearest = min(nearest, t0 + (bucket + 1) * period - now)
                time.sleep(max(nearest, 200_000) / 1e9)
        finally:
            for fd in fds:
                os.close(fd)


def _next_spike_wall(wall_ns: int) -> int:
    second = wall_ns // 1_000_000_000
    at = second * 1_000_000_000 + int(SPIKE_OFFSET_S * 1e9)
    return at if at > wall_ns else at + 1_000_000_000


@contextmanager
def running(board: Board, root: Path) -> Iterator[TreeWriter]:
    """Build ``board`` under ``root`` and keep its signals moving while the block runs."""
    build(board, root)
    writer = TreeWriter(board, root).start()
    try:
        yield writer
    finally:
        writer.stop()

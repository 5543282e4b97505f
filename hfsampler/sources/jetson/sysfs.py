"""Where a Jetson keeps its numbers: find them in sysfs, procfs and /etc, never assume one board.

``find_layout(root)`` walks the tree once and returns a ``Layout``: the devfreq GPU node (its load,
clocks and runtime-PM state), the INA3221 power rails (JetPack 5+'s hwmon channels or JetPack 4's
iio rails), the thermal zones, the memory controller's (EMC) clock and activity, /proc/meminfo, and
what labels the GPU (model, L4T release, a stable identifier). Each thing it looks for and does not
find is one line in ``Layout.notes``, with the fields it costs: the source logs the lines that
concern the fields it was asked for (so the sampler process, asked only for what discovery kept,
does not repeat them). Nothing here reads on the hot path.

Paths are relative to ``root`` (``/`` on a Jetson; a fixture tree in tests), and every symlink it
follows must stay inside ``root``, as sysfs's relative links do. Every probe of a path goes through
``_kind``, ``_entries`` or ``_text``, which turn any ``OSError`` into an answer: a non-root user
gets EACCES from debugfs, which ``Path.is_file()`` raises before Python 3.14.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# a devfreq node's device/of_node/name: NVIDIA's integrated GPUs', and JetPack 6's plain "gpu",
# which Mali and Adreno GPUs are named too, so it counts only where the device tree says Tegra
NVIDIA_GPU_NODES = ("gv11b", "gp10b", "ga10b", "gb10b")
GPU_NODE_NAMES = (*NVIDIA_GPU_NODES, "gpu")
TEGRA = "nvidia,tegra"  # in /proc/device-tree/compatible: nvidia,tegra194, nvidia,tegra234...
GPU_ZONE_TYPES = ("gpu-therm", "gpu-thermal")
INA_DRIVERS = ("ina3221", "ina3221x")  # JetPack 5+ (hwmon) and JetPack 4 (iio)
# JetPack 4's ina3221x declares no conversion cycle: the chip's power-on default, 3 channels x
# 1 sample x (1.1 ms bus + 1.1 ms shunt conversion)
JP4_INA_CYCLE_S = 0.0066
INA_CHANNELS = (1, 2, 3)  # hwmon's in4-in7 are shunt voltages and their sum, curr4 the sum
NOT_CONNECTED = "NC"
# the tokens of a rail name that say nothing about what it feeds
_RAIL_NOISE = frozenset({"VDD", "VIN", "POM", "SYS", "IN", "5V", "5V0", "1V8", "3V3"})
_EMC_RATE = ("sys/kernel/debug/bpmp/debug/clk/emc/rate", "sys/kernel/debug/clk/emc/clk_rate")
_EMC_ACTIVITY = ("sys/kernel/actmon_avg_activity/mc_all",)
_GPU_KEYS = ("gpu_load", "gpu_freq", "gpu_min_freq", "gpu_max_freq", "gpu_railgated")
_RAIL_KEYS = ("rail_power", "rail_voltage", "rail_current", "gpu_rail_power", "gpu_rail_energy")
_IN_LABEL = re.compile(r"in\d+_label")
_L4T_RE = re.compile(rb"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)")


@dataclass(frozen=True, slots=True)
class Rail:
    """One INA3221 channel: JetPack 5+ gives voltage (mV) and current (mA), JetPack 4 also power."""

    name: str
    voltage: Path | None  # mV
    current: Path | None  # mA
    power: Path | None  # mW (JetPack 4's in_power*_input); else voltage x current
    # the chip's conversion time x averaging x channels (JetPack 4: the chip's defaults)
    update_interval_s: float | None

    def has(self, what: str) -> bool:
        """Whether the rail can give ``what`` (rail_voltage, rail_current or rail_power)."""
        if what == "rail_voltage":
            return self.voltage is not None
        if what == "rail_current":
            return self.current is not None
        return self.power is not None or (self.voltage is not None and self.current is not None)


@dataclass(frozen=True, slots=True)
class Zone:
    name: str  # the zone's type, e.g. GPU-therm
    temp: Path  # millidegrees Celsius


@dataclass(slots=True)
class Layout:
    """Every path the jetson source reads, and what labels the GPU."""

    root: Path
    gpu_node: str | None = None  # of_node name: ga10b, gv11b, gpu...
    gpu_device: str | None = None  # the GPU's platform device, e.g. 17000000.ga10b
    load: Path | None = None  # per-mille
    cur_freq: Path | None = None  # Hz
    min_freq: Path | None = None
    max_freq: Path | None = None
    polling_interval_s: float | None = None  # the devfreq governor's
    runtime_status: Path | None = None  # "active" / "suspended"
    rails: tuple[Rail, ...] = ()
    gpu_rail: str | None = None
    zones: tuple[Zone, ...] = ()
    gpu_zone: str | None = None
    emc_rate: Path | None = None  # Hz
    emc_activity: Path | None = None  # actmon's mc_all
    meminfo: Path | None = None
    model: str = "NVIDIA Jetson"
    l4t: str = "unknown"
    identity: str = ""  # what the GPU's UUID is derived from
    # one line per thing not found, and the jetson keys of the fields it costs (none: all)
    notes: list[tuple[str, frozenset[str]]] = field(default_factory=list)

    def note(self, text: str, *keys: str) -> None:
        self.notes.append((text, frozenset(keys)))

    @property
    def uuid(self) -> str:
        """A stable ``GPU-...`` identifier: NVML has none for an integrated GPU (docs/jetson.md)."""
        key = f"hfsampler-jetson/{self.identity}/{self.gpu_device or self.gpu_node or 'gpu'}"
        return f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, key)}"


def _kind(path: Path) -> str | None:
    """None for a regular file (as every sysfs attribute is), else why not, for a note."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return "missing"
        return "permission denied" if exc.errno == errno.EACCES else f"unreadable ({exc.strerror})"
    except ValueError:  # a NUL in the path
        return "missing"
    return None if stat.S_ISREG(mode) else "not a regular file"


def _is_file(path: Path) -> bool:
    return _kind(path) is None


def _entries(path: Path) -> list[str]:
    """A directory's entries, sorted; none where it cannot be listed."""
    try:
        return sorted(os.listdir(path))
    except (OSError, ValueError):
        return []


def _text(path: Path) -> str | None:
    """A small sysfs or device-tree file's text, without NULs and surrounding space."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # a FIFO would block a plain read, a directory fails it
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.replace(b"\0", b" ").decode("utf-8", "replace").strip() or None


def _inside(root: Path, path: Path) -> Path | None:
    """``path`` resolved, if it stays inside ``root`` (a fixture must not reach the real /sys)."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, on older Pythons
        return None
    return real if real == root or root in real.parents else None


def _ms(path: Path) -> float | None:
    text = _text(path)
    try:
        return int(text) / 1000.0 if text is not None and int(text) > 0 else None
    except ValueError:
        return None


def _tegra_compatible(base: Path) -> bool:
    return any(
        TEGRA in (_text(base / rel) or "")
        for rel in ("proc/device-tree/compatible", "sys/firmware/devicetree/base/compatible")
    )


def is_tegra(root: str | Path = "/") -> bool:
    """A Tegra (Jetson): the device tree is compatible with ``nvidia,tegra*``, or a devfreq node
    is one of NVIDIA's integrated GPUs by name. A node named ``gpu`` alone is any ARM board's."""
    base = Path(root).resolve()
    return _tegra_compatible(base) or _find_gpu(base, Layout(base), tegra=False) is not None


def find_layout(root: str | Path = "/") -> Layout:
    """Walk ``root`` once for everything the jetson source reads."""
    base = Path(root).resolve()
    lay = Layout(base)
    tegra = _tegra_compatible(base)
    gpu = _find_gpu(base, lay, tegra)
    if gpu is None:
        names = ", ".join(NVIDIA_GPU_NODES) + (", gpu" if tegra else f" (gpu: on a {TEGRA}* only)")
        lay.note(
            f"no devfreq GPU node (sys/class/devfreq/*/device/of_node/name one of {names}): "
            "GPU load and clocks skipped",
            *_GPU_KEYS,
        )
    _find_rails(base, lay)
    _find_zones(base, lay)
    lay.emc_rate = next((p for r in _EMC_RATE if _is_file(p := base / r)), None)
    lay.emc_activity = next((p for r in _EMC_ACTIVITY if _is_file(p := base / r)), None)
    if lay.emc_rate is None:
        denied = [r for r in _EMC_RATE if _kind(base / r) == "permission denied"]
        where = (
            f"{denied[0]}: permission denied (debugfs is root only)"
            if denied
            else " or ".join(_EMC_RATE) + ", debugfs: root only"
        )
        lay.note(
            f"no EMC clock ({where}): DCGM_FI_DEV_MEM_CLOCK and MEM_COPY_UTIL skipped",
            "emc_freq",
            "emc_load",
        )
    elif lay.emc_activity is None:
        lay.note(f"no EMC activity ({_EMC_ACTIVITY[0]}): DCGM_FI_DEV_MEM_COPY_UTIL skipped",
                 "emc_load")  # fmt: skip
    meminfo = base / "proc/meminfo"
    lay.meminfo = meminfo if _is_file(meminfo) else None
    if lay.meminfo is None:
        lay.note(
            "no proc/meminfo: memory fields skipped", "mem_used", "mem_available", "nvmap_used"
        )
    _identify(base, lay)
    return lay


def _find_gpu(base: Path, lay: Layout, tegra: bool) -> Path | None:
    """The devfreq node of the integrated GPU; fills the GPU's paths into ``lay``. A node named
    ``gpu`` counts only when ``tegra`` (the device tree says so)."""
    devfreq = base / "sys/class/devfreq"
    for entry in _entries(devfreq):
        node = _text(devfreq / entry / "device/of_node/name")
        if node not in (GPU_NODE_NAMES if tegra else NVIDIA_GPU_NODES):
            continue
        freq_dir = _inside(base, devfreq / entry)
        dev_dir = _inside(base, devfreq / entry / "device")
        if freq_dir is None or dev_dir is None:
            continue
        lay.gpu_node = node
        lay.gpu_device = dev_dir.name
        rel = f"sys/class/devfreq/{entry}"
        for name in ("cur_freq", "min_freq", "max_freq"):
            path = freq_dir / name
            setattr(lay, name, path if _is_file(path) else None)
            if getattr(lay, name) is None:
                lay.note(f"no {rel}/{name}: skipped", "gpu_" + name.replace("cur_", ""))
        lay.polling_interval_s = _ms(freq_dir / "polling_interval")
        load = dev_dir / "load"
        old = base / "sys/devices/gpu.0/load"  # older boards (Nano, TX2) keep it here
        lay.load = load if _is_file(load) else (old if _is_file(old) else None)
        if lay.load is None:
            lay.note(
                f"no {rel}/device/load nor sys/devices/gpu.0/load: GPU load skipped", "gpu_load"
            )
        status = dev_dir / "power/runtime_status"
        lay.runtime_status = status if _is_file(status) else None
        if lay.runtime_status is None:
            lay.note(f"no {rel}/device/power/runtime_status: rail-gate state skipped",
                     "gpu_railgated")  # fmt: skip
        return freq_dir
    return None


def _find_rails(base: Path, lay: Layout) -> None:
    rails: list[Rail] = []
    seen: set[str] = set()
    for driver in INA_DRIVERS:
        top = base / "sys/bus/i2c/drivers" / driver
        for chip in (e for e in _entries(top) if re.fullmatch(r"\d+-[0-9a-fA-F]{4}", e)):
            chip_dir = _inside(base, top / chip)
            if chip_dir is None:
                continue
            rel = f"sys/bus/i2c/drivers/{driver}/{chip}"
            for rail in (*_hwmon_rails(chip_dir, rel, lay), *_iio_rails(chip_dir, rel, lay)):
                name = rail.name if rail.name not in seen else f"{rail.name}@{chip}"
                seen.add(name)
                rails.append(Rail(name, rail.voltage, rail.current, rail.power,
                                  rail.update_interval_s))  # fmt: skip
    lay.rails = tuple(rails)
    if not rails:
        lay.note(
            "no INA3221 rail (sys/bus/i2c/drivers/ina3221 or ina3221x): power fields skipped",
            *_RAIL_KEYS,
        )
        return
    lay.gpu_rail = gpu_rail([r.name for r in rails])
    if lay.gpu_rail is None:
        lay.note(
            "no rail feeds the GPU (none named *GPU*): DCGM_FI_DEV_POWER_USAGE_INSTANT skipped",
            "gpu_rail_power",
            "gpu_rail_energy",
        )
    elif not next(r for r in rails if r.name == lay.gpu_rail).has("rail_power"):
        lay.note(
            f"the GPU rail {lay.gpu_rail} has no power reading (needs its power, or its voltage "
            "and current): DCGM_FI_DEV_POWER_USAGE_INSTANT and TOTAL_ENERGY_CONSUMPTION skipped",
            "gpu_rail_power",
            "gpu_rail_energy",
        )


def _skip_channel(label: str) -> bool:
    return label.upper() == NOT_CONNECTED or "sum" in label.lower()


def _hwmon_rails(chip: Path, rel: str, lay: Layout) -> list[Rail]:
    """JetPack 5+: hwmon/hwmon*/in<N>_label, in<N>_input (mV), curr<N>_input (mA), N = 1-3."""
    out = []
    for entry in (e for e in _entries(chip / "hwmon") if re.fullmatch(r"hwmon\d+", e)):
        hwmon, where = chip / "hwmon" / entry, f"{rel}/hwmon/{entry}"
        interval = _ms(hwmon / "update_interval")
        names = set(_entries(hwmon))
        for n in INA_CHANNELS:
            if not {f"in{n}_label", f"in{n}_input", f"curr{n}_input"} & names:
                continue  # no such channel on this chip
            label = _text(hwmon / f"in{n}_label")
            if label is None:
                why = _kind(hwmon / f"in{n}_label") or "empty"
                lay.note(f"INA3221 channel {n} ({where}): in{n}_label {why}: its rail skipped",
                         *_RAIL_KEYS)  # fmt: skip
            elif not _skip_channel(label):  # NC, or the sum of shunt voltages
                paths = (hwmon / f"in{n}_input", hwmon / f"curr{n}_input", None)
                rail = _rail(label, where, paths, interval, lay)
                out += [rail] if rail else []
    return out


def _iio_rails(chip: Path, rel: str, lay: Layout) -> list[Rail]:
    """JetPack 4: iio:device*/rail_name_<N>, in_power<N>_input (mW), in_voltage / in_current."""
    out = []
    for entry in (e for e in _entries(chip) if e.startswith("iio:device")):
        iio, where = chip / entry, f"{rel}/{entry}"
        for name in (e for e in _entries(iio) if e.startswith("rail_name_")):
            n = name.removeprefix("rail_name_")
            label = _text(iio / name)
            if label is None or _skip_channel(label):
                continue
            v, i, p = (iio / f"in_{what}{n}_input" for what in ("voltage", "current", "power"))
            rail = _rail(label, where, (v, i, p), JP4_INA_CYCLE_S, lay)
            out += [rail] if rail else []
    return out


def _rail(label: str, where: str, paths: tuple[Path, Path, Path | None], interval: float | None,
          lay: Layout) -> Rail | None:  # fmt: skip
    """The rail from those of its files that are regular files; one note for the others."""
    found: list[Path | None] = []
    bad = []
    for path in paths:
        why = None if path is None else _kind(path)
        found.append(path if why is None else None)
        if path is not None and why is not None:
            bad.append(f"{path.name} {why}")
    rail = Rail(label, found[0], found[1], found[2], interval)
    if bad:
        lost = [what for what in ("voltage", "current", "power") if not rail.has(f"rail_{what}")]
        costs = [f"rail_{what}" for what in lost] or ["rail_power"]
        cost = ", ".join(lost) if lost else "nothing (power from voltage x current)"
        lay.note(f"rail {label} ({where}): {', '.join(bad)}: {cost} skipped", *costs)
    return rail if any(found) else None


def gpu_rail(names: list[str]) -> str | None:
    """The rail that feeds the GPU: one named for the GPU alone if the board has it, else the
    GPU's shared rail with the fewest other loads (VDD_GPU_SOC before VDD_CPU_GPU_CV)."""
    best: tuple[int, int, str] | None = None
    for k, name in enumerate(names):
        tokens = set(re.split(r"[_\s-]+", name.upper())) - _RAIL_NOISE
        if "GPU" not in tokens:
            continue
        rank = (len(tokens), k, name)
        if best is None or rank < best:
            best = rank
    return best[2] if best else None


def _find_zones(base: Path, lay: Layout) -> None:
    zones: list[Zone] = []
    seen: set[str] = set()
    for top in (base / "sys/class/thermal", base / "sys/devices/virtual/thermal"):
        entries = sorted(
            (e for e in _entries(top) if re.fullmatch(r"thermal_zone\d+", e)),
            key=lambda e: int(e.removeprefix("thermal_zone")),
        )
        for entry in entries:
            zone_dir = _inside(base, top / entry)
            name = _text(top / entry / "type")
            temp = top / entry / "temp"
            if zone_dir is None:
                continue
            why = "no type" if name is None else _kind(temp)
            if name is None or why is not None:
                rel = f"{top.relative_to(base)}/{entry}"
                gpu = name is not None and name.lower() in GPU_ZONE_TYPES
                lay.note(f"thermal zone {name or entry} ({rel}/temp): {why}: skipped",
                         "zone_temp", *(("gpu_temp",) if gpu else ()))  # fmt: skip
                continue
            name = name if name not in seen else f"{name}@{entry}"
            seen.add(name)
            zones.append(Zone(name, temp))
        if entries:
            break  # sys/class/thermal links to the same zones: one pass only
    lay.zones = tuple(zones)
    if not zones:
        lay.note("no thermal zone (sys/class/thermal/thermal_zone*): temperatures skipped",
                 "zone_temp", "gpu_temp")  # fmt: skip
        return
    lay.gpu_zone = next((z.name for z in zones if z.name.lower() in GPU_ZONE_TYPES), None)
    if lay.gpu_zone is None:
        lay.note(
            "no GPU thermal zone (type GPU-therm or gpu-thermal): DCGM_FI_DEV_GPU_TEMP skipped",
            "gpu_temp",
        )


def _identify(base: Path, lay: Layout) -> None:
    lay.model = _text(base / "proc/device-tree/model") or "NVIDIA Jetson"
    found = _L4T_RE.search((_text(base / "etc/nv_tegra_release") or "").encode())
    if found:
        lay.l4t = f"L4T {found.group(1).decode()}.{found.group(2).decode()}"
    else:
        kernel = _text(base / "proc/sys/kernel/osrelease")
        lay.l4t = f"kernel {kernel}" if kernel else "unknown"
        lay.note(f"no etc/nv_tegra_release: the driver-version label is {lay.l4t!r}")
    for source in ("proc/device-tree/serial-number", "sys/devices/soc0/serial_number",
                   "etc/machine-id"):  # fmt: skip
        text = _text(base / source)
        if text:
            lay.identity = f"{source}:{text}"
            return
    lay.identity = f"model:{lay.model}"
    lay.note("no serial number or machine-id: the GPU's UUID derives from the model only")

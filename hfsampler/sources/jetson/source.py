"""The ``jetson`` source: a Jetson's integrated GPU, rails and thermal zones, read from sysfs.

Before Thor a Jetson has no NVML; tegrastats and jtop read the same numbers from sysfs every
0.5-1 s. This source finds the files (``jetson_sysfs.find_layout``), opens each once, and reads it
with ``os.pread`` at offset 0 on every tick (sysfs and procfs regenerate the text on each read at
offset 0; an open descriptor saves the path walk and the open/close of every read).

At open it measures each file's true refresh period: it reads them all back to back for
``measure_s`` and takes the median gap between value changes, as ``hfsampler probe`` does for NVML
(an INA3221 channel refreshes every conversion time x averaging x channels, the GPU load when the
PMU updates it). Where nothing changed, the period a driver declares (the INA3221's
``update_interval``, devfreq's ``polling_interval``) stands in, else one second. A reading is a
distinct sample when its value changed or a whole period has passed since the last one, so
repeats stay out of the window statistics (the sampler drops a reading whose timestamp did not
move). Files are read on every tick of the groups that ask for them, except an INA3221 rail: an
I2C transaction, re-read only once half the chip's conversion cycle has passed (its
``update_interval`` on JetPack 5+, the chip's default 6.6 ms on JetPack 4, which declares none),
as nothing newer can be there sooner. A measured period never slows reading: a signal quiet
during the measurement may not be later. The GPU rail's power is integrated into an energy
counter (``jetson_energy``), from every reading of the rail whichever group asks.

A file the layout does not find costs one log line and its fields, never the source. One that
cannot be read at open, or fails later, costs one line and reads as no sample until it reads
again: a parse error is retried on every read, a failed open once a second; about once a second,
on a slow group's read, every path's inode is checked too, so a file replaced (by a rename, a
driver rebound) is reopened rather than read stale.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, DeviceInfo, FloatArray, IntArray, Inventory
from hfsampler.sources.jetson.energy import Energy
from hfsampler.sources.jetson.files import (
    ANY,
    DEAD,
    DIFF,
    MAX_W,
    MILLI_C,
    MILLI_W,
    MIN_SKIP_NS,
    NAN,
    NOT_NEGATIVE,
    ONE,
    PRODUCT,
    RATIO,
    UNKNOWN_PERIOD_NS,
    Blob,
    Bounds,
    File,
    Parse,
    Value,
    meminfo_kib,
    parse_int,
    parse_runtime_status,
)
from hfsampler.sources.jetson.sysfs import Layout, Rail, find_layout

log = logging.getLogger(__name__)

MEASURE_S = 0.5  # how long open() watches the files for their refresh periods
MEASURE_PAUSE_S = 0.0005
CHECK_NS = 1_000_000_000  # how often files are checked for replacement and reopened
SLOW_READ_NS = 20_000_000  # a read this long after its group's previous one is a slow group's


@dataclass(slots=True)
class _Plan:
    files: tuple[File, ...]  # polled each read, each once
    cols: tuple[Value | None, ...]  # None: the energy counter
    feeds_energy: bool  # it polls the GPU rail: each read integrates the energy counter
    last_ns: int = 0  # the previous read of this plan: far back, a slow group's


class JetsonSource:
    """The ``Source`` over a Jetson's sysfs: one GPU, ``gpu="0"``."""

    def __init__(
        self, root: str | Path = "/", measure_s: float = MEASURE_S, *, reopened: bool = False
    ) -> None:
        """``reopened``: the sampler process's open, after discovery's (``SourceSpec.reopened``),
        which logged what open finds; this one logs only what happens while reading."""
        self.root = Path(root)
        self.measure_s = measure_s
        self._say_open = log.debug if reopened else log.warning
        self._tell_open = log.debug if reopened else log.info
        self.layout: Layout | None = None
        self._blobs: dict[Path, Blob] = {}
        self._files: dict[tuple[Path, str], File] = {}
        self._lacking: set[tuple[Path, str]] = set()  # a value its file does not have
        self._checked_ns = 0  # when the files were last checked (_check)
        self._recipes: dict[Field, Value | None] = {}
        self._rail_values: dict[tuple[str, str], Value | None] = {}
        self._energy: Energy | None = None
        self._rail_read_by_fields = False  # a selected field reads the GPU rail (the power)
        self._lock = threading.Lock()
        self._up = np.ones(1, dtype=np.bool_)
        self._devices: tuple[DeviceInfo, ...] = ()
        self._plans: dict[int, tuple[Sequence[Field], _Plan]] = {}

    # -- the Source protocol ---------------------------------------------------------------------

    def open(self, fields: Sequence[Field]) -> Inventory:
        self.close()
        lay = find_layout(self.root)
        self.layout = lay
        keys = {f.jetson for f in fields}
        for note, costs in lay.notes:
            if not costs or costs & keys:
                self._say_open("jetson: %s", note)
        wanted = self._expand(tuple(fields), lay)
        # a MIG instance twin (fields.expand_mig) is NVML's: a Jetson has no MIG
        supported = [self._recipe(f, lay) is not None and not f.mig_instance for f in wanted]
        rail = {id(part) for part in self._energy.files} if self._energy is not None else set()
        self._rail_read_by_fields = any(
            rail & {id(part) for part in recipe.files}
            for f in wanted
            if f.jetson != "gpu_rail_energy" and (recipe := self._recipes.get(f)) is not None
        )
        self._measure()
        info = DeviceInfo(
            index=0,
            uuid=lay.uuid,
            model_name=lay.model,
            pci_bus_id=lay.gpu_device or "tegra-igpu",
            driver_version=lay.l4t,
            minor_number=0,
        )
        self._devices = (info,)
        return Inventory((info,), wanted, np.array([supported], dtype=np.bool_))

    def read(
        self, fields: Sequence[Field], values: FloatArray, driver_ts_us: IntArray, now_ns: int
    ) -> None:
        cached = self._plans.get(id(fields))
        if cached is not None and cached[0] is fields:
            plan = cached[1]
        else:
            plan = self._plan(fields)
            if isinstance(fields, tuple) and len(self._plans) < 64:
                self._plans[id(fields)] = (fields, plan)
        # No lock across the file reads: the lanes read at once, each file behind its own lock
        # (Blob), so a slow sensor on the slow lane never holds up a fast tick.
        for f in plan.files:
            f.poll(now_ns)
        since, plan.last_ns = now_ns - plan.last_ns, now_ns
        if not 0 <= now_ns - self._checked_ns < CHECK_NS:
            # due: on a slow group's read, never on a fast tick unless no slow one comes
            if not self._checked_ns:
                self._checked_ns = now_ns  # the first read: everything was just opened
            elif since >= SLOW_READ_NS or not 0 <= now_ns - self._checked_ns < 2 * CHECK_NS:
                self._check(now_ns)
        energy = self._energy
        if energy is not None and plan.feeds_energy:
            with self._lock:  # the integral only (no file is read under it): any lane, the helper
                energy.update()
                energy.watch()
        row, stamps = values[0], driver_ts_us[0]
        for k, recipe in enumerate(plan.cols):
            if recipe is None:
                if energy is None or not energy.last_ns:
                    row[k], stamps[k] = NAN, 0
                else:
                    row[k], stamps[k] = energy.total_mj, energy.last_ns // 1000
                continue
            value, ts = recipe.evaluate()
            row[k], stamps[k] = value, ts // 1000

    @property
    def gpu_up(self) -> BoolArray:
        return self._up

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._devices

    def close(self) -> None:
        if self._energy is not None:
            self._energy.stop()
        for blob in self._blobs.values():
            blob.close()
        self._blobs.clear()
        self._files.clear()
        self._lacking.clear()
        self._checked_ns = 0
        self._recipes.clear()
        self._rail_values.clear()
        self._plans.clear()
        self._energy = None
        self._rail_read_by_fields = False

    @property
    def files(self) -> tuple[File, ...]:
        """Every file the opened fields read, with its measured period (for logs and tests)."""
        return tuple(self._files.values())

    def files_for(self, fields: Sequence[Field]) -> tuple[File, ...]:
        """The files one read of ``fields`` polls (a group's tick), each once."""
        return self._plan(fields).files

    # -- open: fields, files, periods ------------------------------------------------------------

    @staticmethod
    def _expand(fields: tuple[Field, ...], lay: Layout) -> tuple[Field, ...]:
        """Per-instance fields asked for without labels become one field per rail or zone."""
        out: list[Field] = []
        for f in fields:
            if f.per is None or f.labels or f.jetson is None:
                out.append(f)
            elif f.per == "rail":
                out.extend(f.instance(r.name) for r in lay.rails if r.has(f.jetson))
            elif f.per == "zone":
                out.extend(f.instance(z.name) for z in lay.zones)
        return tuple(out)

    def _file(self, what: str, path: Path | None, parse: Parse = parse_int, *,
              declared_s: float | None = None, hw_s: float | None = None, size: int = 64,
              optional: bool = False, bounds: Bounds = ANY) -> File | None:  # fmt: skip
        """The file, opened; None where the layout found none (it said so), or where the file
        lacks this value (``optional``: NvMapMemUsed in some kernels' meminfo; logged once).

        A file that cannot be opened or read now is kept, with one line, and its fields are NaN
        until it reads: a parse error is retried on every read, an open that failed once a
        second (``_check``). A zone empty at start may read two seconds later.
        """
        if path is None:
            return None
        key = (path, what)
        if key in self._lacking:
            return None
        if key in self._files:
            return self._files[key]
        blob = self._blobs.get(path)
        if blob is None:
            blob = self._blobs[path] = Blob(path, size)
            with contextlib.suppress(OSError):
                blob.open()
        f = File(what, blob, parse, declared_s, hw_s, bounds)
        try:
            f.decode(blob.read())
        except OSError as exc:
            f.fail(exc, "reopened once a second until it reads", self._say_open)
        except ValueError as exc:
            if optional:
                self._say_open("jetson: cannot read %s (%s): %s; skipped", what, path, exc)
                self._lacking.add(key)
                return None
            f.fail(exc, "retried on every read", self._say_open)
        self._files[key] = f
        return f

    def _rail_recipe(self, rail: Rail, what: str) -> Value | None:
        """One value per rail and quantity, shared by the fields that read it (the GPU rail's
        power, its energy, its per-rail series)."""
        key = (rail.name, what)
        if key not in self._rail_values:
            self._rail_values[key] = self._build_rail_recipe(rail, what)
        return self._rail_values[key]

    def _build_rail_recipe(self, rail: Rail, what: str) -> Value | None:
        """Opens only the files ``what`` needs: a field the discovery kept must not reopen (and
        log again) a file that failed for another field of the same rail."""

        def file(name: str, path: Path | None, bounds: Bounds = NOT_NEGATIVE) -> File | None:
            return self._file(f"{rail.name} {name}", path, hw_s=rail.update_interval_s,
                              bounds=bounds)  # fmt: skip

        if what == "rail_voltage":
            v = file("voltage", rail.voltage)
            return Value(ONE, v, None, 1e-3) if v else None
        if what == "rail_current":
            i = file("current", rail.current)
            return Value(ONE, i, None, 1e-3) if i else None
        if power := file("power", rail.power, MILLI_W):
            return Value(ONE, power, None, 1e-3)  # JetPack 4: mW
        v, i = file("voltage", rail.voltage), file("current", rail.current)
        if not (v and i):
            return None
        return Value(PRODUCT, i, v, 1e-6, hi=MAX_W, what=f"{rail.name} power (W)")  # mA x mV

    def _recipe(self, f: Field, lay: Layout) -> Value | None:
        if f in self._recipes:
            return self._recipes[f]
        recipe = self._build_recipe(f, lay)
        self._recipes[f] = recipe
        if f.jetson == "gpu_rail_energy" and recipe is not None:
            self._energy = Energy(recipe, self._lock)
        return recipe

    def _build_recipe(self, f: Field, lay: Layout) -> Value | None:
        key, own = f.jetson, dict(f.labels)
        if key is None:
            return None
        if key in ("rail_power", "rail_voltage", "rail_current"):
            rail = next((r for r in lay.rails if r.name == own.get("rail")), None)
            return self._rail_recipe(rail, key) if rail else None
        if key in ("gpu_rail_power", "gpu_rail_energy"):
            rail = next((r for r in lay.rails if r.name == lay.gpu_rail), None)
            return self._rail_recipe(rail, "rail_power") if rail else None
        if key in ("zone_temp", "gpu_temp"):
            name = own.get("zone") if key == "zone_temp" else lay.gpu_zone
            zone = next((z for z in lay.zones if z.name == name), None)
            t = self._file(f"{name} temperature", zone.temp, bounds=MILLI_C) if zone else None
            return Value(ONE, t, None, 1e-3) if t else None
        simple: dict[str, tuple[str, Path | None, Parse, float, float | None]] = {
            "gpu_load": ("GPU load", lay.load, parse_int, 0.1, None),
            "gpu_freq": ("GPU clock", lay.cur_freq, parse_int, 1e-6, lay.polling_interval_s),
            "gpu_min_freq": ("GPU min clock", lay.min_freq, parse_int, 1e-6, None),
            "gpu_max_freq": ("GPU max clock", lay.max_freq, parse_int, 1e-6, None),
            "gpu_railgated": ("GPU runtime PM", lay.runtime_status, parse_runtime_status, 1, None),
            "emc_freq": ("EMC clock", lay.emc_rate, parse_int, 1e-6, None),
        }
        if key in simple:
            what, path, parse, scale, declared = simple[key]
            one = self._file(what, path, parse, declared_s=declared)
            return Value(ONE, one, None, scale) if one else None
        if key == "emc_load":  # actmon's busy rate (kHz) over the EMC clock (kHz), in percent
            act = self._file("EMC activity", lay.emc_activity)
            rate = self._file("EMC clock", lay.emc_rate)
            return Value(RATIO, act, rate, 1e5) if act and rate else None
        mem = {"mem_used": "MemTotal", "mem_available": "MemAvailable",
               "nvmap_used": "NvMapMemUsed"}  # fmt: skip
        if key in mem:
            main = self._meminfo(lay, mem[key])
            if key != "mem_used":
                return Value(ONE, main, None, 1 / 1024) if main else None
            avail = self._meminfo(lay, "MemAvailable")
            return Value(DIFF, main, avail, 1 / 1024) if main and avail else None
        return None

    def _meminfo(self, lay: Layout, key: str) -> File | None:
        return self._file(key, lay.meminfo, meminfo_kib(key), size=16384, optional=True)

    def _measure(self) -> None:
        """Each file's refresh period: the median gap between value changes over ``measure_s``."""
        files = list(self._files.values())
        changes: list[list[int]] = [[] for _ in files]
        last = [NAN] * len(files)
        end = time.perf_counter_ns() + int(self.measure_s * 1e9)
        while (now := time.perf_counter_ns()) < end:
            for k, f in enumerate(files):
                try:
                    value = f.parse(f.blob.get(now))
                except (OSError, ValueError):
                    continue
                if value != last[k] and not math.isnan(last[k]):
                    changes[k].append(now)
                last[k] = value
            time.sleep(MEASURE_PAUSE_S)
        report: dict[tuple[float, str], list[str]] = {}
        for f, seen in zip(files, changes, strict=True):
            gaps = np.diff(np.asarray(seen, dtype=np.int64))
            measured = int(np.median(gaps)) if gaps.size >= 2 else 0
            declared = f.hw_ns or f.declared_ns
            if measured and declared:
                measured = min(measured, declared)  # runs of equal values read long
            f.period_ns = measured or declared or UNKNOWN_PERIOD_NS
            # Re-read after half a cycle only where a converter's own timer says nothing new can
            # come sooner: an INA3221 rail, whose every read is an I2C transfer. Anything else is
            # read on every tick of its group (a pread of sysfs is cheap): a period measured at
            # start on a quiet signal would read too seldom once it moves.
            known = min(measured, f.hw_ns) if measured else f.hw_ns
            f.skip_ns = known // 2 if known >= MIN_SKIP_NS else 0
            how = "measured" if measured else ("declared" if declared else "unchanged")
            report.setdefault((round(f.period_ns / 1e6, 1), how), []).append(f.what)
            f.read_ns, f.sample_ns, f.raw = -(1 << 62), 0, NAN
        for blob in self._blobs.values():
            blob.at_ns = -1
        if report:
            self._tell_open("jetson: refresh periods: %s", "; ".join(
                f"{ms:g} ms {how}: {', '.join(what)}" for (ms, how), what in sorted(report.items())
            ))  # fmt: skip

    def _check(self, now_ns: int) -> None:
        """Reopen the files that failed or were replaced, close those that are gone: a stat per
        file, about once a second (``Blob.check``)."""
        self._checked_ns = now_ns
        for blob in self._blobs.values():
            if blob.check():
                say = log.info if blob.replaced == 1 else log.debug
                say("jetson: %s was replaced (a new file at its path): reopened", blob.path)

    def _plan(self, fields: Sequence[Field]) -> _Plan:
        files: dict[int, File] = {}
        cols: list[Value | None] = []
        energy = self._energy
        for f in fields:
            if f.jetson == "gpu_rail_energy":
                cols.append(None)
                value = None
            else:
                value = self._recipes.get(f) or Value(ONE, DEAD, None, 1.0)  # unsupported: NaN
                cols.append(value)
            for part in value.files if value is not None else ():
                if part is not DEAD:
                    files[id(part)] = part
        # The GPU rail feeds the energy counter: read by the groups whose own fields read it
        # (the power, on the fast lane), or, when no selected field does, by every group's read.
        rail = {id(part) for part in energy.files} if energy is not None else set()
        feeds = bool(rail & files.keys())
        if energy is not None and not feeds and not self._rail_read_by_fields:
            for part in energy.files:
                files[id(part)] = part
            feeds = True
        return _Plan(tuple(files.values()), tuple(cols), feeds)

"""A scriptable fake of libnvidia-ml under the real ``pynvml`` module, for tests.

The fake replaces the C library, not pynvml: ``pynvml.nvmlLib`` becomes a ``FakeLib`` whose
attributes are the NVML C entry points (``nvmlDeviceGetFieldValues``, ``nvmlDeviceGetClockInfo``,
...), each taking the same ctypes arguments the real library does and returning an NVML return
code. So every pynvml wrapper runs unchanged (its real signature, its real ctypes structs, its real
``NVMLError`` subclasses raised for the codes the fake returns), and so does code that calls a
function pointer from ``pynvml._nvmlGetFunctionPointer`` directly. A C function the fake leaves out
(``FakeNvml.missing``) is ``NVML_ERROR_FUNCTION_NOT_FOUND``, as on an older driver.

Each fake GPU has a table of field values by NVML field id and of call readings by key, each with
a refresh period: the driver timestamp is the fake clock floored to that period, and a callable
value is evaluated at that timestamp, so "fields with known refresh periods" come for free. A
GPU may have NVLink links (``FakeLink``, ``nvlink_gpu``): ``nvmlDeviceGetNvLinkState`` answers
for them, and so do their entries of a field-value read (the per-link ids ``..._L0`` to ``_L11``,
the throughput ids with the link as ``scopeId``); a test takes a link down by setting ``active``.

Calls take time where a test says so: ``FakeNvml.costs`` gives a C function a cost per call (a
constant, or one that depends on the call's number, such as ``every(20, 0.005)``: a 5 ms call
every 20th), and ``FakeGpu.field_cost_s`` makes a batched field-value read that includes a field
id slow (ECC counts, retired pages). The time is spent in ``time.sleep`` inside the C entry
point, so the GIL is free meanwhile, as it is during a real ctypes call into the driver. The fake
may be called from several threads at once, as the sampler's two lanes do.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

Value = float | Callable[[int], float]  # a constant, or a function of the driver timestamp (us)
Cost = float | Callable[[int], float]  # seconds per call, or a function of the call's number (1..)

_HANDLE_BASE = 0x10000  # fake device handles are pointers to these addresses, one per GPU
_MIG_BASE = 0x40000  # MIG device handles: _MIG_BASE + gpu * _MIG_STRIDE + GPU instance id
_MIG_STRIDE = 64
_MIG_GPM_KEY = 1000  # a GPM sample of a MIG instance is keyed _MIG_GPM_KEY + its handle offset
_EVENT_SET = 0xE0000


@dataclass
class FakeReading:
    """One value the fake driver reports: its value, refresh period, type and entry return code."""

    value: Value
    period_us: int = 1000
    value_type: int = pynvml.NVML_VALUE_TYPE_DOUBLE
    ret: int = pynvml.NVML_SUCCESS

    def sample(self, now_us: int) -> tuple[int, float]:
        ts = now_us - now_us % self.period_us if self.period_us > 0 else now_us
        v = self.value(ts) if callable(self.value) else self.value
        return ts, v


@dataclass
class FakeLink:
    """One NVLink link: up or down, its cumulative data counters (KiB) and error counters.

    Values are functions of the driver timestamp (us) or constants, as ``FakeReading``'s. A link
    that is down still answers its entries with ``down_ret`` (by default success, the counters
    where they stand): what the driver does there is not documented, and hfsampler must not take
    a down link's numbers for traffic either way.
    """

    active: bool = True
    tx_kib: Value = 0.0
    rx_kib: Value = 0.0
    crc_flit: Value = 0.0
    crc_data: Value = 0.0
    replay: Value = 0.0
    recovery: Value = 0.0
    period_us: int = 10_000
    down_ret: int = pynvml.NVML_SUCCESS


# NVML's per-link ids (links 0-11) and the scoped throughput ids -> the FakeLink attribute
_LINK_IDS: dict[int, tuple[str, int]] = {
    getattr(pynvml, f"NVML_FI_DEV_NVLINK_{name}_L{k}"): (attr, k)
    for name, attr in (
        ("CRC_FLIT_ERROR_COUNT", "crc_flit"),
        ("CRC_DATA_ERROR_COUNT", "crc_data"),
        ("REPLAY_ERROR_COUNT", "replay"),
        ("RECOVERY_ERROR_COUNT", "recovery"),
    )
    for k in range(12)
}
_SCOPED_LINK_IDS: dict[int, str] = {
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: "tx_kib",
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: "rx_kib",
}
_ALL_LINKS = 0xFFFFFFFF  # scopeId UINT_MAX: the sum over every link


def nvlink_gpu(i: int, links: int = 18, down: tuple[int, ...] = ()) -> FakeGpu:
    """A standard GPU with ``links`` NVLink links, those in ``down`` not up.

    Link k of GPU i moves (10 + k + i) MiB/s out and twice that in, the driver refreshing every
    10 ms; its CRC flit errors grow by k per second, its replays by one per second on link 1.
    """
    gpu = standard_gpu(i)
    gpu.links = [
        FakeLink(
            active=k not in down,
            tx_kib=functools.partial(_kib, (10 + k + i) * 1024),
            rx_kib=functools.partial(_kib, 2 * (10 + k + i) * 1024),
            crc_flit=functools.partial(_per_s, float(k)),
            replay=functools.partial(_per_s, 1.0 if k == 1 else 0.0),
        )
        for k in range(links)
    ]
    return gpu


def _kib(kib_per_s: float, ts_us: int) -> float:
    return float(int(ts_us * kib_per_s / 1e6))


def _per_s(rate: float, ts_us: int) -> float:
    return float(int(ts_us * rate / 1e6))


# Call reading keys the fake understands, by C function (key -> what it answers):
#   clock_sm, clock_mem (GetClockInfo), temperature_gpu (GetTemperature), power_usage,
#   total_energy, power_limit (GetEnforcedPowerLimit), power_mgmt_limit
#   (GetPowerManagementLimit), util_gpu, util_mem (GetUtilizationRates),
#   util_enc, util_dec, fb_total, fb_free, fb_used, fb_reserved (GetMemoryInfo[_v2]),
#   clocks_event_reasons (both the Event and the older Throttle name), fan, pstate.


COMPUTE, GRAPHICS, MPS = "compute", "graphics", "mps"  # which of NVML's process lists


@dataclass
class FakeProcess:
    """A process on a fake GPU (or MIG instance): the memory it holds (None: the driver does not
    say, as under WDDM), its SM utilisation (percent, a constant or a function of the sample time
    in µs; None: the driver has no samples of it), the process lists it is in (compute, graphics,
    MPS compute: a process may be in several at once, as on a real driver), and when it is there
    on the fake clock: from ``start_us`` until before ``end_us`` (None: until the test removes it).
    """

    pid: int
    used_memory_bytes: int | None
    sm_util: Value | None = 0.0
    lists: tuple[str, ...] = (COMPUTE,)
    start_us: int = 0
    end_us: int | None = None

    def present(self, now_us: int) -> bool:
        return self.start_us <= now_us and (self.end_us is None or now_us < self.end_us)


@dataclass
class FakeGpu:
    """One fake device: its labels, field table, call readings and scripted failures."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    bus_id: str = "00000000:17:00.0"
    minor: int = 0
    fields: dict[int, FakeReading] = field(default_factory=dict)  # by NVML field id
    readings: dict[str, FakeReading] = field(default_factory=dict)  # by call key (above)
    errors: dict[str, int] = field(default_factory=dict)  # C function name -> return code
    lost: bool = False  # every call answers NVML_ERROR_GPU_IS_LOST
    xids: list[int] = field(default_factory=list)  # pending XID events
    registered_events: int = 0
    # GPM (Hopper and newer): metric id -> value in NVML's unit (percent, MiB/s), a function of
    # the sample time; the counters behind a sample refresh every gpm_period_us
    gpm: dict[int, FakeReading] = field(default_factory=dict)
    gpm_supported: bool = True
    gpm_period_us: int = 100_000
    # NVML field id -> seconds a nvmlDeviceGetFieldValues call that asks for it spends, added up
    field_cost_s: dict[int, float] = field(default_factory=dict)
    processes: list[FakeProcess] = field(default_factory=list)
    process_util_period_us: int = 100_000  # the driver's per-process samples come this often
    # how many of the latest sampling periods one nvmlDeviceGetProcessUtilization answer covers
    # (newer than the caller's timestamp), as the driver's buffer of recent samples
    process_util_history: int = 1
    links: list[FakeLink] = field(default_factory=list)  # NVLink links (none: no NVLink)
    # MIG (A100, H100, H200): a capable GPU answers the MIG calls; with mig_mode on, its
    # instances are MIG devices (in this order for nvmlDeviceGetMigDeviceHandleByIndex). A test
    # changes the list at any time, as `nvidia-smi mig -cgi/-dgi` would.
    mig_capable: bool = False
    mig_mode: int = pynvml.NVML_DEVICE_MIG_DISABLE
    max_mig_devices: int = 7
    mig: list[FakeMig] = field(default_factory=list)


@dataclass
class FakeMig:
    """One MIG device (a GPU instance with one compute instance) of a fake GPU."""

    gpu_instance_id: int
    profile: str  # as NVML names it, e.g. "3g.40gb"
    uuid: str
    name: str  # the MIG device's name: "<parent's name> MIG <profile>"
    compute_instance_id: int = 0
    readings: dict[str, FakeReading] = field(default_factory=dict)  # fb_* only, as on real MIG
    gpm: dict[int, FakeReading] = field(default_factory=dict)  # empty: no GPM on this instance
    errors: dict[str, int] = field(default_factory=dict)
    # what a MIG handle lacks, so the device helpers treat it as a device without them
    fields: dict[int, FakeReading] = field(default_factory=dict)
    field_cost_s: dict[int, float] = field(default_factory=dict)
    lost: bool = False
    # the processes in this instance: listed on its own handle, and on the parent's with their
    # GPU and compute instance ids; their utilisation samples on this instance's handle
    processes: list[FakeProcess] = field(default_factory=list)
    process_util_period_us: int = 100_000
    process_util_history: int = 1


def mig_instance(
    gpu: FakeGpu,
    gpu_index: int,
    gpu_instance_id: int,
    profile: str,
    *,
    gpm: bool = True,
    used_gib: float | None = None,
) -> FakeMig:
    """An instance of ``profile`` (``<n>g.<memory>gb``) whose memory follows its profile.

    Used memory (a fifth of the instance and more, by GPU instance id) changes every millisecond,
    as the standard GPU's does, unless ``used_gib`` fixes it; GPM metrics are the standard GPU's
    scaled by the instance's share of the 7 slices.
    """
    gib = float(1 << 30)
    total = gib * float(profile.split(".")[1].removesuffix("gb"))
    reserved = 0.25 * gib
    base = gib * used_gib if used_gib is not None else total * (0.2 + 0.05 * (gpu_instance_id % 4))

    def used(ts: int) -> float:
        return base if used_gib is not None else base + 0.01 * total * ((ts // 1000) % 3)

    slices = int(profile.split("g.")[0])
    readings = {
        "fb_total": FakeReading(total, 1_000_000),
        "fb_reserved": FakeReading(reserved, 1_000_000),
        "fb_used": FakeReading(used, 1000),
        "fb_free": FakeReading(lambda ts: total - reserved - used(ts), 1000),
    }
    metrics: dict[int, FakeReading] = {}
    if gpm:
        for name in GPM_BASE:
            value = functools.partial(_mig_gpm_value, name, gpu_index, slices / 7)
            metrics[getattr(pynvml, name)] = FakeReading(value, gpu.gpm_period_us)
    return FakeMig(
        gpu_instance_id=gpu_instance_id,
        profile=profile,
        uuid=f"MIG-{gpu_index:08x}-{gpu_instance_id:04x}-4444-5555-666677778888",
        name=f"{gpu.name} MIG {profile}",
        readings=readings,
        gpm=metrics,
    )


def _mig_gpm_value(name: str, gpu: int, share: float, ts_us: int) -> float:
    return gpm_value(name, gpu, ts_us) * share


def enable_mig(gpu: FakeGpu, gpu_index: int, layout: list[tuple[int, str]], **kw: Any) -> None:
    """MIG mode on, with one instance per ``(GPU instance id, profile)``."""
    gpu.mig_capable = True
    gpu.mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
    gpu.mig = [mig_instance(gpu, gpu_index, gi, profile, **kw) for gi, profile in layout]


def _power(base_mw: int, step_mw: int, period_us: int) -> Callable[[int], float]:
    # Changes on every refresh, so a reader can tell refreshes from repeats by value too.
    return lambda ts: float(base_mw + step_mw * ((ts // period_us) % 5))


def standard_gpu(i: int) -> FakeGpu:
    """An H100-like GPU: every catalogue field id and call present, with distinct periods."""
    u, ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    fi = {
        "NVML_FI_DEV_MEMORY_TEMP": FakeReading(45.0 + i, 1_000_000, u),
        "NVML_FI_DEV_POWER_AVERAGE": FakeReading(_power(300_000 + i, 1000, 100_000), 100_000, u),
        "NVML_FI_DEV_POWER_INSTANT": FakeReading(_power(310_000 + i, 2000, 20_000), 20_000, u),
        "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": FakeReading(
            lambda ts: float(ts // 1000), 20_000, ull
        ),
        "NVML_FI_DEV_POWER_CURRENT_LIMIT": FakeReading(700_000.0, 1_000_000, u),
        "NVML_FI_DEV_PCIE_REPLAY_COUNTER": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_ECC_SBE_VOL_TOTAL": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_ECC_DBE_VOL_TOTAL": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_ECC_SBE_AGG_TOTAL": FakeReading(2.0, 1_000_000, ull),
        "NVML_FI_DEV_ECC_DBE_AGG_TOTAL": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_REMAPPED_COR": FakeReading(0.0, 1_000_000, u),
        "NVML_FI_DEV_REMAPPED_UNC": FakeReading(0.0, 1_000_000, u),
        "NVML_FI_DEV_REMAPPED_FAILURE": FakeReading(0.0, 1_000_000, u),
        # violation time in ns, as the driver counts it: 1.5 ms power-capped so far
        "NVML_FI_DEV_PERF_POLICY_POWER": FakeReading(1.5e6, 1_000_000, ull),
        "NVML_FI_DEV_PERF_POLICY_THERMAL": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT": FakeReading(2.5e5, 1_000_000, ull),
        "NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_PERF_POLICY_RELIABILITY": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_RETIRED_SBE": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_RETIRED_DBE": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_RETIRED_PENDING": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": FakeReading(0.0, 1_000_000, ull),
        "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": FakeReading(0.0, 1_000_000, ull),
        # 2 GB/s and 4 GB/s of PCIe traffic, counted in bytes
        "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": FakeReading(lambda ts: ts * 2_000.0, 20_000, ull),
        "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": FakeReading(lambda ts: ts * 4_000.0, 20_000, ull),
    }
    gib = float(1 << 30)
    readings = {
        "clock_sm": FakeReading(lambda ts: 1980.0 - 15 * ((ts // 10_000) % 3), 10_000),
        "clock_mem": FakeReading(2619.0, 1_000_000),
        "temperature_gpu": FakeReading(40.0 + i, 1_000_000),
        "power_usage": FakeReading(_power(300_000 + i, 1000, 100_000), 100_000),
        "total_energy": FakeReading(lambda ts: float(ts // 1000), 20_000),
        "power_limit": FakeReading(700_000.0, 1_000_000),
        "power_mgmt_limit": FakeReading(700_000.0, 1_000_000),
        "util_gpu": FakeReading(lambda ts: float((ts // 166_000) % 100), 166_000),
        "util_mem": FakeReading(30.0, 166_000),
        "util_enc": FakeReading(0.0, 166_000),
        "util_dec": FakeReading(0.0, 166_000),
        "fb_total": FakeReading(80 * gib, 1_000_000),
        "fb_reserved": FakeReading(0.5 * gib, 1_000_000),
        "fb_used": FakeReading(lambda ts: gib * (10 + (ts // 1000) % 7), 1000),
        "fb_free": FakeReading(lambda ts: gib * (69.5 - (ts // 1000) % 7), 1000),
        "clocks_event_reasons": FakeReading(0.0, 1000),
        "fan": FakeReading(0.0, 1_000_000),
        "pstate": FakeReading(0.0, 1_000_000),
    }
    return FakeGpu(
        uuid=f"GPU-{i:08x}-1111-2222-3333-444455556666",
        bus_id=f"00000000:{0x17 + i:02X}:00.0",
        minor=i,
        fields={getattr(pynvml, k): v for k, v in fi.items()},
        readings=readings,
        gpm=standard_gpm(i),
    )


# GPM metrics of a busy training GPU, in NVML's units: (base, step per refresh)
GPM_BASE: dict[str, tuple[float, float]] = {
    "NVML_GPM_METRIC_GRAPHICS_UTIL": (90.0, 1.0),
    "NVML_GPM_METRIC_SM_UTIL": (80.0, 1.0),
    "NVML_GPM_METRIC_SM_OCCUPANCY": (40.0, 1.0),
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": (50.0, 2.0),
    "NVML_GPM_METRIC_DRAM_BW_UTIL": (30.0, 1.0),
    "NVML_GPM_METRIC_FP64_UTIL": (0.0, 0.5),
    "NVML_GPM_METRIC_FP32_UTIL": (10.0, 1.0),
    "NVML_GPM_METRIC_FP16_UTIL": (5.0, 1.0),
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": (1000.0, 10.0),  # MiB/s
    "NVML_GPM_METRIC_PCIE_RX_PER_SEC": (2000.0, 10.0),
    "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC": (50_000.0, 100.0),
    "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC": (60_000.0, 100.0),
}


def gpm_value(name: str, gpu: int, ts_us: int, period_us: int = 100_000) -> float:
    """The standard fake's GPM metric ``name`` for a sample at ``ts_us`` (changes per refresh)."""
    base, step = GPM_BASE[name]
    return base + gpu + step * ((ts_us // period_us) % 5)


def standard_gpm(i: int, period_us: int = 100_000) -> dict[int, FakeReading]:
    return {
        getattr(pynvml, name): FakeReading(
            functools.partial(gpm_value, name, i, period_us=period_us), period_us
        )
        for name in GPM_BASE
    }


@dataclass
class FakeNvml:
    """The fake driver's state; tests change it at any time, the next call sees the change."""

    gpus: list[FakeGpu]
    driver_version: str = "570.133.20"
    missing: set[str] = field(default_factory=set)  # C functions this "driver" lacks
    init_error: int | None = None  # nvmlInitWithFlags returns this (e.g. DRIVER_NOT_LOADED)
    clock_us: Callable[[], int] = field(default=lambda: time.monotonic_ns() // 1000)
    calls: Counter[str] = field(default_factory=Counter)  # C function name -> times called
    initialised: int = 0
    gpm_samples: dict[int, tuple[int, int]] = field(default_factory=dict)  # addr -> (gpu, ts)
    gpm_next: int = 0x700000
    costs: dict[str, Cost] = field(default_factory=dict)  # C function name -> time per call
    # (C function name, seconds it slept) per call that cost something, in call order
    slept: list[tuple[str, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def spend(self, name: str, seconds: float) -> None:
        """Take ``seconds`` in the "driver": asleep, with the GIL released."""
        if seconds > 0:
            time.sleep(seconds)
            self.slept.append((name, seconds))

    def handle(self, i: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(_HANDLE_BASE + i), pynvml.c_nvmlDevice_t)

    def xid_burst(self, gpu: int, code: int, count: int) -> None:
        """``count`` XID ``code`` events pending on ``gpu``, after those already pending."""
        self.gpus[gpu].xids += [code] * count

    def gpu_of(self, handle: Any) -> tuple[int, FakeGpu]:
        addr = ctypes.cast(handle, ctypes.c_void_p).value or 0
        i = addr - _HANDLE_BASE
        if not 0 <= i < len(self.gpus):
            raise LookupError(f"not a fake device handle: {addr:#x}")
        return i, self.gpus[i]

    def mig_of(self, handle: Any) -> tuple[int, FakeGpu, FakeMig | None] | None:
        """(parent index, parent, instance) for a MIG handle (instance None: destroyed since);
        None for a handle that is not a MIG one."""
        addr = ctypes.cast(handle, ctypes.c_void_p).value or 0
        offset = addr - _MIG_BASE
        i, gi = divmod(offset, _MIG_STRIDE)
        if offset < 0 or not 0 <= i < len(self.gpus):
            return None
        gpu = self.gpus[i]
        found = next((m for m in gpu.mig if m.gpu_instance_id == gi), None)
        if gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            found = None
        return i, gpu, found


class _CFunction:
    """A fake C entry point: pynvml sets ``restype``/``argtypes`` on some, so they must stick."""

    def __init__(self, name: str, impl: Callable[..., int], fake: FakeNvml) -> None:
        self.__name__ = name
        self._impl = impl
        self._fake = fake
        self.restype: Any = ctypes.c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        fake = self._fake
        with fake.lock:
            fake.calls[self.__name__] += 1
            number = fake.calls[self.__name__]
        cost = fake.costs.get(self.__name__)
        if cost is not None:
            fake.spend(self.__name__, cost(number) if callable(cost) else cost)
        return self._impl(*args)


def every(n: int, slow_s: float, base_s: float = 0.0) -> Callable[[int], float]:
    """A cost of ``slow_s`` on every ``n``-th call and ``base_s`` on the others."""
    return lambda number: slow_s if number % n == 0 else base_s


def _obj(arg: Any) -> Any:
    """The ctypes object behind a ``byref()`` argument (or the argument itself)."""
    return getattr(arg, "_obj", arg)


def _int(arg: Any) -> int:
    return int(getattr(arg, "value", arg))


def _set_value(union: Any, value_type: int, v: float) -> None:
    member = {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }[value_type]
    setattr(union, member, v if member == "dVal" else int(v))


class FakeLib:
    """Stands in for ``CDLL("libnvidia-ml.so.1")``: attribute lookup gives C entry points."""

    def __init__(self, fake: FakeNvml) -> None:
        self._fake = fake

    def __getattr__(self, name: str) -> _CFunction:
        impl = getattr(self, "_c_" + name, None)
        if impl is None or name in self._fake.missing:
            raise AttributeError(name)  # pynvml turns this into FUNCTION_NOT_FOUND
        return _CFunction(name, impl, self._fake)

    # -- helpers ---------------------------------------------------------------------------

    def _device(self, fn: str, handle: Any) -> tuple[int, Any]:
        """(return code, gpu): the code a device call fails with before touching outputs.

        For a MIG handle the "gpu" is its ``FakeMig``, which has readings for memory only; a
        handle of an instance destroyed since is NVML_ERROR_INVALID_ARGUMENT.
        """
        gpu: Any
        mig = self._fake.mig_of(handle)
        if mig is not None:
            _, parent, instance = mig
            if instance is None:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT, None
            if parent.lost:
                return pynvml.NVML_ERROR_GPU_IS_LOST, None
            gpu = instance
        else:
            try:
                _, gpu = self._fake.gpu_of(handle)
            except LookupError:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT, None
        if self._fake.initialised <= 0:
            return pynvml.NVML_ERROR_UNINITIALIZED, None
        if gpu.lost:
            return pynvml.NVML_ERROR_GPU_IS_LOST, None
        code = gpu.errors.get(fn, pynvml.NVML_SUCCESS)
        return code, (gpu if code == pynvml.NVML_SUCCESS else None)

    def _reading(self, fn: str, handle: Any, key: str, out: Any, attr: str = "value") -> int:
        code, gpu = self._device(fn, handle)
        if gpu is None:
            return code
        r = gpu.readings.get(key)
        if r is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        setattr(_obj(out), attr, int(r.sample(self._fake.clock_us())[1]))
        return r.ret

    # -- system ----------------------------------------------------------------------------

    def _c_nvmlInitWithFlags(self, flags: Any) -> int:
        if self._fake.init_error is not None:
            return self._fake.init_error
        self._fake.initialised += 1
        return pynvml.NVML_SUCCESS

    def _c_nvmlShutdown(self) -> int:
        if self._fake.initialised <= 0:
            return pynvml.NVML_ERROR_UNINITIALIZED
        self._fake.initialised -= 1
        return pynvml.NVML_SUCCESS

    def _c_nvmlErrorString(self, code: Any) -> bytes:
        return f"fake NVML error {_int(code)}".encode()

    def _c_nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        buf.value = self._fake.driver_version.encode()[: _int(size) - 1]
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetCount_v2(self, count: Any) -> int:
        if self._fake.initialised <= 0:
            return pynvml.NVML_ERROR_UNINITIALIZED
        _obj(count).value = len(self._fake.gpus)
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, device: Any) -> int:
        i = _int(index)
        if not 0 <= i < len(self._fake.gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        ctypes.c_void_p.from_buffer(_obj(device)).value = _HANDLE_BASE + i
        return pynvml.NVML_SUCCESS

    # -- labels ----------------------------------------------------------------------------

    def _c_nvmlDeviceGetName(self, handle: Any, buf: Any, size: Any) -> int:
        code, gpu = self._device("nvmlDeviceGetName", handle)
        if gpu is not None:
            buf.value = gpu.name.encode()
        return code

    def _c_nvmlDeviceGetUUID(self, handle: Any, buf: Any, size: Any) -> int:
        code, gpu = self._device("nvmlDeviceGetUUID", handle)
        if gpu is not None:
            buf.value = gpu.uuid.encode()
        return code

    def _c_nvmlDeviceGetPciInfo_v3(self, handle: Any, info: Any) -> int:
        code, gpu = self._device("nvmlDeviceGetPciInfo_v3", handle)
        if gpu is not None:
            pci = _obj(info)
            pci.busId = gpu.bus_id.encode()
            pci.busIdLegacy = gpu.bus_id.encode()[:15]
        return code

    def _c_nvmlDeviceGetMinorNumber(self, handle: Any, out: Any) -> int:
        code, gpu = self._device("nvmlDeviceGetMinorNumber", handle)
        if gpu is not None:
            _obj(out).value = gpu.minor
        return code

    # -- field values ----------------------------------------------------------------------

    def _c_nvmlDeviceGetFieldValues(self, handle: Any, count: Any, values: Any) -> int:
        code, gpu = self._device("nvmlDeviceGetFieldValues", handle)
        if gpu is None:
            return code
        entries = _obj(values)
        if gpu.field_cost_s:
            ids = [int(entries[k].fieldId) for k in range(_int(count))]
            self._fake.spend(
                "nvmlDeviceGetFieldValues", sum(gpu.field_cost_s.get(i, 0.0) for i in ids)
            )
        now = self._fake.clock_us()
        for k in range(_int(count)):
            e = entries[k]
            r = gpu.fields.get(int(e.fieldId)) or self._link_reading(gpu, e)
            e.latencyUsec = 0
            if r is None:
                e.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                e.timestamp = 0
                continue
            ts, v = r.sample(now)
            e.timestamp = ts
            e.valueType = r.value_type
            e.nvmlReturn = r.ret
            _set_value(e.value, r.value_type, v)
        return pynvml.NVML_SUCCESS

    @staticmethod
    def _link_reading(gpu: FakeGpu, e: Any) -> FakeReading | None:
        """The reading a per-link entry asks for: by per-link id, or by scoped id and link."""
        fid, scope = int(e.fieldId), int(e.scopeId)
        ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        if fid in _LINK_IDS:
            attr, k = _LINK_IDS[fid]
        elif fid in _SCOPED_LINK_IDS and gpu.links:
            attr, k = _SCOPED_LINK_IDS[fid], scope
            if scope == _ALL_LINKS:
                up = [ln for ln in gpu.links if ln.active]
                total = lambda ts: sum(FakeReading(getattr(ln, attr)).sample(ts)[1] for ln in up)  # noqa: E731
                return FakeReading(total, gpu.links[0].period_us, ull)
        else:
            return None
        if k >= len(gpu.links):
            return FakeReading(0.0, 1, ull, pynvml.NVML_ERROR_INVALID_ARGUMENT)
        link = gpu.links[k]
        ret = pynvml.NVML_SUCCESS if link.active else link.down_ret
        return FakeReading(getattr(link, attr), link.period_us, ull, ret)

    # -- per-device calls ------------------------------------------------------------------

    def _c_nvmlDeviceGetClockInfo(self, handle: Any, kind: Any, out: Any) -> int:
        key = {pynvml.NVML_CLOCK_SM: "clock_sm", pynvml.NVML_CLOCK_MEM: "clock_mem"}
        return self._reading(
            "nvmlDeviceGetClockInfo", handle, key.get(_int(kind), "clock_other"), out
        )

    def _c_nvmlDeviceGetTemperature(self, handle: Any, sensor: Any, out: Any) -> int:
        key = "temperature_gpu" if _int(sensor) == pynvml.NVML_TEMPERATURE_GPU else "temp_other"
        return self._reading("nvmlDeviceGetTemperature", handle, key, out)

    def _c_nvmlDeviceGetPowerUsage(self, handle: Any, out: Any) -> int:
        return self._reading("nvmlDeviceGetPowerUsage", handle, "power_usage", out)

    def _c_nvmlDeviceGetTotalEnergyConsumption(self, handle: Any, out: Any) -> int:
        return self._reading("nvmlDeviceGetTotalEnergyConsumption", handle, "total_energy", out)

    def _c_nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, out: Any) -> int:
        return self._reading("nvmlDeviceGetEnforcedPowerLimit", handle, "power_limit", out)

    def _c_nvmlDeviceGetPowerManagementLimit(self, handle: Any, out: Any) -> int:
        return self._reading("nvmlDeviceGetPowerManagementLimit", handle, "power_mgmt_limit", out)

    def _c_nvmlDeviceGetUtilizationRates(self, handle: Any, out: Any) -> int:
        code, gpu = self._device("nvmlDeviceGetUtilizationRates", handle)
        if gpu is not None and getattr(gpu, "mig_mode", None) == pynvml.NVML_DEVICE_MIG_ENABLE:
            return pynvml.NVML_ERROR_NOT_SUPPORTED  # NVML: not supported on a MIG-enabled GPU
        code = self._reading("nvmlDeviceGetUtilizationRates", handle, "util_gpu", out, "gpu")
        if code == pynvml.NVML_SUCCESS:
            code = self._reading("nvmlDeviceGetUtilizationRates", handle, "util_mem", out, "memory")
        return code

    def _c_nvmlDeviceGetEncoderUtilization(self, handle: Any, util: Any, period: Any) -> int:
        _obj(period).value = 166_000
        return self._reading("nvmlDeviceGetEncoderUtilization", handle, "util_enc", util)

    def _c_nvmlDeviceGetDecoderUtilization(self, handle: Any, util: Any, period: Any) -> int:
        _obj(period).value = 166_000
        return self._reading("nvmlDeviceGetDecoderUtilization", handle, "util_dec", util)

    def _memory(self, fn: str, handle: Any, out: Any, keys: tuple[str, ...]) -> int:
        for key in keys:
            code = self._reading(fn, handle, "fb_" + key, out, key)
            if code != pynvml.NVML_SUCCESS:
                return code
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> int:
        return self._memory("nvmlDeviceGetMemoryInfo", handle, out, ("total", "free", "used"))

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, out: Any) -> int:
        if _obj(out).version != pynvml.nvmlMemory_v2:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        keys = ("total", "reserved", "free", "used")
        return self._memory("nvmlDeviceGetMemoryInfo_v2", handle, out, keys)

    def _c_nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any, out: Any) -> int:
        return self._reading(
            "nvmlDeviceGetCurrentClocksEventReasons", handle, "clocks_event_reasons", out
        )

    def _c_nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any, out: Any) -> int:
        return self._reading(
            "nvmlDeviceGetCurrentClocksThrottleReasons", handle, "clocks_event_reasons", out
        )

    def _c_nvmlDeviceGetFanSpeed(self, handle: Any, out: Any) -> int:
        return self._reading("nvmlDeviceGetFanSpeed", handle, "fan", out)

    def _c_nvmlDeviceGetNvLinkState(self, handle: Any, link: Any, out: Any) -> int:
        code, gpu = self._device("nvmlDeviceGetNvLinkState", handle)
        if gpu is None:
            return code
        if not gpu.links:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        k = _int(link)
        if not 0 <= k < len(gpu.links):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        _obj(out).value = (
            pynvml.NVML_FEATURE_ENABLED if gpu.links[k].active else pynvml.NVML_FEATURE_DISABLED
        )
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetPerformanceState(self, handle: Any, out: Any) -> int:
        return self._reading("nvmlDeviceGetPerformanceState", handle, "pstate", out)

    # -- MIG -------------------------------------------------------------------------------

    def _parent(self, fn: str, handle: Any) -> tuple[int, FakeGpu | None]:
        """A MIG call on a physical GPU: NOT_SUPPORTED where the GPU has no MIG."""
        code, gpu = self._device(fn, handle)
        if gpu is None:
            return code, None
        if not isinstance(gpu, FakeGpu):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, None  # a MIG handle has no instances
        if not gpu.mig_capable:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, None
        return pynvml.NVML_SUCCESS, gpu

    def _c_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        code, gpu = self._parent("nvmlDeviceGetMigMode", handle)
        if gpu is not None:
            _obj(current).value = gpu.mig_mode
            _obj(pending).value = gpu.mig_mode
        return code

    def _c_nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, count: Any) -> int:
        code, gpu = self._parent("nvmlDeviceGetMaxMigDeviceCount", handle)
        if gpu is not None:
            _obj(count).value = gpu.max_mig_devices
        return code

    def _c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, out: Any) -> int:
        code, gpu = self._parent("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if gpu is None:
            return code
        i, _ = self._fake.gpu_of(handle)
        k = _int(index)
        if gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if k >= gpu.max_mig_devices:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if k >= len(gpu.mig):
            return pynvml.NVML_ERROR_NOT_FOUND  # no MIG device at that index (yet)
        addr = _MIG_BASE + i * _MIG_STRIDE + gpu.mig[k].gpu_instance_id
        ctypes.c_void_p.from_buffer(_obj(out)).value = addr
        return pynvml.NVML_SUCCESS

    def _instance(self, fn: str, handle: Any) -> tuple[int, FakeMig | None]:
        code, obj = self._device(fn, handle)
        if obj is None:
            return code, None
        if not isinstance(obj, FakeMig):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, None  # not a MIG device handle
        return pynvml.NVML_SUCCESS, obj

    def _c_nvmlDeviceIsMigDeviceHandle(self, handle: Any, out: Any) -> int:
        _obj(out).value = 1 if self._fake.mig_of(handle) is not None else 0
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetGpuInstanceId(self, handle: Any, out: Any) -> int:
        code, mig = self._instance("nvmlDeviceGetGpuInstanceId", handle)
        if mig is not None:
            _obj(out).value = mig.gpu_instance_id
        return code

    def _c_nvmlDeviceGetComputeInstanceId(self, handle: Any, out: Any) -> int:
        code, mig = self._instance("nvmlDeviceGetComputeInstanceId", handle)
        if mig is not None:
            _obj(out).value = mig.compute_instance_id
        return code

    def _c_nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any, out: Any) -> int:
        code, mig = self._instance("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        found = self._fake.mig_of(handle)
        if mig is not None and found is not None:
            ctypes.c_void_p.from_buffer(_obj(out)).value = _HANDLE_BASE + found[0]
        return code

    def _c_nvmlGpmMigSampleGet(self, handle: Any, gpu_instance_id: Any, sample: Any) -> int:
        code, gpu = self._parent("nvmlGpmMigSampleGet", handle)
        if gpu is None:
            return code
        addr = ctypes.cast(sample, ctypes.c_void_p).value or 0
        if addr not in self._fake.gpm_samples:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        gi = _int(gpu_instance_id)
        mig = next((m for m in gpu.mig if m.gpu_instance_id == gi), None)
        if mig is None or gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            return pynvml.NVML_ERROR_NOT_FOUND
        if not gpu.gpm_supported or not mig.gpm:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        i, _ = self._fake.gpu_of(handle)
        now = self._fake.clock_us()
        key = _MIG_GPM_KEY + i * _MIG_STRIDE + gi
        self._fake.gpm_samples[addr] = (key, now - now % gpu.gpm_period_us)
        return pynvml.NVML_SUCCESS

    # -- events ----------------------------------------------------------------------------

    def _listed(self, handle: Any, kind: str) -> list[tuple[FakeProcess, int, int]]:
        """(process, GPU instance id, compute instance id) of one list on a device now: a MIG
        handle lists its instance's; a GPU its own, and in MIG mode its instances' too."""
        now = self._fake.clock_us()
        obj = self._device("", handle)[1]
        none = 0xFFFFFFFF  # NVML's "not in a MIG instance"
        if isinstance(obj, FakeMig):
            found = [(p, obj.gpu_instance_id, obj.compute_instance_id) for p in obj.processes]
        else:
            found = [(p, none, none) for p in obj.processes]
            if obj.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
                found += [(p, m.gpu_instance_id, m.compute_instance_id)
                          for m in obj.mig for p in m.processes]  # fmt: skip
        return [(p, gi, ci) for p, gi, ci in found if kind in p.lists and p.present(now)]

    def _process_list(self, fn: str, kind: str, handle: Any, count: Any, infos: Any) -> int:
        code, gpu = self._device(fn, handle)
        if gpu is None:
            return code
        procs = self._listed(handle, kind)
        n, room = len(procs), _obj(count)
        if infos is None or room.value < n:
            room.value = n
            return pynvml.NVML_SUCCESS if n == 0 else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (p, gi, ci) in enumerate(procs):
            infos[i].pid = p.pid
            infos[i].usedGpuMemory = (
                pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                if p.used_memory_bytes is None
                else p.used_memory_bytes
            )
            infos[i].gpuInstanceId, infos[i].computeInstanceId = gi, ci
        room.value = n
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any,
                                                   infos: Any) -> int:  # fmt: skip
        fn = "nvmlDeviceGetComputeRunningProcesses_v3"
        return self._process_list(fn, COMPUTE, handle, count, infos)

    def _c_nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: Any, count: Any,
                                                    infos: Any) -> int:  # fmt: skip
        fn = "nvmlDeviceGetGraphicsRunningProcesses_v3"
        return self._process_list(fn, GRAPHICS, handle, count, infos)

    def _c_nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle: Any, count: Any,
                                                      infos: Any) -> int:  # fmt: skip
        fn = "nvmlDeviceGetMPSComputeRunningProcesses_v3"
        return self._process_list(fn, MPS, handle, count, infos)

    def _c_nvmlDeviceGetProcessUtilization(self, handle: Any, samples: Any, count: Any,
                                           last_seen: Any) -> int:  # fmt: skip
        """One sample per process with samples per sampling period (the latest
        ``process_util_history`` periods' starts newer than ``last_seen``), for the processes
        there at each; a MIG handle answers for its instance's processes, a GPU for its own."""
        code, gpu = self._device("nvmlDeviceGetProcessUtilization", handle)
        if gpu is None:
            return code
        now = self._fake.clock_us()
        period = gpu.process_util_period_us
        latest = now - now % period
        starts = [latest - k * period for k in reversed(range(gpu.process_util_history))]
        found = [
            (p, ts)
            for ts in starts
            if ts > _int(last_seen) and ts >= 0
            for p in gpu.processes
            if p.sm_util is not None and p.present(ts)
        ]
        room = _obj(count)
        if not found:
            room.value = 0
            return pynvml.NVML_ERROR_NOT_FOUND
        if samples is None or room.value < len(found):
            room.value = len(found)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (p, ts) in enumerate(found):
            util = p.sm_util(ts) if callable(p.sm_util) else p.sm_util
            samples[i].pid, samples[i].timeStamp, samples[i].smUtil = p.pid, ts, int(util or 0)
            samples[i].memUtil = samples[i].encUtil = samples[i].decUtil = 0
        room.value = len(found)
        return pynvml.NVML_SUCCESS

    def _c_nvmlEventSetCreate(self, out: Any) -> int:
        ctypes.c_void_p.from_buffer(_obj(out)).value = _EVENT_SET
        return pynvml.NVML_SUCCESS

    def _c_nvmlEventSetFree(self, event_set: Any) -> int:
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceRegisterEvents(self, handle: Any, types: Any, event_set: Any) -> int:
        code, gpu = self._device("nvmlDeviceRegisterEvents", handle)
        if gpu is not None:
            gpu.registered_events |= _int(types)
        return code

    def _c_nvmlEventSetWait_v2(self, event_set: Any, data: Any, timeout_ms: Any) -> int:
        for i, gpu in enumerate(self._fake.gpus):
            if gpu.xids and gpu.registered_events & pynvml.nvmlEventTypeXidCriticalError:
                d = _obj(data)
                ctypes.c_void_p.from_buffer(d, 0).value = _HANDLE_BASE + i
                d.eventType = pynvml.nvmlEventTypeXidCriticalError
                d.eventData = gpu.xids.pop(0)
                return pynvml.NVML_SUCCESS
        return pynvml.NVML_ERROR_TIMEOUT  # the real one never blocks past timeout_ms either

    # -- GPM -------------------------------------------------------------------------------

    def _c_nvmlGpmQueryDeviceSupport(self, handle: Any, support: Any) -> int:
        code, gpu = self._device("nvmlGpmQueryDeviceSupport", handle)
        if gpu is None:
            return code
        out = _obj(support)
        if out.version != pynvml.NVML_GPM_SUPPORT_VERSION:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        out.isSupportedDevice = 1 if gpu.gpm_supported else 0
        return pynvml.NVML_SUCCESS

    def _c_nvmlGpmSampleAlloc(self, out: Any) -> int:
        with self._fake.lock:
            addr = self._fake.gpm_next
            self._fake.gpm_next += 0x100
            self._fake.gpm_samples[addr] = (-1, 0)
        ctypes.c_void_p.from_buffer(_obj(out)).value = addr
        return pynvml.NVML_SUCCESS

    def _c_nvmlGpmSampleFree(self, sample: Any) -> int:
        addr = ctypes.cast(sample, ctypes.c_void_p).value or 0
        return (
            pynvml.NVML_SUCCESS
            if self._fake.gpm_samples.pop(addr, None) is not None
            else pynvml.NVML_ERROR_INVALID_ARGUMENT
        )

    def _c_nvmlGpmSampleGet(self, handle: Any, sample: Any) -> int:
        code, gpu = self._device("nvmlGpmSampleGet", handle)
        if gpu is None:
            return code
        addr = ctypes.cast(sample, ctypes.c_void_p).value or 0
        if addr not in self._fake.gpm_samples:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if not gpu.gpm_supported:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        now = self._fake.clock_us()
        i, _ = self._fake.gpu_of(handle)
        self._fake.gpm_samples[addr] = (i, now - now % gpu.gpm_period_us)
        return pynvml.NVML_SUCCESS

    def _c_nvmlGpmMetricsGet(self, metrics_get: Any) -> int:
        mg = _obj(metrics_get)
        if mg.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if self._fake.initialised <= 0:
            return pynvml.NVML_ERROR_UNINITIALIZED
        a1 = ctypes.cast(mg.sample1, ctypes.c_void_p).value or 0
        a2 = ctypes.cast(mg.sample2, ctypes.c_void_p).value or 0
        s1, s2 = self._fake.gpm_samples.get(a1), self._fake.gpm_samples.get(a2)
        if s1 is None or s2 is None or s1[0] != s2[0] or s1[0] < 0:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        # The fake's assumption for two samples of the same counter refresh: no elapsed time to
        # divide by, so the call fails as a whole.
        if s2[1] <= s1[1]:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        metrics = self._gpm_metrics(s1[0])
        if metrics is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT  # the instance was destroyed since
        for k in range(int(mg.numMetrics)):
            m = mg.metrics[k]
            r = metrics.get(int(m.metricId))
            if r is None:
                m.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                m.value = 0.0
                continue
            m.value = r.value(s2[1]) if callable(r.value) else r.value
            m.nvmlReturn = r.ret
        return pynvml.NVML_SUCCESS

    def _gpm_metrics(self, key: int) -> dict[int, FakeReading] | None:
        if key < _MIG_GPM_KEY:
            return self._fake.gpus[key].gpm
        i, gi = divmod(key - _MIG_GPM_KEY, _MIG_STRIDE)
        mig = next((m for m in self._fake.gpus[i].mig if m.gpu_instance_id == gi), None)
        return None if mig is None else mig.gpm


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml) -> FakeNvml:
    """Put ``fake`` under the real pynvml for the rest of the test (undone by monkeypatch)."""
    monkeypatch.setattr(pynvml, "nvmlLib", FakeLib(fake))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
    return fake


def remove_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """No libnvidia-ml at all: pynvml's own loader fails as on a machine without the driver."""

    def no_library(name: str, *args: Any, **kwargs: Any) -> Any:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "CDLL", no_library)


def make_fake(gpus: int = 2) -> FakeNvml:
    return FakeNvml(gpus=[standard_gpu(i) for i in range(gpus)])


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Two standard fake GPUs under the real pynvml; change ``fake_nvml.gpus`` to script."""
    return install(monkeypatch, make_fake(2))

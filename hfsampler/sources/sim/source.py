"""The ``sim`` source: seeded, deterministic synthetic GPUs for tests, demos and benchmarks.

Every gauge is a pure function of (seed, gpu, field, time), so a test can recompute the truth for
any window: a baseline, hash-based noise, transient power spikes of a few milliseconds, a slow
framebuffer leak (a sawtooth), and throttling episodes during which the SM clock drops, power is
capped and the SW power-cap reason bit is set. Every counter of the catalogue (``Kind.COUNTER``)
integrates from a field set's first read: energy the power, violation time the throttling, others
their profile's rate (most stay 0). Each field refreshes on its own period, and the driver
timestamp is that period's start, so the sampler sees repeats exactly as with real NVML.
Each GPU has NVLink links (``NVLINKS``, an H200's 18, the last one down on odd GPUs): a per-link
field becomes one field per link at open, each with its own noise and counters, NaN where down.

Reads of different field sets may run at once on different threads (the sampler's two lanes):
each field set keeps its own precomputed rows and counters, and what the sets share (the plans,
the tables of spikes and throttling episodes per time bucket) is only ever added to, whole. A
field may be given a read cost (``read_cost_s``): a read that includes it sleeps that long with
the GIL released, as a slow NVML query (ECC counts, retired pages) waits in the driver.

A reader that comes back every millisecond is served from blocks of precomputed rows; the next
block is computed ahead of need on a helper thread of the source's own (``ahead``, at the
priority of the lane that started it), so the sampler's fast lane only copies rows and never
stalls for a block (4.8 ms at 64 GPUs). Every row is a pure function of its millisecond: a block
computed ahead holds the values one computed on the lane would.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.fields import (
    CATALOGUE,
    CLOCK_EVENTS,
    ENERGY,
    FB_FREE,
    FB_USED,
    GPU_UTIL,
    POWER_AVERAGE,
    POWER_INSTANT,
    POWER_VIOLATION,
    SM_CLOCK,
    Field,
    Kind,
)
from hfsampler.sources.base import (
    BoolArray,
    DeviceInfo,
    FloatArray,
    GpuProcess,
    IntArray,
    Inventory,
)
from hfsampler.sources.sim import mig as sim_mig
from hfsampler.sources.sim.ahead import Ahead, Helper

U64 = npt.NDArray[np.uint64]

_SPIKE_BUCKET_NS = 1_000_000_000  # at most one spike per GPU per second
_SPIKE_PROBABILITY = 0.6
_SPIKE_RAMP_NS = 1_000_000
_SPIKE_PLATEAU_NS = 4_000_000  # longer than a few late ticks, so every spike is sampled
_THROTTLE_BUCKET_NS = 10_000_000_000
_THROTTLE_PROBABILITY = 0.5
_LEAK_PERIOD_NS = 600_000_000_000  # the leak grows for 10 min, then the "job" restarts
SW_POWER_CAP_BIT = 0x4
FB_TOTAL_MIB = 143_771.0
FB_USED_MIB = 40_000.0  # before the leak, on GPU 0
FB_RESERVED_MIB = 527.0
POWER_CAP_W = 700.0


@dataclass(frozen=True, slots=True)
class Profile:
    """One field's synthetic signal: baseline, noise half-width and refresh period."""

    base: float
    noise: float
    refresh_ns: int
    rate_per_s: float = 0.0  # a counter's growth while running


# Keyed by catalogue name: the sim's own data about each field, as nvml_calls.py has its calls.


_PROFILES: dict[str, Profile] = {
    "DCGM_FI_DEV_SM_CLOCK": Profile(1980.0, 0.0, 1_000_000),
    "DCGM_FI_DEV_MEM_CLOCK": Profile(2619.0, 0.0, 1_000_000),
    "DCGM_FI_DEV_GPU_TEMP": Profile(55.0, 1.0, 100_000_000),
    "DCGM_FI_DEV_MEMORY_TEMP": Profile(62.0, 1.0, 100_000_000),
    "DCGM_FI_DEV_POWER_USAGE": Profile(330.0, 2.0, 20_000_000),
    "DCGM_FI_DEV_POWER_USAGE_INSTANT": Profile(330.0, 15.0, 1_000_000),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": Profile(POWER_CAP_W, 0.0, 100_000_000),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": Profile(POWER_CAP_W, 0.0, 100_000_000),
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": Profile(2.0e6, 2.0e5, 20_000_000),
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": Profile(4.0e6, 4.0e5, 20_000_000),
    "DCGM_FI_DEV_GPU_UTIL": Profile(90.0, 8.0, 1_000_000),
    "DCGM_FI_DEV_MEM_COPY_UTIL": Profile(45.0, 10.0, 1_000_000),
    "DCGM_FI_DEV_ENC_UTIL": Profile(0.0, 0.0, 1_000_000),
    "DCGM_FI_DEV_DEC_UTIL": Profile(0.0, 0.0, 1_000_000),
    "DCGM_FI_DEV_FB_RESERVED": Profile(FB_RESERVED_MIB, 0.0, 1_000_000),
    "DCGM_FI_DEV_FB_USED": Profile(FB_USED_MIB, 0.0, 1_000_000),
    "DCGM_FI_DEV_FB_FREE": Profile(0.0, 0.0, 1_000_000),
    "DCGM_FI_DEV_FB_TOTAL": Profile(FB_TOTAL_MIB, 0.0, 1_000_000_000),
    "DCGM_FI_DEV_FAN_SPEED": Profile(0.0, 0.0, 100_000_000),
    "DCGM_FI_DEV_PSTATE": Profile(0.0, 0.0, 100_000_000),
    # Activity as GPM or DCGM report it for a busy training job: ratios in [0, 1], bytes/s;
    # refreshed every 100 ms like NVML's GPM counters. base +- noise stays inside [0, 1].
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": Profile(0.90, 0.05, 100_000_000),
    "DCGM_FI_PROF_SM_ACTIVE": Profile(0.80, 0.05, 100_000_000),
    "DCGM_FI_PROF_SM_OCCUPANCY": Profile(0.40, 0.05, 100_000_000),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": Profile(0.50, 0.10, 100_000_000),
    "DCGM_FI_PROF_DRAM_ACTIVE": Profile(0.30, 0.05, 100_000_000),
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": Profile(0.0, 0.0, 100_000_000),
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": Profile(0.10, 0.02, 100_000_000),
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": Profile(0.05, 0.02, 100_000_000),
    "DCGM_FI_PROF_PCIE_TX_BYTES": Profile(1.0e9, 1.0e8, 100_000_000),
    "DCGM_FI_PROF_PCIE_RX_BYTES": Profile(2.0e9, 2.0e8, 100_000_000),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": Profile(5.0e10, 5.0e9, 100_000_000),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": Profile(6.0e10, 6.0e9, 100_000_000),
    # counters: energy and violation time follow the power and throttling signals instead
    # all 18 links' TX and RX below together: 1.1e11 B/s, in DCGM's KiB/s / 1000
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": Profile(107_000.0, 10_700.0, 100_000_000),
    "hfsampler_nvlink_data_bytes_total": Profile(0.0, 0.0, 100_000_000, rate_per_s=1.1e11),
    # per link: an 18th of the GPM totals above, and a trickle of link-level errors
    "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK": Profile(2.8e9, 2.8e8, 100_000_000),
    "DCGM_FI_DEV_NVLINK_RX_THROUGHPUT_PER_LINK": Profile(3.3e9, 3.3e8, 100_000_000),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL": Profile(0.0, 0.0, 100_000_000, 0.2),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_PER_LINK_TOTAL": Profile(0.0, 0.0, 100_000_000, 0.05),
}
_LEAK_MIB_PER_S = 20.0
NVLINKS = 18  # links per sim GPU, as an H200 has


def nvlink_up(gpu: int, link: int) -> bool:
    """Whether a sim GPU's link is up: all but the last, which is down on odd GPUs."""
    return 0 <= link < NVLINKS and not (gpu % 2 == 1 and link == NVLINKS - 1)


def _key(name: str, labels: tuple[tuple[str, str], ...] = ()) -> str:
    """The sim's name for a field: its catalogue name, and its own labels where it has them."""
    return name + "".join(f"{{{k}={v}}}" for k, v in labels)


def _base(key: str) -> str:
    """The catalogue name in a ``_key``."""
    return key.split("{", 1)[0]


@dataclass(frozen=True, slots=True)
class Spike:
    """A transient power spike: its plateau ``[start_ns, end_ns)`` at ``peak_w``."""

    gpu: int
    start_ns: int
    end_ns: int
    peak_w: float


@dataclass(frozen=True, slots=True)
class Throttle:
    """A throttling episode ``[start_ns, end_ns)``."""

    gpu: int
    start_ns: int
    end_ns: int


def _mix(x: U64) -> U64:
    """splitmix64's finaliser: a fast, well-spread hash of uint64 arrays (wraps by design)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_KEY_MULT = np.uint64(0x9E3779B97F4A7C15)


def _unit(seed: int, *keys: npt.ArrayLike) -> FloatArray:
    """Deterministic uniform [0, 1) numbers from integer keys (broadcast together)."""
    h: U64 = np.atleast_1d(np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
    for k in keys:
        h = h * _KEY_MULT + np.atleast_1d(np.asarray(k, dtype=np.int64)).astype(np.uint64)
    return (_mix(h) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _field_key(name: str) -> int:
    return int(sum(ord(c) * 31**i for i, c in enumerate(name)) & 0x7FFFFFFF)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Per field tuple, what ``read`` needs as arrays, built once."""

    keys: IntArray
    base: FloatArray
    noise: FloatArray
    noisy: IntArray  # the columns whose noise is not 0: the only ones hashed
    refresh_ns: IntArray
    shaped: tuple[tuple[int, str], ...]  # columns with their own shape (spikes, leak, throttle)
    counters: tuple[tuple[int, str], ...]
    cost_s: float  # what one read of these fields takes in the "driver" (slept, GIL released)
    absent: BoolArray | None  # [gpu, field]: a link that is down there (NaN), None: none


_SHAPED = frozenset(
    r.name
    for r in (POWER_INSTANT, POWER_AVERAGE, SM_CLOCK, CLOCK_EVENTS, FB_USED, FB_FREE, GPU_UTIL)
)
_COUNTER_NAMES = tuple(f.name for f in CATALOGUE if f.kind is Kind.COUNTER)
_DEFAULT_PROFILE = Profile(0.0, 0.0, 100_000_000)
_BLOCK_MS = 100  # rows computed at once, ahead, for a reader that comes back every few ms
_CATCH_UP_MS = 10  # rows computed on the reader's thread when none were ahead (0.4 ms at 64 GPUs)
_FREQUENT_MS = 5
_MAX_READERS = 64  # tuples cached by identity: a caller making one per read must not grow it
_EVENT_BUCKETS_MAX = 64  # buckets one event table spans; wider asks are computed directly
_EVENT_TABLES_MAX = 256  # tables kept before the cache starts over


@dataclass(slots=True)
class _Block:
    """Precomputed reads: ``values[row, gpu, field]`` for the millisecond ``start_ms + row``."""

    start_ms: int
    values: FloatArray
    driver_ts_us: IntArray  # [row, field]
    last_ms: int


@dataclass(slots=True)
class _Reader:
    """One field set's own state: its plan, precomputed rows and counters (one thread reads it)."""

    fields: Sequence[Field] | None  # the tuple this reader is cached for by identity
    plan: _Plan
    block: _Block | None = None
    ahead: Ahead[_Block] | None = None  # the block after ``block``, for a frequent reader
    counters: dict[str, FloatArray] | None = None
    last_ns: int = 0


# per (gpu, bucket) of one kind of event, raveled gpu-major: start, end, peak
_EventTable = tuple[IntArray, IntArray, FloatArray]


class SimSource:
    """N synthetic GPUs whose every reading, and every spike, is known in advance."""

    def __init__(
        self,
        gpus: int = 2,
        seed: int = 0,
        read_cost_s: Mapping[str, float] | None = None,
        mig: Sequence[str] = (),
    ) -> None:
        if gpus < 1:
            raise ValueError("the sim source needs at least one GPU")
        self.gpus = gpus
        self.seed = seed
        self._read_cost_s = dict(read_cost_s or {})
        self._gpu_ids = np.arange(gpus, dtype=np.int64)
        self._up = np.ones(gpus, dtype=np.bool_)  # a sim GPU is never lost
        self._plans: dict[tuple[str, ...], _Plan] = {}
        self._readers_by_id: dict[int, _Reader] = {}  # the sampler's tuples, by identity
        self._readers: dict[tuple[str, ...], _Reader] = {}  # any other sequence, by names
        self._events: dict[tuple[str, int, int], _EventTable] = {}
        self._devices: tuple[DeviceInfo, ...] = ()
        self._mig = tuple(mig)  # every GPU's MIG layout (sim_mig), () for none
        self._spreads: dict[int, tuple[Sequence[Field], sim_mig.Spread]] = {}
        self._ahead = Helper(self)

    # -- the Source protocol ---------------------------------------------------------------------

    def open(self, fields: Sequence[Field]) -> Inventory:
        devices = tuple(
            DeviceInfo(
                index=i,
                uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'hfsampler-sim/{self.seed}/{i}')}",
                model_name="hfsampler sim H200",
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                driver_version="sim-1.0",
                minor_number=i,
            )
            for i in range(self.gpus)
        )
        # the sim imitates NVML GPUs: a field only a Jetson's sysfs has is not there
        fields = tuple(
            out for f in fields
            for out in ([f.instance(str(k)) for k in range(NVLINKS)]
                        if f.per == "link" and not f.labels else [f])
        )  # fmt: skip
        if self._mig:
            devices = (*devices, *sim_mig.slot_rows(devices, self._mig, self.seed))
            self._up = np.array([d.is_gpu or d.mig is not None for d in devices], np.bool_)
        self._devices = devices
        supported = sim_mig.supported(fields, devices)
        supported[: self.gpus] &= ~self._link_down(fields)
        return Inventory(devices, fields, supported)

    def read(
        self, fields: Sequence[Field], values: FloatArray, driver_ts_us: IntArray, now_ns: int
    ) -> None:
        reader = self._readers_by_id.get(id(fields))
        if reader is None or reader.fields is not fields:
            reader = self._reader(fields)  # the sampler passes the same tuple every tick
        plan = reader.plan
        if plan.cost_s:
            time.sleep(plan.cost_s)
        # Every refresh period is a whole number of milliseconds, so a read is that millisecond's
        # row; a frequent reader gets a block of rows computed in one vectorised call.
        ms = now_ns // 1_000_000
        block = reader.block
        if block is None or not block.start_ms <= ms < block.start_ms + len(block.values):
            block = reader.block = self._next_block(reader, ms)
        block.last_ms = ms
        row = ms - block.start_ms
        g = self.gpus
        values[:g] = block.values[row]
        driver_ts_us[:g] = block.driver_ts_us[row]
        if plan.counters:
            counters = self._advance_counters(reader, now_ns)
            for j, name in plan.counters:
                values[:g, j] = counters[name]
        if plan.absent is not None:  # [gpu, field]: the GPUs' rows
            values[:g][plan.absent] = np.nan
            driver_ts_us[:g][plan.absent] = 0
        if self._mig:
            values[g:] = np.nan
            driver_ts_us[g:] = 0
            sim_mig.spread(self._spread(fields), g, values, driver_ts_us)

    @property
    def gpu_up(self) -> BoolArray:
        return self._up

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._devices

    def close(self) -> None:
        self._readers_by_id.clear()  # counters start over on the next read
        self._readers.clear()
        self._ahead.close()

    def _spread(self, fields: Sequence[Field]) -> sim_mig.Spread:
        found = self._spreads.get(id(fields))
        if found is None or found[0] is not fields:
            found = (fields, sim_mig.plan(fields, self._devices))
            if len(self._spreads) < _MAX_READERS:
                self._spreads[id(fields)] = found
        return found[1]

    # -- ground truth ----------------------------------------------------------------------------

    def read_processes(self, job_pids: Collection[int], now_ns: int) -> dict[int, list[GpuProcess]]:
        """The job's processes share every GPU: the k-th of n pids (in pid order) holds the
        share (n - k) / (1 + ... + n) of the GPU's memory used and of its utilisation at
        ``now_ns``, so the shares add up to the GPU's own values."""
        pids = sorted(job_pids)
        if not pids:
            return {}
        n = len(pids)
        shares = np.arange(n, 0, -1) / (n * (n + 1) / 2)
        used_mib = self.value_at(FB_USED.names[0], now_ns)
        util = self.value_at(GPU_UTIL.names[0], now_ns)
        return {
            g: [GpuProcess(pid, round(float(used_mib[g] * share) * 2**20), float(util[g] * share))
                for pid, share in zip(pids, shares, strict=True)]
            for g in range(self.gpus)
        }  # fmt: skip

    def value_at(
        self,
        name: str,
        t_ns: npt.ArrayLike,
        gpu: npt.ArrayLike | None = None,
        labels: tuple[tuple[str, str], ...] = (),
    ) -> FloatArray:
        """A gauge's exact value at ``t_ns`` (for every GPU, or for ``gpu`` broadcast with t).

        The time is the driver's sampling instant: a reading at ``now`` reports the value at the
        start of the field's refresh period, as ``read`` does. ``labels``: an instance's own
        (``(("link", "3"),)``), for a field that has several.
        """
        t = np.asarray(t_ns, dtype=np.int64)
        g = self._gpu_ids if gpu is None else np.asarray(gpu, dtype=np.int64)
        t, g = np.broadcast_arrays(t, g)
        plan = self._plan((_key(name, labels),))
        out = self._signal(plan, g.ravel(), t.reshape(-1, 1))
        return out[:, 0].reshape(t.shape)

    def refresh_ns(self, name: str) -> int:
        return _PROFILES.get(name, _DEFAULT_PROFILE).refresh_ns

    def spikes(self, gpu: int, t0_ns: int, t1_ns: int) -> list[Spike]:
        """Every spike whose plateau starts in ``[t0_ns, t1_ns)`` on ``gpu``."""
        out = []
        for bucket in range(t0_ns // _SPIKE_BUCKET_NS, t1_ns // _SPIKE_BUCKET_NS + 1):
            start, end, peak = self._spike_params(np.array([gpu]), np.array([bucket]))
            if end[0] > start[0] and t0_ns <= start[0] < t1_ns:
                out.append(Spike(gpu, int(start[0]), int(end[0]), float(peak[0])))
        return out

    def throttles(self, gpu: int, t0_ns: int, t1_ns: int) -> list[Throttle]:
        """Every throttling episode that overlaps ``[t0_ns, t1_ns)`` on ``gpu``."""
        out = []
        for bucket in range(t0_ns // _THROTTLE_BUCKET_NS, t1_ns // _THROTTLE_BUCKET_NS + 1):
            start, end, _ = self._throttle_params(np.array([gpu]), np.array([bucket]))
            if end[0] > start[0] and start[0] < t1_ns and end[0] > t0_ns:
                out.append(Throttle(gpu, int(start[0]), int(end[0])))
        return out

    # -- the signals -----------------------------------------------------------------------------

    def _link_down(self, fields: Sequence[Field]) -> BoolArray:
        """[gpu, field]: the field is a link's that is down on the GPU."""
        down = np.zeros((self.gpus, len(fields)), dtype=np.bool_)
        for j, f in enumerate(fields):
            link = dict(f.labels).get("link") if f.per == "link" else None
            if link is not None:
                down[:, j] = [not nvlink_up(g, int(link)) for g in range(self.gpus)]
        return down

    def _reader(self, fields: Sequence[Field]) -> _Reader:
        names = tuple(_key(f.name, f.labels) for f in fields)
        if not isinstance(fields, tuple) or len(self._readers_by_id) >= _MAX_READERS:
            reader = self._readers.get(names)
            if reader is None:
                reader = self._readers[names] = _Reader(None, self._plan(names, fields))
            return reader
        # Keyed by identity, so the hot path skips the names; the reader keeps the tuple alive,
        # so its id cannot be reused while the entry exists.
        reader = _Reader(fields, self._plan(names, fields))
        self._readers_by_id[id(fields)] = reader
        return reader

    def _plan(self, names: tuple[str, ...], fields: Sequence[Field] = ()) -> _Plan:
        plan = self._plans.get(names)
        if plan is None:
            profiles = [_PROFILES.get(_base(n), _DEFAULT_PROFILE) for n in names]
            down = self._link_down(fields) if fields else None
            plan = _Plan(
                keys=np.array([_field_key(n) for n in names], dtype=np.int64),
                base=np.array([p.base for p in profiles]),
                noise=np.array([p.noise for p in profiles]),
                noisy=np.array([j for j, p in enumerate(profiles) if p.noise], dtype=np.intp),
                refresh_ns=np.array([p.refresh_ns for p in profiles], dtype=np.int64),
                shaped=tuple((j, n) for j, n in enumerate(names) if n in _SHAPED),
                counters=tuple((j, n) for j, n in enumerate(names) if _base(n) in _COUNTER_NAMES),
                cost_s=sum(self._read_cost_s.get(_base(n), 0.0) for n in names),
                absent=down if down is not None and down.any() else None,
            )
            self._plans[names] = plan  # two threads making the same plan: either one is kept
        return plan

    def _next_block(self, reader: _Reader, ms: int) -> _Block:
        """The block for ``ms``: the one computed ahead when it holds ``ms``; else computed here,
        a few rows only for a frequent reader (the helper has that long to compute the next
        block). A frequent reader then asks the helper thread for the block after it."""
        old, ahead = reader.block, reader.ahead
        reader.ahead = None
        block = None
        if ahead is not None and ahead.start_ms <= ms < ahead.start_ms + _BLOCK_MS:
            block = Helper.wait(ahead)  # seldom still at it: it had the last block's time
        if block is None:
            frequent = old is not None and 0 <= ms - old.last_ms <= _FREQUENT_MS
            block = self._block(reader.plan, ms, _CATCH_UP_MS if frequent else 1)
        if len(block.values) > 1:
            start_ms, plan = block.start_ms + len(block.values), reader.plan
            reader.ahead = self._ahead.ask(start_ms, lambda: self._block(plan, start_ms, _BLOCK_MS))
        return block

    def _block(self, plan: _Plan, ms: int, rows: int) -> _Block:
        """``rows`` milliseconds of every GPU's values from ``ms`` on, computed in one call."""
        grid = (ms + np.arange(rows, dtype=np.int64)) * 1_000_000
        sampled = grid[:, None] - grid[:, None] % plan.refresh_ns  # [T, F] refresh instants
        g = np.tile(self._gpu_ids, rows)  # rows are (time, gpu) pairs, time-major
        t = np.repeat(sampled, self.gpus, axis=0)
        values = self._signal(plan, g, t).reshape(rows, self.gpus, -1)
        return _Block(ms, values, sampled // 1000, ms)

    def _signal(self, plan: _Plan, g: IntArray, t: IntArray) -> FloatArray:
        """Values ``[len(g), F]`` of the plan's fields at times ``t`` (same shape)."""
        # base + 0 * noise is base: where few columns have noise (5 of the fast group's 12),
        # only they are hashed, the most of a block's work
        noisy = plan.noisy
        out: FloatArray
        if 2 * len(noisy) > len(plan.base):
            ms = t // 1_000_000
            out = plan.base + (_unit(self.seed, g[:, None], plan.keys, ms) * 2.0 - 1.0) * plan.noise
        else:
            out = np.empty((len(g), len(plan.base)))
            out[:] = plan.base
            if len(noisy):
                ms = t[:, noisy] // 1_000_000
                unit = _unit(self.seed, g[:, None], plan.keys[noisy], ms)
                out[:, noisy] += (unit * 2.0 - 1.0) * plan.noise[noisy]
        throttled: dict[int, npt.NDArray[np.bool_]] = {}  # by refresh: one lookup per period
        for j, name in plan.shaped:
            out[:, j] = self._shape(name, g, t[:, j], out[:, j], throttled, int(plan.refresh_ns[j]))
        return out

    def _shape(
        self,
        name: str,
        g: IntArray,
        t: IntArray,
        flat: FloatArray,
        throttled_by: dict[int, npt.NDArray[np.bool_]],
        refresh_ns: int,
    ) -> FloatArray:
        """Column ``name``'s values, from its flat ``base + noise``; ``throttled_by`` keeps the
        throttling mask of each refresh period met (columns of one period share their ``t``)."""
        if name in (FB_USED.name, FB_FREE.name):
            leaked = (t % _LEAK_PERIOD_NS) / 1e9 * _LEAK_MIB_PER_S
            used = FB_USED_MIB + leaked + g * 1000.0
            if name == FB_USED.name:
                return used
            return FB_TOTAL_MIB - used - FB_RESERVED_MIB
        if name == GPU_UTIL.name:
            return np.clip(flat, 0.0, 100.0)
        throttled = throttled_by.get(refresh_ns)
        if throttled is None:
            throttled = throttled_by[refresh_ns] = self._within(
                _THROTTLE_BUCKET_NS, "throttle", g, t
            )[0]
        if name == SM_CLOCK.name:
            return np.where(throttled, 1500.0, flat)
        if name == CLOCK_EVENTS.name:
            return np.where(throttled, float(SW_POWER_CAP_BIT), 0.0)
        capped = POWER_CAP_W * 0.6
        value = np.where(throttled, np.minimum(flat + g * 10.0, capped), flat + g * 10.0)
        if name == POWER_AVERAGE.name:
            return value
        # instant power: spikes on top, halfway up on the 1 ms ramps either side
        plateau, peak, rel = self._within(_SPIKE_BUCKET_NS, "spike", g, t)
        ramp = ((rel >= -_SPIKE_RAMP_NS) & (rel < 0)) | (
            (rel >= _SPIKE_PLATEAU_NS) & (rel < _SPIKE_PLATEAU_NS + _SPIKE_RAMP_NS)
        )
        has_spike = peak > 0
        value = np.where(has_spike & ramp, (peak + value) / 2.0, value)
        return np.where(plateau, peak, value)

    def _within(
        self, bucket_ns: int, kind: str, g: IntArray, t: IntArray
    ) -> tuple[npt.NDArray[np.bool_], FloatArray, IntArray]:
        """Whether each t is inside its bucket's event, the event's peak, and t - event start."""
        bucket = t // bucket_ns
        start, end, peak = self._event_params(kind, g, bucket)
        rel: IntArray = (t - start).astype(np.int64)
        return (t >= start) & (t < end), peak.astype(np.float64), rel

    def _event_params(
        self, kind: str, g: IntArray, bucket: IntArray
    ) -> tuple[IntArray, IntArray, FloatArray]:
        """Each (gpu, bucket)'s event, from a table per span of buckets computed once.

        Buckets are 1 s (spikes) or 10 s (throttling) long: the rows a read needs seldom span
        more than one, so a table of every GPU's events there is a few entries, looked up
        instead of hashed for every row and field. The same numbers as ``params(g, bucket)``.
        """
        params = self._spike_params if kind == "spike" else self._throttle_params
        if not bucket.size or not g.size:
            return params(g, bucket)
        lo, hi = int(bucket.min()), int(bucket.max())
        if hi - lo >= _EVENT_BUCKETS_MAX or int(g.min()) < 0 or int(g.max()) >= self.gpus:
            return params(g, bucket)
        key = (kind, lo, hi)
        table = self._events.get(key)
        if table is None:
            width = hi - lo + 1
            gpu = np.repeat(self._gpu_ids, width)
            table = params(gpu, np.tile(np.arange(lo, hi + 1, dtype=np.int64), self.gpus))
            if len(self._events) >= _EVENT_TABLES_MAX:
                self._events.clear()
            self._events[key] = table  # whole, once made: another thread sees it or none
        at = g * (hi - lo + 1) + (bucket - lo)
        start, end, peak = table
        return start[at], end[at], peak[at]

    def _spike_params(self, g: IntArray, bucket: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
        exists = _unit(self.seed, g, bucket, 1) < _SPIKE_PROBABILITY
        offset = 50_000_000 + (_unit(self.seed, g, bucket, 2) * 850_000_000).astype(np.int64)
        start = bucket * _SPIKE_BUCKET_NS + offset
        # whole watts, so a test can compare the pushed _max with the truth exactly
        peak = np.where(exists, np.round(720.0 + _unit(self.seed, g, bucket, 3) * 180.0), 0.0)
        return start, np.where(exists, start + _SPIKE_PLATEAU_NS, start), peak

    def _throttle_params(
        self, g: IntArray, bucket: IntArray
    ) -> tuple[IntArray, IntArray, FloatArray]:
        exists = _unit(self.seed, g, bucket, 11) < _THROTTLE_PROBABILITY
        offset = (_unit(self.seed, g, bucket, 12) * 8_000_000_000).astype(np.int64)
        start = bucket * _THROTTLE_BUCKET_NS + offset
        length = 200_000_000 + (_unit(self.seed, g, bucket, 13) * 600_000_000).astype(np.int64)
        return start, np.where(exists, start + length, start), exists.astype(np.float64)

    def _advance_counters(self, reader: _Reader, now_ns: int) -> dict[str, FloatArray]:
        """The reader's counters at ``now_ns``: zero (energy: an offset) at its first read."""
        counters = reader.counters
        if counters is None:
            reader.last_ns = now_ns
            counters = reader.counters = {
                name: np.zeros(self.gpus) for _, name in reader.plan.counters
            }
            energy = counters.get(ENERGY.name)
            if energy is not None:
                energy += 1.0e9 + self._gpu_ids * 1e7
            return counters
        dt_ns = now_ns - reader.last_ns
        if dt_ns <= 0:
            return counters
        reader.last_ns = now_ns
        t = np.full(self.gpus, now_ns, dtype=np.int64)
        energy = counters.get(ENERGY.name)
        if energy is not None:
            energy += self.value_at(POWER_AVERAGE.name, t) * dt_ns / 1e6  # mJ
        violation = counters.get(POWER_VIOLATION.name)
        if violation is not None:
            throttled = self._within(_THROTTLE_BUCKET_NS, "throttle", self._gpu_ids, t)[0]
            violation += np.where(throttled, float(dt_ns), 0.0)  # ns, as NVML counts it
        for name, counter in counters.items():
            rate = _PROFILES.get(_base(name), _DEFAULT_PROFILE).rate_per_s
            if rate:
                counter += rate * dt_ns / 1e9
        return counters

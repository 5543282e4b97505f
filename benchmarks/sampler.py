"""Benchmark: the sampler's tick lateness, missed ticks, CPU and memory at 1 kHz on sim GPUs.

Scenarios: {1, 8} sim GPUs x {idle, busy} parent, and with a busy parent a slow read: the slow
group's ECC field takes 5 ms (slept with the GIL released, as a slow NVML query waits in the
driver) on every slow tick, every 100 ms. The parent runs a uvloop event loop; "busy"
adds what a loaded hfsampler service does in the same interpreter: coroutines doing pure-Python
work in chunks of 1-5 ms, and JSON and protobuf-style encoding of a window every 50 ms, so the
parent holds the GIL and keeps a core busy. Like the service, the parent reads the rings once a
second (in an executor) and reduces the window; every tick's lateness comes from
``rows.lateness_ns``, missed ticks from the sampler's counters.

The floor: a bare 1 kHz sleep loop that does no work, in a process of its own, under the same
scheduling as the row it divides (normal; a 100 µs EEVDF slice; SCHED_FIFO 10): a real-time
sampler compared with a normal-priority floor would flatter itself. It opens the run alone with an
idle parent, once per scheduling policy (the floor the table's "xstart" ratio divides by, as in
issue 16), and runs again before each scenario, under that scenario's parent (idle or busy),
neighbours and scheduling, just before the sampler starts ("xbefore"): the machine is shared,
and what it allows moves from minute to minute. (Run beside the sampler instead, the floor
waited behind the sampler's own lanes and measured them.)

A peer in the same run for the busy scenarios, ``one-lane``: the design the two lanes replace,
every group in one deadline loop in a process of its own, reading the same sim source into the
same rings, so a slow read delays the next fast tick.

The peer, in the same run: the design the process split replaces, the same deadline loop (sleep to
the deadline, spin the process's calibrated ``spin_s``, read the same sim source, write the same
rings) run as a thread inside the same parent. The table shows thread / process p99 as a ratio.

Two variants of the process with a busy parent measure what the sampler would gain by asking the
scheduler for more: a 100 µs EEVDF slice (``sched_setattr``, unprivileged on Linux >= 6.12) and
SCHED_FIFO (root or CAP_SYS_NICE), both set on the sampler's pid from here after it starts. Each
row also shows how long the sampler waited, runnable, for a CPU (``/proc/<pid>/schedstat``).

Also measured: the sampler's CPU (every thread's ``schedstat`` run time, exact to the ns), per
GPU, beside the floor's (what waking 1000 times a second costs on this machine, paid by any
sampler); RSS, PSS and USS (``/proc/<pid>/smaps_rollup``) of the sampler and the parent; ring
bytes; and ``SimSource.read`` alone per group, to tell the source's cost from the loop's.

    python benchmarks/sampler.py [--seconds 10] [--gpus 1,8] [--out benchmarks/out/sampler.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import multiprocessing
import os
import platform
import random
import struct
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hfsampler import fields as catalogue
from hfsampler.sampling.groups import GroupPlan, plan_groups
from hfsampler.sampling.lanes import reduce_timer_slack
from hfsampler.sampling.ring import Ring, SharedInts
from hfsampler.sampling.sampler import Sampler, ring_capacity
from hfsampler.sampling.window import WindowClock, reduce, suffixes
from hfsampler.sources.base import Inventory, SourceSpec
from hfsampler.sources.registry import open_source

WINDOW_S = 1.0
SHORT_SLICE_S = 100e-6  # the shortest slice EEVDF accepts
FIFO_PRIORITY = 10  # what the +fifo rows set on the sampler, and so on their floor
WARMUP_S = 1.0
LATE_NS = 200_000  # the sampler's default late threshold at 1 ms
SLOW_CALL_S = 0.005  # the slow scenario's ECC read, on every slow tick (100 ms)
SLOW_FIELD = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
TARGETS = {
    "p99_lateness_busy_us": 200.0,
    "p99_over_floor": 1.5,  # the floor alone at the start of the run, as in issue 16's table
    "p99_over_floor_before": 1.5,  # the floor under the scenario's parent, just before it
    "missed_pct": 0.1,
    "cpu_per_gpu_pct": 3.0,
    "rss_8gpu_mb": 80.0,
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
MB = 1024 * 1024


# -- /proc readings ------------------------------------------------------------------------------


def cpu_seconds(stat_path: str) -> float:
    """utime + stime of a process or thread, in seconds."""
    text = Path(stat_path).read_text()
    after_comm = text[text.rindex(")") + 2 :].split()
    return (int(after_comm[11]) + int(after_comm[12])) / CLK_TCK  # fields 14 and 15


def run_seconds(pid: int) -> float:
    """CPU time of every thread of a process, from ``schedstat`` (ns, not clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def sched_wait(task_dir: str) -> tuple[float, int]:
    """Seconds spent runnable but waiting for a CPU, and involuntary context switches."""
    run_delay_ns = int(Path(f"{task_dir}/schedstat").read_text().split()[1])
    preempted = 0
    for line in Path(f"{task_dir}/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            preempted = int(line.split()[1])
    return run_delay_ns / 1e9, preempted


def cpu_pressure() -> str | None:
    """The kernel's CPU pressure line (PSI): how often runnable tasks waited for a CPU."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None


def memory_mb(pid: int) -> dict[str, float]:
    """RSS and peak RSS, and where the kernel has them PSS, PSS of shared memory and USS, in MB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "rss_peak"] = int(value.split()[0]) * 1024 / MB
    with contextlib.suppress(OSError):
        kb: dict[str, int] = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, _, value = line.partition(":")
            kb[key] = int(value.split()[0])
        out["pss"] = kb["Pss"] * 1024 / MB
        if "Pss_Shmem" in kb:
            out["pss_shmem"] = kb["Pss_Shmem"] * 1024 / MB
        out["uss"] = (kb["Private_Clean"] + kb["Private_Dirty"]) * 1024 / MB
    return out


# -- the busy parent -----------------------------------------------------------------------------


@dataclass
class Load:
    """What the busy parent got done: its throughput falls when a sampling thread steals the GIL."""

    chunks: int = 0
    units: int = 0
    encodes: int = 0
    encoded_bytes: int = 0


def _cpu_unit(i: int) -> int:
    """One unit of service-like pure-Python work: build, sort and hash a label set."""
    labels = {f"label_{k}": f"value_{(i * 31 + k * 17) % 97}" for k in range(12)}
    text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return hash(text) & 0xFF


async def cpu_worker(load: Load, seed: int) -> None:
    """Hold the loop (and the GIL) for 1-5 ms at a time, then yield to the others."""
    rng = random.Random(seed)
    clock = time.perf_counter
    i = 0
    while True:
        end = clock() + rng.uniform(0.001, 0.005)
        while clock() < end:
            _cpu_unit(i)
            i += 1
            load.units += 1
        load.chunks += 1
        await asyncio.sleep(0)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_window(gpus: int, fields: Sequence[str], t_ms: int, rng: random.Random) -> int:
    """Encode one window like the service's outputs: a JSON document and protobuf-style bytes."""
    stats = suffixes(catalogue.Kind.GAUGE)
    doc: list[dict[str, Any]] = [
        {"name": name + s, "gpu": str(g), "value": rng.random() * 700.0, "t": t_ms}
        for g in range(gpus)
        for name in fields
        for s in stats
    ]
    payload = json.dumps(doc).encode()
    wire = bytearray()
    ts = _varint(t_ms)
    for sample in doc:
        labels = b"".join(
            b"\x0a" + _varint(len(v)) + v for v in (sample["name"].encode(), sample["gpu"].encode())
        )
        body = b"\x0a" + _varint(len(labels)) + labels
        body += b"\x12\x0b\x09" + struct.pack("<d", sample["value"]) + b"\x10" + ts[:1]
        wire += b"\x0a" + _varint(len(body)) + body
    return len(payload) + len(wire)


async def encode_worker(load: Load, gpus: int, names: Sequence[str], seed: int) -> None:
    rng = random.Random(seed)
    while True:
        load.encoded_bytes += encode_window(gpus, names, time.time_ns() // 1_000_000, rng)
        load.encodes += 1
        await asyncio.sleep(0.05)


# -- the peer: the same deadline loop as a thread in the parent ----------------------------------


class ThreadSampler:
    """The design the process split replaced: the deadline loop on a thread of the parent."""

    def __init__(self, spec: SourceSpec, groups: Sequence[GroupPlan], gpus: int, spin_s: float):
        self.spec = spec
        self.groups = tuple(groups)
        self.spin_ns = int(spin_s * 1e9)
        self.rings = {
            g.name: Ring.create(ring_capacity(g.interval_s, WINDOW_S), gpus, len(g.fields))
            for g in self.groups
        }
        self.counts = [[0, 0, 0] for _ in self.groups]  # ticks, late, missed
        self.native_id: int | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="bench-sampler-thread", daemon=True)

    @property
    def shared_bytes(self) -> int:
        return sum(r.nbytes for r in self.rings.values())

    def start(self) -> None:
        self._thread.start()
        while self.native_id is None:
            time.sleep(0.01)

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(5.0)
        for r in self.rings.values():
            r.close()

    def _run(self) -> None:
        reduce_timer_slack()
        src = open_source(self.spec)
        src.open([f for g in self.groups for f in g.fields])
        rings = [self.rings[g.name] for g in self.groups]
        fields = [g.fields for g in self.groups]
        intervals = [int(g.interval_s * 1e9) for g in self.groups]
        n, spin_ns = len(intervals), self.spin_ns
        now = time.perf_counter_ns()
        phase = min(intervals) // n
        deadlines = [now - now % iv + iv + k * phase for k, iv in enumerate(intervals)]
        perf_ns, wall_ns, sleep = time.perf_counter_ns, time.time_ns, time.sleep
        self.native_id = threading.get_native_id()
        while not self._stop:
            i = min(range(n), key=deadlines.__getitem__)
            deadline = deadlines[i]
            remaining = deadline - perf_ns()
            if remaining > spin_ns:
                sleep((remaining - spin_ns) / 1e9)
            while perf_ns() < deadline:
                pass
            lateness = perf_ns() - deadline
            missed = lateness // intervals[i]
            lateness -= missed * intervals[i]
            deadline += missed * intervals[i]
            values, driver = rings[i].slot()
            read_at = wall_ns()
            src.read(fields[i], values, driver, read_at)
            rings[i].commit(read_at, lateness)
            c = self.counts[i]
            c[0] += 1
            c[1] += lateness > LATE_NS
            c[2] += missed
            deadlines[i] = deadline + intervals[i]
        src.close()


# -- the peer: every group in one deadline loop, in its own process --------------------------------


class OneLaneSampler:
    """The design the two lanes replaced: one loop in a process of its own reads every group."""

    def __init__(self, spec: SourceSpec, groups: Sequence[GroupPlan], gpus: int, spin_s: float):
        self.spec = spec
        self.groups = tuple(groups)
        self.spin_ns = int(spin_s * 1e9)
        self.rings = {
            g.name: Ring.create(ring_capacity(g.interval_s, WINDOW_S), gpus, len(g.fields))
            for g in self.groups
        }
        self.status = SharedInts.create(2 + 3 * len(self.groups))  # stop, running, counts
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def shared_bytes(self) -> int:
        return sum(r.nbytes for r in self.rings.values())

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def counts(self, k: int) -> tuple[int, int, int]:
        s = self.status.array
        return int(s[2 + 3 * k]), int(s[3 + 3 * k]), int(s[4 + 3 * k])

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        names = tuple(self.rings[g.name].name for g in self.groups)
        args = (self.spec, self.groups, names, self.status.name, self.spin_ns)
        self._process = ctx.Process(target=_one_lane_main, args=args, daemon=True)
        self._process.start()
        while not self.status.array[1]:
            time.sleep(0.01)

    def close(self) -> None:
        self.status.array[0] = 1
        if self._process is not None:
            self._process.join(5.0)
        for r in self.rings.values():
            r.close()
        self.status.close()


def _one_lane_main(
    spec: SourceSpec, groups: Sequence[GroupPlan], ring_names: Sequence[str], status: str, spin: int
) -> None:
    """The sampler's loop before it had two lanes: sleep to the earliest deadline of any group."""
    reduce_timer_slack()
    shared = SharedInts.attach(status)
    rings = [Ring.attach(name) for name in ring_names]
    s = shared.array
    src = open_source(spec)
    src.open([f for g in groups for f in g.fields])
    fields = [g.fields for g in groups]
    intervals = [int(g.interval_s * 1e9) for g in groups]
    last = [np.full((spec.gpus, len(g.fields)), -1, dtype=np.int64) for g in groups]
    n = len(intervals)
    now = time.perf_counter_ns()
    phase = min(intervals) // n
    deadlines = [now - now % iv + iv + k * phase for k, iv in enumerate(intervals)]
    perf_ns, wall_ns, sleep = time.perf_counter_ns, time.time_ns, time.sleep
    s[1] = 1
    while not s[0]:
        i = min(range(n), key=deadlines.__getitem__)
        deadline = deadlines[i]
        remaining = deadline - perf_ns()
        if remaining > spin:
            sleep((remaining - spin) / 1e9)
        while perf_ns() < deadline:
            pass
        lateness = perf_ns() - deadline
        missed = lateness // intervals[i]
        lateness -= missed * intervals[i]
        deadline += missed * intervals[i]
        values, driver = rings[i].slot()
        read_at = wall_ns()
        src.read(fields[i], values, driver, read_at)
        values[driver == last[i]] = np.nan
        last[i][...] = driver
        rings[i].commit(read_at, lateness)
        s[2 + 3 * i] += 1
        s[3 + 3 * i] += lateness > LATE_NS
        s[4 + 3 * i] += missed
        deadlines[i] = deadline + intervals[i]
    src.close()
    for r in rings:
        r.close()
    shared.close()


# -- one scenario --------------------------------------------------------------------------------


@dataclass
class Scenario:
    gpus: int
    busy: bool
    # "process"; "process+slice" / "process+fifo": a 100 µs EEVDF slice / SCHED_FIFO set on it
    # from here, to measure what the sampler would gain by asking for them; "thread" and
    # "one-lane": the peers
    kind: str
    slow_call_s: float = 0.0  # the slow group's ECC read takes this long (0: as the sim is)

    @property
    def label(self) -> str:
        slow = f", {self.slow_call_s * 1e3:g} ms slow read" if self.slow_call_s else ""
        return f"{self.gpus} GPU, {'busy' if self.busy else 'idle'} parent, {self.kind}{slow}"

    @property
    def in_process(self) -> bool:
        return self.kind.startswith("process")

    @property
    def policy(self) -> str:
        """The scheduling the sampler runs under, and so the floor its rows are divided by."""
        return policy_of(self.kind)


def policy_of(kind: str) -> str:
    """``fifo`` (SCHED_FIFO 10), ``slice`` (a 100 µs EEVDF slice) or ``normal``, from a kind."""
    return kind.rsplit("+", 1)[1] if "+" in kind else "normal"


@dataclass
class Collected:
    lateness_ns: list[npt.NDArray[np.int64]] = field(default_factory=list)
    slow_lateness_ns: list[npt.NDArray[np.int64]] = field(default_factory=list)
    lost_rows: int = 0
    reduce_s: list[float] = field(default_factory=list)


def lateness_stats(parts: list[npt.NDArray[np.int64]]) -> dict[str, float]:
    late = np.concatenate(parts) / 1e3 if parts else np.empty(0)
    if not late.size:
        return {"ticks": 0}
    q = np.percentile(late, [50, 90, 99, 99.9])
    return {
        "ticks": int(late.size),
        "p50_us": float(q[0]),
        "p90_us": float(q[1]),
        "p99_us": float(q[2]),
        "p999_us": float(q[3]),
        "max_us": float(late.max()),
        "mean_us": float(late.mean()),
        "late_pct": float((late > LATE_NS / 1e3).mean() * 100),
    }


async def _collect(
    rings: dict[str, Ring], groups: Sequence[GroupPlan], seconds: float, out: Collected
) -> None:
    """Read every ring once a second, as the service does, until ``seconds`` have passed."""
    loop = asyncio.get_running_loop()
    seqs = {name: r.write_seq for name, r in rings.items()}

    def take(t0: int, t1: int) -> None:
        for k, g in enumerate(groups):
            seqs[g.name], rows, lost = rings[g.name].read_since(seqs[g.name])
            out.lost_rows += lost
            started = time.perf_counter()
            reduce(rows, g.fields, t0, t1)
            if k == 0:
                out.reduce_s.append(time.perf_counter() - started)
                out.lateness_ns.append(rows.lateness_ns.copy())
            else:
                out.slow_lateness_ns.append(rows.lateness_ns.copy())

    end = time.monotonic() + seconds
    clock = WindowClock(WINDOW_S)
    while time.monotonic() < end:
        await asyncio.sleep(clock.wait_s())
        await loop.run_in_executor(None, take, clock.t0_ns, clock.t1_ns)
        clock.advance()
        clock.catch_up()


AnySampler = Sampler | ThreadSampler | OneLaneSampler


def _counts(sampler: AnySampler, group_index: int) -> tuple[int, int, int]:
    if isinstance(sampler, Sampler):
        got = sampler.counters(group_index)
        return got.ticks, got.late, got.missed
    if isinstance(sampler, OneLaneSampler):
        return sampler.counts(group_index)
    ticks, late, missed = sampler.counts[group_index]
    return ticks, late, missed


async def run_scenario(
    sc: Scenario,
    inventory: Inventory,
    groups: list[GroupPlan],
    seconds: float,
    spin_s: float,
    floor_s: float,
) -> dict[str, Any]:
    loadavg_before = os.getloadavg()
    costs = ((SLOW_FIELD, sc.slow_call_s),) if sc.slow_call_s else ()
    spec = SourceSpec("sim", gpus=sc.gpus, sim_read_cost_s=costs)
    loop = asyncio.get_running_loop()
    load = Load()
    tasks: list[asyncio.Task[None]] = []
    sampler: AnySampler
    if sc.in_process:
        sampler = Sampler(spec, inventory, groups, window_s=WINDOW_S)
    elif sc.kind.startswith("one-lane"):
        sampler = OneLaneSampler(spec, groups, sc.gpus, spin_s)
    else:
        sampler = ThreadSampler(spec, groups, sc.gpus, spin_s)
    try:
        if sc.busy:
            names = [f.name for f in inventory.fields]
            workers: list[Coroutine[Any, Any, None]] = [cpu_worker(load, k) for k in range(8)]
            workers.append(encode_worker(load, sc.gpus, names, 99))
            tasks = [asyncio.create_task(w) for w in workers]
        # the floor under this scenario's parent, just before the sampler starts, at the
        # sampler's own priority: what the machine allows any sampler right now (run beside
        # it, it measured the sampler instead)
        floor = await loop.run_in_executor(None, platform_floor, floor_s, sc.policy)
        await loop.run_in_executor(None, sampler.start)
        if sc.kind.endswith("+fifo") and not isinstance(sampler, ThreadSampler) and sampler.pid:
            # what a real-time sampler would get: it preempts the parent and everyone else (set
            # on the main thread: the fast lane, or the one lane)
            os.sched_setscheduler(sampler.pid, os.SCHED_FIFO, os.sched_param(FIFO_PRIORITY))
        if sc.kind == "process+slice" and isinstance(sampler, Sampler) and sampler.pid:
            set_fair_slice(sampler.pid, SHORT_SLICE_S)
        await asyncio.sleep(WARMUP_S)
        pid = sampler.pid if not isinstance(sampler, ThreadSampler) else None
        if isinstance(sampler, ThreadSampler):
            task = f"/proc/self/task/{sampler.native_id}"
            spin = spin_s

            def cpu() -> float:
                return cpu_seconds(f"{task}/stat")
        else:
            assert pid is not None
            task = f"/proc/{pid}"  # its main thread: the fast lane
            spin = sampler.spin_s if isinstance(sampler, Sampler) else spin_s

            def cpu() -> float:
                return run_seconds(pid)

        counts0 = [_counts(sampler, i) for i in range(len(groups))]
        load0 = Load(load.chunks, load.units, load.encodes, load.encoded_bytes)
        wall0, wait0 = time.monotonic(), sched_wait(task)
        cpu0, parent0 = cpu(), cpu_seconds("/proc/self/stat")
        got = Collected()
        await _collect(sampler.rings, groups, seconds, got)
        wall1, wait1 = time.monotonic(), sched_wait(task)
        cpu1, parent1 = cpu(), cpu_seconds("/proc/self/stat")
        pressure = cpu_pressure()
        counts1 = [_counts(sampler, i) for i in range(len(groups))]
        mem = memory_mb(pid) if pid is not None else {}
        shared = sampler.shared_bytes
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await loop.run_in_executor(None, sampler.close)
    elapsed = wall1 - wall0
    ticks = counts1[0][0] - counts0[0][0]
    missed = counts1[0][2] - counts0[0][2]
    cpu_pct = (cpu1 - cpu0) / elapsed * 100
    fast = lateness_stats(got.lateness_ns)
    parent_cpu_pct = (parent1 - parent0) / elapsed * 100
    if sc.kind == "thread":
        parent_cpu_pct -= cpu_pct  # the rest of the parent, as for the process
    result: dict[str, Any] = {
        "gpus": sc.gpus,
        "parent": "busy" if sc.busy else "idle",
        "sampler": sc.kind,
        "slow_call_ms": sc.slow_call_s * 1e3,
        "seconds": elapsed,
        "spin_us": spin * 1e6,
        "fast": fast,
        "slow": lateness_stats(got.slow_lateness_ns),
        "groups": {
            g.name: dict(
                zip(("ticks", "late", "missed"), np.subtract(c1, c0).tolist(), strict=True)
            )
            for g, c0, c1 in zip(groups, counts0, counts1, strict=True)
        },
        "counter_ticks": ticks,
        "missed_ticks": missed,
        "missed_pct": missed / max(1, ticks + missed) * 100,
        "floor_before": floor,
        "p99_over_floor_before": fast.get("p99_us", float("nan")) / max(floor["p99_us"], 1e-9),
        "ring_lost_rows": got.lost_rows,
        "cpu_pct": cpu_pct,
        "cpu_per_gpu_pct": cpu_pct / sc.gpus,
        "cpu_us_per_fast_tick": (cpu1 - cpu0) / max(1, ticks) * 1e6,
        "runqueue_wait_ms_per_s": (wait1[0] - wait0[0]) / elapsed * 1e3,
        "preemptions_per_s": (wait1[1] - wait0[1]) / elapsed,
        "cpu_pressure": pressure,
        "parent_cpu_pct": parent_cpu_pct,
        "parent_work_units_per_s": (load.units - load0.units) / elapsed,
        "parent_encodes_per_s": (load.encodes - load0.encodes) / elapsed,
        "reduce_fast_ms_p50": float(np.median(got.reduce_s) * 1e3) if got.reduce_s else None,
        "sampler_memory_mb": mem,
        "parent_memory_mb": memory_mb(os.getpid()),
        "shared_ring_bytes": shared,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
    }
    return result


# -- the source alone ----------------------------------------------------------------------------


def source_read_cost(gpus: int, groups: list[GroupPlan], reads: int = 2000) -> dict[str, Any]:
    """``SimSource.read`` alone, back to back in this process: the floor under the loop's CPU."""
    src = open_source(SourceSpec("sim", gpus=gpus))
    src.open([f for g in groups for f in g.fields])
    out: dict[str, Any] = {}
    for g in groups:
        values = np.empty((gpus, len(g.fields)))
        driver = np.empty((gpus, len(g.fields)), np.int64)
        took = np.empty(reads, np.int64)
        for k in range(reads):
            now = time.time_ns()
            start = time.perf_counter_ns()
            src.read(g.fields, values, driver, now)
            took[k] = time.perf_counter_ns() - start
        us = took[reads // 10 :] / 1e3
        out[g.name] = {
            "fields": len(g.fields),
            "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)),
            "min_us": float(us.min()),
        }
    src.close()
    return out


# -- the report ----------------------------------------------------------------------------------


def _kind(r: dict[str, Any]) -> str:
    slow = f" +{r['slow_call_ms']:g}ms" if r.get("slow_call_ms") else ""
    return f"{r['sampler']}{slow}"


def _row(r: dict[str, Any]) -> str:
    f, before = r["fast"], r["floor_before"]
    rss = r["sampler_memory_mb"].get("rss")
    return (
        f"{r['gpus']:>4} {r['parent']:<5} {_kind(r):<18}{f.get('ticks', 0):>7}"
        f"{f.get('p50_us', float('nan')):>6.0f}{f.get('p99_us', float('nan')):>6.0f}"
        f"{f.get('max_us', float('nan')):>6.0f}{r['missed_pct']:>8.3f}{r['p99_over_floor']:>7.2f}"
        f"{before['p99_us']:>7.0f}{r['p99_over_floor_before']:>8.2f}{before['missed_pct']:>8.3f}"
        f"{r['cpu_pct']:>6.2f}{r['cpu_per_gpu_pct']:>8.2f}{before['cpu_pct']:>7.2f}"
        f"{rss if rss is not None else float('nan'):>6.1f}{r['runqueue_wait_ms_per_s']:>6.1f}"
        f"{r['parent_work_units_per_s'] / 1e3:>7.1f}  {r['loadavg_before'][0]:.2f}"
    )


def _verdict(value: float | None, limit: float) -> str:
    if value is None or np.isnan(value):
        return "n/a"
    return "met" if value <= limit else "MISSED"


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    proc = [r for r in results if r["sampler"] == "process"]
    for r in proc:
        where = f"{r['gpus']} GPU {r['parent']}" + (
            f", {r['slow_call_ms']:g} ms slow read" if r.get("slow_call_ms") else ""
        )
        if r["parent"] == "busy":
            p99 = r["fast"].get("p99_us")
            out.append(_target("p99 lateness, busy parent", where, p99, "p99_lateness_busy_us"))
            ratio = r["p99_over_floor"]
            out.append(_target("p99 / floor p99 (run start)", where, ratio, "p99_over_floor"))
            ratio = r["p99_over_floor_before"]
            target = _target("p99 / floor p99 (just before)", where, ratio, "p99_over_floor_before")
            out.append(target)
        out.append(_target("missed ticks %", where, r["missed_pct"], "missed_pct"))
        out.append(_target("CPU per GPU %", where, r["cpu_per_gpu_pct"], "cpu_per_gpu_pct"))
        if r["gpus"] == 8 and not r.get("slow_call_ms"):
            rss = r["sampler_memory_mb"].get("rss")
            out.append(_target("sampler RSS MB, 8 GPUs", where, rss, "rss_8gpu_mb"))
    return out


def _target(name: str, where: str, value: float | None, key: str) -> dict[str, Any]:
    limit = TARGETS[key]
    return {"target": name, "where": where, "value": value, "limit": limit,
            "verdict": _verdict(value, limit)}  # fmt: skip


def print_report(report: dict[str, Any]) -> None:
    results: list[dict[str, Any]] = report["scenarios"]
    print()
    print(
        "fast group (1 ms) tick lateness in µs; missed in % of ticks; xstart = p99 over the\n"
        "p99 of the floor measured alone at the start of the run (a bare 1 kHz loop in its own\n"
        "process, idle parent) under the row's own scheduling (normal, +slice, +fifo); before:\n"
        "the same loop, same scheduling, under the scenario's parent just before the sampler\n"
        "starts (its p99 µs, the sampler's p99 over it, its missed %, its CPU %); CPU in\n"
        "% of one core (every thread); RSS of the sampler in MB; runq = ms per s its fast lane\n"
        "waited for a CPU while runnable; work = the parent's busy-loop units/s (thousands);\n"
        "load = the 1-minute load average when the scenario started"
    )
    print(
        f"{'GPUs':>4} {'par.':<5} {'sampler':<18}{'ticks':>7}{'p50':>6}{'p99':>6}{'max':>6}"
        f"{'missed%':>8}{'xstart':>7}{'bf.p99':>7}{'xbefore':>8}{'bf.mis%':>8}{'CPU%':>6}"
        f"{'CPU/GPU':>8}{'bf.CPU':>7}{'RSS':>6}{'runq':>6}{'work':>7}  load"
    )
    for r in results:
        print(_row(r))
    print()
    for r in results:
        if r["sampler"] == "process" and r["slow"].get("ticks"):
            groups = ", ".join(
                f"{name} {c['ticks']} ticks, {c['late']} late, {c['missed']} missed"
                for name, c in r["groups"].items()
            )
            print(
                f"{r['gpus']} GPU {r['parent']} {_kind(r)}: {groups}; slow lane p99 "
                f"{r['slow']['p99_us']:.0f} µs"
            )
    for c in report["peer_over_process"]:
        print(
            f"{c['gpus']} GPU, {c['parent']} parent{c['slow']}: {c['peer']} / {c['process']} p99 = "
            f"{c['peer_p99_us']:.0f} / {c['process_p99_us']:.0f} µs = {c['p99_ratio']:.1f}x; "
            f"missed {c['peer_missed_pct']:.3f}% vs {c['process_missed_pct']:.3f}%"
        )
    for policy, f in report["platform_floors"].items():
        print(
            f"platform floor alone at the start, idle parent, {policy} scheduling: p50 "
            f"{f['p50_us']:.0f} p99 {f['p99_us']:.0f} max {f['max_us']:.0f} µs, missed "
            f"{f['missed_pct']:.2f}%, CPU {f['cpu_pct']:.2f}% (no sampler can do better here)"
        )
    print()
    for gpus, cost in report["source_read_us"].items():
        parts = ", ".join(
            f"{name} ({c['fields']} fields) p50 {c['p50_us']:.0f} µs p99 {c['p99_us']:.0f} µs"
            for name, c in cost.items()
        )
        print(f"SimSource.read alone, {gpus} GPU: {parts}")
    for r in results:
        if r["sampler"] == "process" and r["gpus"] == max(x["gpus"] for x in results):
            m, p = r["sampler_memory_mb"], r["parent_memory_mb"]
            print(
                f"memory, {r['gpus']} GPU {r['parent']} {_kind(r)}: sampler RSS "
                f"{m.get('rss', 0):.1f} PSS {m.get('pss', 0):.1f} USS {m.get('uss', 0):.1f} MB; "
                f"parent RSS {p.get('rss', 0):.1f} PSS {p.get('pss', 0):.1f} MB; rings "
                f"{r['shared_ring_bytes'] / MB:.1f} MB"
            )
    print()
    for t in report["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        print(f"{t['verdict']:<7} {t['target']} ({t['where']}): {value} (limit {t['limit']:g})")
    print(f"load average before / after: {report['env']['loadavg_before']} / "
          f"{report['env']['loadavg_after']}")  # fmt: skip


def _runner_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(platform.machine())


def set_fair_slice(pid: int, slice_s: float) -> bool:
    """Ask EEVDF (Linux >= 6.12) for a short slice: unprivileged, the task wakes ahead of others.

    ``sched_setattr`` with SCHED_OTHER and ``sched_runtime`` set; older kernels ignore the runtime.
    """
    if _SYS_SCHED_SETATTR is None:
        return False
    # struct sched_attr: size, policy, flags, nice, priority, runtime, deadline, period, util
    attr = struct.pack("IIQiIQQQII", 56, 0, 0, 0, 0, int(slice_s * 1e9), 0, 0, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.syscall(_SYS_SCHED_SETATTR, pid, ctypes.create_string_buffer(attr), 0) == 0)


def may_set_fifo() -> bool:
    """Whether this process may give another one SCHED_FIFO (root or CAP_SYS_NICE)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True


def _bare_loop(
    seconds: float, policy: str = "normal", fifo_priority: int = FIFO_PRIORITY
) -> dict[str, float]:
    """A 1 kHz deadline loop that does nothing: what this machine allows any sampler at all,
    under the same ``policy`` as the rows it is compared with (see ``policy_of``).

    Its CPU is what waking up a thousand times a second costs here.
    """
    if policy == "fifo":
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(fifo_priority))
    elif policy == "slice":
        set_fair_slice(os.getpid(), SHORT_SLICE_S)
    reduce_timer_slack()
    interval = 1_000_000
    n = int(seconds * 1000)
    late = np.empty(n, dtype=np.int64)
    missed = 0
    deadline = time.perf_counter_ns() // interval * interval + interval
    cpu0, wall0 = run_seconds(os.getpid()), time.monotonic()
    for i in range(n):
        remaining = deadline - time.perf_counter_ns()
        if remaining > 0:
            time.sleep(remaining / 1e9)
        lateness = time.perf_counter_ns() - deadline
        skipped = lateness // interval
        missed += skipped
        late[i] = lateness - skipped * interval
        deadline += (skipped + 1) * interval
    cpu_pct = (run_seconds(os.getpid()) - cpu0) / (time.monotonic() - wall0) * 100
    us = late / 1e3
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "max_us": float(us.max()),
        "missed_pct": 100.0 * missed / (n + missed),
        "cpu_pct": cpu_pct,
    }


def platform_floor(
    seconds: float, policy: str = "normal", fifo_priority: int = FIFO_PRIORITY
) -> dict[str, float]:
    """The bare loop in its own process (as the sampler runs), under ``policy``."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_bare_loop, (seconds, policy, fifo_priority))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per scenario (default 10)")
    parser.add_argument("--gpus", default="1,8", help="sim GPU counts (default 1,8)")
    parser.add_argument(
        "--floor-seconds", type=float, help="the floor before each scenario (default: half)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/sampler.json"))
    parser.add_argument("--no-thread", action="store_true", help="skip the thread peer")
    parser.add_argument("--no-one-lane", action="store_true", help="skip the one-lane peer")
    parser.add_argument(
        "--no-slow-call", action="store_true", help="skip the scenarios with a 5 ms slow read"
    )
    parser.add_argument(
        "--no-sched",
        action="store_true",
        help="skip the sampler variants with a short EEVDF slice and with SCHED_FIFO",
    )
    args = parser.parse_args(argv)
    gpu_counts = [int(x) for x in args.gpus.split(",") if x.strip()]
    floor_s = args.floor_seconds if args.floor_seconds is not None else args.seconds / 2

    loadavg_before = os.getloadavg()
    # one floor per scheduling policy the rows run under: a row is divided by its own
    policies = ["normal"]
    if not args.no_sched:
        policies += ["slice", "fifo"] if may_set_fifo() else ["slice"]
    floors: dict[str, dict[str, float]] = {}
    for policy in policies:
        print(f"platform floor (a bare 1 kHz sleep loop, no work, {policy} scheduling): "
              f"{args.seconds:g} s ...", flush=True)  # fmt: skip
        floors[policy] = platform_floor(args.seconds, policy)
    factory = _runner_factory()
    results: list[dict[str, Any]] = []
    read_cost: dict[str, Any] = {}
    for gpus in gpu_counts:
        src = open_source(SourceSpec("sim", gpus=gpus))
        inventory = src.open(catalogue.select(None))
        src.close()
        groups = plan_groups(inventory.fields, dict(catalogue.DEFAULT_GROUP_INTERVALS_S))
        read_cost[str(gpus)] = source_read_cost(gpus, groups)
        spin_s = 0.0
        slow = 0.0 if args.no_slow_call else SLOW_CALL_S
        plan = [("process", False, 0.0), ("process", True, 0.0), ("process", True, slow)]
        if not args.no_one_lane:
            plan += [("one-lane", True, 0.0), ("one-lane", True, slow)]
        if not args.no_thread:
            plan += [("thread", False, 0.0), ("thread", True, 0.0)]
        if not args.no_sched:
            plan.append(("process+slice", True, 0.0))
            if may_set_fifo():
                plan += [("process+fifo", True, 0.0), ("process+fifo", True, slow)]
                if not args.no_one_lane:
                    plan.append(("one-lane+fifo", True, slow))
        for kind, busy, slow_s in dict.fromkeys(plan):  # without a slow call: once
            sc = Scenario(gpus, busy, kind, slow_s)
            print(f"{sc.label}: {args.seconds:g} s ...", flush=True)
            with asyncio.Runner(loop_factory=factory) as runner:
                run = run_scenario(sc, inventory, groups, args.seconds, spin_s, floor_s)
                r = runner.run(run)
            if kind == "process" and busy and not slow_s:
                spin_s = r["spin_us"] / 1e6  # the peers spin what the process calibrated
            results.append(r)

    ratios = []
    for r in results:
        floor = floors[policy_of(r["sampler"])]
        r["floor_start"] = floor
        r["p99_over_floor"] = r["fast"].get("p99_us", float("nan")) / max(floor["p99_us"], 1e-9)
    for r in results:
        if not r["sampler"].startswith(("thread", "one-lane")):
            continue
        process = "process+fifo" if r["sampler"].endswith("+fifo") else "process"
        for p in results:
            same = (p["gpus"], p["parent"], p["slow_call_ms"]) == (
                r["gpus"],
                r["parent"],
                r["slow_call_ms"],
            )
            if p["sampler"] == process and same:
                ratios.append({
                    "gpus": r["gpus"],
                    "parent": r["parent"],
                    "slow": f", {r['slow_call_ms']:g} ms slow read" if r["slow_call_ms"] else "",
                    "peer": r["sampler"],
                    "process": process,
                    "process_p99_us": p["fast"].get("p99_us"),
                    "peer_p99_us": r["fast"].get("p99_us"),
                    "p99_ratio": r["fast"]["p99_us"] / max(p["fast"]["p99_us"], 1e-9),
                    "process_missed_pct": p["missed_pct"],
                    "peer_missed_pct": r["missed_pct"],
                })  # fmt: skip
    report: dict[str, Any] = {
        "benchmark": "sampler_tick_lateness",
        "params": {
            "seconds": args.seconds,
            "gpus": gpu_counts,
            "window_s": WINDOW_S,
            "warmup_s": WARMUP_S,
            "late_threshold_us": LATE_NS / 1e3,
        },
        "env": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "event_loop": "uvloop" if factory else "asyncio",
            "loadavg_before": loadavg_before,
            "loadavg_after": os.getloadavg(),
        },
        "targets_limits": TARGETS,
        "scenarios": results,
        "peer_over_process": ratios,
        "source_read_us": read_cost,
        "platform_floor": floors["normal"],
        "platform_floors": floors,
    }
    report["targets"] = targets(results)
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

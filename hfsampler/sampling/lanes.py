"""The sampler process's two lanes: the fastest group alone on one thread, the others on a second.

A read that takes long (an ECC or retired-pages query, a GPM sample pair, an XID event wait) must
never delay a millisecond tick, so the fastest group (normally ``fast``, 1 ms) has the process's
main thread to itself: its deadline loop does one read, one ring row and a few counters per tick
(repeats are marked by the rings' readers; GPUs up and the heartbeat every 16 ticks). When
the source's devices change (a MIG layout, found in a slow read), the lane that read them tells
the parent at once, with the time of that read: rows from then on are the new instances'.
Every other group runs on the slow lane, a second thread with its own deadlines, its own rings
(one writer per ring, as before) and its own status slots. NVML's calls go through ctypes, which
releases the GIL, so while the slow lane waits in a slow call the fast lane runs; the slow lane's
Python work between calls is cut into short turns (``GIL_SWITCH_S``) whenever the fast lane wakes.
The lanes share no lock: what they share is the source, whose reads of different field sets are
safe to run at once, and the status block, where each slot has one writer.

The GIL is a lock the fast lane must take on every tick, so every thread that takes it runs at the
fast lane's real-time priority too (SCHED_FIFO applies per thread; the slow lane, and a helper a
source starts from a lane, which inherits it): a normal-priority holder that the kernel preempts
for another process keeps the fast lane waiting for the GIL for that process's time slice (at 64
sim GPUs on a loaded 2-core machine, most of the missed ticks above the machine's own). No thread
outranks the fast lane; threads that never take the GIL while busy (numpy's BLAS threads) are put
back on the normal scheduler should they have inherited a real-time one (``chrt``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hfsampler.sampling.ring import Ring
from hfsampler.sources.base import DeviceInfo, Source

# (wall-clock ns of the read that found them, the source's devices): to the parent
Publish = Callable[[int, tuple[DeviceInfo, ...]], None]

if TYPE_CHECKING:
    from hfsampler.sampling.groups import GroupPlan, SamplerPlan

log = logging.getLogger("hfsampler.sampling.sampler")

# The status block: a few global slots, then per group (ticks, late, missed), then per GPU (up).
STATE, STOP, SPIN_NS, HEARTBEAT_NS, PID, ERROR, RT_PRIORITY = range(7)
GLOBAL_SLOTS = 8
PER_GROUP = 3
STARTING, RUNNING, STOPPED, FAILED = 0, 1, 2, 3

# How long a thread may hold the GIL while another waits for it (CPython's default is 5 ms, longer
# than four fast ticks): the slow lane's Python work yields to a fast tick within this.
GIL_SWITCH_S = 50e-6
# Fast ticks between the fast lane's bookkeeping: GPUs up, heartbeat, the slow lane's health.
_HOUSEKEEPING_TICKS = 16
_ORPHAN_CHECK_TICKS = 1024  # a getppid() where PR_SET_PDEATHSIG is not available
# How long the fast lane waits, on its way out, for a slow lane inside a slow call: well under
# the parent's wait for the process (Sampler.stop), so that a stuck read is said, not killed.
_JOIN_S = 2.0

Status = npt.NDArray[np.int64]

PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29


def prctl(option: int, value: int) -> None:
    """Best-effort Linux prctl; elsewhere a no-op."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(libc_name, use_errno=True).prctl(option, value, 0, 0, 0)


_PR_SET_NAME = 15
SLOW_LANE_THREAD = "hfs-slow-lane"  # its name in /proc/<pid>/task/*/comm (15 bytes at most)


def name_thread(name: str) -> None:
    """Best effort: this thread's name as ps, top and /proc show it (Linux only)."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(libc_name).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def reduce_timer_slack() -> None:
    """Ask Linux for 1 µs timer slack (default 50 µs) so this thread's sleeps end closer to time."""
    prctl(_PR_SET_TIMERSLACK, 1000)


def calibrate_spin_ns(late_threshold_ns: int, interval_ns: int, trials: int = 200) -> int:
    """How long to spin before a deadline: 0 when plain sleep is precise enough.

    Sleeps ``trials`` times for 500 µs and takes the median overshoot: the tail is preemption by
    other processes, which spinning cannot fix (a real-time priority does). Sleep alone is enough
    when the median is under half the late threshold; otherwise spin for it, but never more than
    a twentieth of the interval, since a spin burns CPU on every tick.
    """
    overshoot = np.empty(trials, dtype=np.int64)
    for i in range(trials):
        start = time.perf_counter_ns()
        time.sleep(0.0005)
        overshoot[i] = time.perf_counter_ns() - start - 500_000
    median = int(np.median(overshoot))
    return 0 if median <= late_threshold_ns // 2 else min(median, interval_ns // 20)


def ask_realtime(priority: int) -> int:
    """Run this thread under SCHED_FIFO at ``priority`` if allowed; returns the priority in effect.

    On a loaded machine a normal-priority sampler waits for a CPU for hundreds of microseconds
    (measured in benchmarks/sampler.py); the lowest real-time priority removes most of that wait.
    The loop sleeps nearly all of each tick, and the kernel's real-time throttling still bounds
    it. Without CAP_SYS_NICE the request is refused and the sampler runs as before.
    """
    if priority <= 0 or not hasattr(os, "sched_setscheduler"):
        return 0
    inherited = _inherited_realtime()
    if inherited >= priority:
        return inherited  # started under chrt with more than asked: keep it
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (PermissionError, OSError) as exc:
        log.info(
            "real-time priority %d refused (%s): sampling at normal priority; grant "
            "CAP_SYS_NICE or set realtime_priority: 0 to silence this",
            priority,
            exc.strerror,
        )
        return 0
    return priority


def _inherited_realtime() -> int:
    """The real-time priority this thread runs at already (0: the normal scheduler)."""
    with contextlib.suppress(AttributeError, OSError):
        if os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR):
            return int(os.sched_getparam(0).sched_priority)
    return 0


def _share_priority(priority: int, gil_takers: Sequence[int]) -> None:
    """The threads ``gil_takers`` (native ids) at the fast lane's ``priority`` (0: normal), every
    other thread of the process (numpy's BLAS threads, started at import, inherit a chrt policy)
    back to the normal scheduler: none may outrank the fast lane."""
    me = threading.get_native_id()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            tid = int(task)
            if tid == me:
                continue
            with contextlib.suppress(AttributeError, OSError):
                if priority and tid in gil_takers:
                    os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(priority))
                elif os.sched_getscheduler(tid) in (os.SCHED_FIFO, os.SCHED_RR):
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def run_lanes(
    plan: SamplerPlan,
    src: Source,
    rings: Sequence[Ring],
    s: Status,
    parent_pid: int,
    publish: Publish | None = None,
) -> None:
    """Sample until ``s[STOP]`` is set (or the parent is gone): the fast lane on this thread.

    ``rings`` are in ``plan.groups``' order. ``publish`` is given the source's devices after
    the first read and after every read that changed them, by the slow lane where there is one.
    Raises what either lane raised.
    """
    groups = plan.groups
    fastest = min(range(len(groups)), key=lambda k: groups[k].interval_s)
    others = [k for k in range(len(groups)) if k != fastest]
    threshold_ns = int(plan.late_threshold_s * 1e9)
    interval_ns = int(groups[fastest].interval_s * 1e9)
    slow = _SlowLane(plan, src, rings, s, others, threshold_ns, publish) if others else None
    old_switch = sys.getswitchinterval()
    try:
        if slow is not None:
            sys.setswitchinterval(GIL_SWITCH_S)
            slow.thread.start()  # before asking for real-time: a new thread inherits the policy
        reduce_timer_slack()
        s[RT_PRIORITY] = priority = ask_realtime(plan.realtime_priority)
        _share_priority(priority, [] if slow is None else [slow.thread.native_id or 0])
        if plan.spin_s is not None:
            spin_ns = int(plan.spin_s * 1e9)
        else:
            spin_ns = calibrate_spin_ns(threshold_ns, interval_ns)
        s[SPIN_NS] = spin_ns
        for ring in rings:
            ring.slot()  # the writer's row arrays, made before the first deadline
        gpu_slot = GLOBAL_SLOTS + PER_GROUP * len(groups)
        s[gpu_slot : gpu_slot + plan.gpus] = 1
        s[STATE] = RUNNING
        if slow is not None:
            slow.go.set()
        fast_publish = publish if slow is None else None
        _fast_lane(
            plan, src, rings, s, parent_pid, fastest, spin_ns, threshold_ns, slow, fast_publish
        )
    finally:
        if slow is not None:
            slow.stop.set()
            slow.go.set()
            if slow.thread.is_alive():
                slow.thread.join(_JOIN_S)
            sys.setswitchinterval(old_switch)
            reading = slow.reading
            if slow.thread.is_alive() and reading is not None:
                group = groups[reading]
                raise StuckRead(
                    f"the slow lane is still in a read of group {group.name} after "
                    f"{(time.perf_counter_ns() - slow.read_since_ns) / 1e9:.1f} s (the driver "
                    "does not answer); the sampler exits without closing the source"
                )
    if slow is not None and slow.error is not None:
        raise slow.error


def _fast_lane(
    plan: SamplerPlan,
    src: Source,
    rings: Sequence[Ring],
    s: Status,
    parent_pid: int,
    index: int,
    spin_ns: int,
    threshold_ns: int,
    slow: _SlowLane | None,
    publish: Publish | None = None,
) -> None:
    """One group's deadline loop: sleep, read, publish the row, count."""
    group = plan.groups[index]
    fields, ring = group.fields, rings[index]
    interval = int(group.interval_s * 1e9)
    base = GLOBAL_SLOTS + PER_GROUP * index
    gpu_slot = GLOBAL_SLOTS + PER_GROUP * len(plan.groups)
    gpus = plan.gpus
    # from the block, not 0: the parent counts what was added since it last looked
    ticks, late, missed_total = (int(c) for c in s[base : base + PER_GROUP])
    perf_ns, wall_ns, sleep = time.perf_counter_ns, time.time_ns, time.sleep
    now = perf_ns()
    deadline = now - now % interval + interval
    published: tuple[DeviceInfo, ...] | None = None
    while not s[STOP]:
        remaining = deadline - perf_ns()
        if remaining > spin_ns:
            sleep((remaining - spin_ns) / 1e9)
        now = perf_ns()
        while now < deadline:
            now = perf_ns()
        lateness = now - deadline
        if lateness >= interval:
            missed = lateness // interval
            lateness -= missed * interval
            deadline += missed * interval
            missed_total += missed
            s[base + 2] = missed_total
        values, driver = ring.slot()
        read_at = wall_ns()
        src.read(fields, values, driver, read_at)
        ring.commit(read_at, lateness)  # repeats are the reader's to mark, once per window
        if publish is not None and src.devices is not published:
            published = src.devices
            publish(read_at, published)
        ticks += 1
        s[base] = ticks
        if lateness > threshold_ns:
            late += 1
            s[base + 1] = late
        deadline += interval
        if ticks % _HOUSEKEEPING_TICKS == 0:
            s[gpu_slot : gpu_slot + gpus] = src.gpu_up
            s[HEARTBEAT_NS] = read_at
            if slow is not None and not slow.thread.is_alive():
                return  # it failed (run_lanes raises its error) or was told to stop
            if ticks % _ORPHAN_CHECK_TICKS == 0 and os.getppid() != parent_pid:
                return  # orphaned where PR_SET_PDEATHSIG is not available


class StuckRead(BaseException):
    """The slow lane is still inside a read when the process must end: the source and the rings
    it reads into cannot be closed under it, so the process exits without closing them."""


class _SlowLane:
    """Every group but the fastest, on a thread of its own: each with its deadlines and counters.

    It sleeps to the earliest of its groups' deadlines without spinning (a spin would hold the GIL
    the fast lane needs), reads that group and publishes its row, as the fast lane does.
    """

    def __init__(
        self,
        plan: SamplerPlan,
        src: Source,
        rings: Sequence[Ring],
        s: Status,
        indices: Sequence[int],
        threshold_ns: int,
        publish: Publish | None = None,
    ) -> None:
        self._plan = plan
        self._publish = publish
        self._src = src
        self._rings = rings
        self._s = s
        self._indices = list(indices)
        self._threshold_ns = threshold_ns
        self.go = threading.Event()  # set once the fast lane is ready to tick
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.reading: int | None = None  # the group (in plan.groups) it is reading, if any
        self.read_since_ns = 0  # perf_counter_ns when that read began
        self.thread = threading.Thread(target=self._run, name="hfsampler-slow-lane", daemon=True)

    def _run(self) -> None:
        try:
            name_thread(SLOW_LANE_THREAD)
            reduce_timer_slack()  # per thread, as the scheduling policy is
            self.go.wait()
            if not self.stop.is_set():
                self._loop()
        except BaseException as exc:  # the fast lane notices and run_lanes raises it
            self.error = exc

    def _loop(self) -> None:
        plan, src, s = self._plan, self._src, self._s
        groups: list[GroupPlan] = [plan.groups[k] for k in self._indices]
        rings = [self._rings[k] for k in self._indices]
        bases = [GLOBAL_SLOTS + PER_GROUP * k for k in self._indices]
        intervals = [int(g.interval_s * 1e9) for g in groups]
        n = len(groups)
        fastest_ns = int(min(g.interval_s for g in plan.groups) * 1e9)
        # Halfway between two fast ticks, so that the slow lane's Python work seldom meets one;
        # and the groups spread over the shortest slow interval, so that one group's slow call
        # (5 ms of ECC counts) does not make the next group's tick late as well.
        spread = min(intervals) // n
        now = time.perf_counter_ns()
        deadlines = [
            now - now % iv + iv + fastest_ns // 2 + j * (spread - spread % fastest_ns)
            for j, iv in enumerate(intervals)
        ]
        perf_ns, wall_ns, wait = time.perf_counter_ns, time.time_ns, self.stop.wait
        publish, published = self._publish, None
        while not s[STOP]:
            j = min(range(n), key=deadlines.__getitem__)
            deadline = deadlines[j]
            remaining = deadline - perf_ns()
            if remaining > 0 and wait(remaining / 1e9):
                return
            lateness = perf_ns() - deadline
            interval = intervals[j]
            missed = lateness // interval
            if missed:
                lateness -= missed * interval
                deadline += missed * interval
            ring = rings[j]
            values, driver = ring.slot()
            read_at = wall_ns()
            self.read_since_ns, self.reading = perf_ns(), self._indices[j]
            src.read(groups[j].fields, values, driver, read_at)
            self.reading = None
            ring.commit(read_at, lateness)
            if publish is not None and src.devices is not published:
                published = src.devices
                publish(read_at, published)
            base = bases[j]
            s[base] += 1
            if lateness > self._threshold_ns:
                s[base + 1] += 1
            s[base + 2] += missed
            deadlines[j] = deadline + interval

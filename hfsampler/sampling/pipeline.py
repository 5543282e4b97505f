"""The window pipeline: the one loop that turns the sampler's rings into each window's statistics.

`run` and `record` take their windows here. A ``Pipeline`` is built from the run plan; it owns the
sampler (its process; or, with a ``VirtualClock``, a ``SteppingSampler`` that reads the source in
this process, for tests), one reader per group's ring, and the window clock. Each ``Window`` holds
per group its rows, statistics and tick statistics, the rows' devices and which GPUs answer, and
the sampler's health per group (ticks, late and missed ticks since the window before, rows lost to
a full ring, a group that stopped ticking); with `run`'s policy, also the cumulative native
histograms of the configured fields (``histogram_counts``).

How a command takes its windows is its ``Policy``: `run` catches up after a stall, since it must
stay current (``windows``, an async iterator); `record` reads every window however late, since the
file must have them all (``window`` and ``advance``, called from its own polling loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.histogram_counts import (
    CountedHistogram,
    HistogramChoice,
    HistogramCounter,
    choice_of,
)
from hfsampler.sampling.plan import RunPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.sampler import Sampler
from hfsampler.sampling.window import (
    WINDOW_GRACE_S,
    TickStats,
    WindowClock,
    WindowReader,
    WindowStats,
    reduce,
)
from hfsampler.sources.base import BoolArray, DeviceInfo, Inventory

_log = logging.getLogger(__name__)

# A group that has not ticked for this many of its intervals (and STALL_MIN_S at least) is stalled:
# a read stuck in the driver, or a stopped sampler.
STALL_INTERVALS = 20
STALL_MIN_S = 3.0
RECORD_GRACE_S = 0.02  # record: the sampler's rows up to a window's end are committed by then


class Clock(Protocol):
    """Where the pipeline's time comes from: the wall clock, or a test's ``VirtualClock``."""

    def now_ns(self) -> int: ...

    def monotonic_s(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    async def wait(self, until_ns: int, stop: asyncio.Event) -> bool:
        """Until ``until_ns`` (wall-clock ns) or ``stop``; True if stopped."""
        ...


class WallClock:
    """The real time: ``time.time_ns`` for window ends, real sleeps."""

    def now_ns(self) -> int:
        return time.time_ns()

    def monotonic_s(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    async def wait(self, until_ns: int, stop: asyncio.Event) -> bool:
        delay = (until_ns - time.time_ns()) / 1e9
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        return stop.is_set()


WALL = WallClock()


@dataclass(frozen=True, slots=True)
class Policy:
    """How a command takes its windows."""

    # after a stall longer than a window, the window in progress stretches to the current one
    # (run stays current); otherwise every window is read, however late (record keeps them all)
    catch_up: bool
    grace_s: float  # how long after a window's end its last rows are committed
    # rows read before the first window's start are dropped (record: they are not the job's);
    # otherwise the first window has every row since the readers began
    drop_before_start: bool
    # only the rows with a field of the group are reduced (run: a MIG GPU's instance slots have
    # none in most groups); otherwise every row is, as the source wrote it (record's file)
    supported_rows_only: bool
    # the configured fields' distinct samples are counted into native histograms (run exports
    # them; a recording keeps the raw samples, from which any histogram can be made later)
    histograms: bool = False


RUN = Policy(catch_up=True, grace_s=WINDOW_GRACE_S, drop_before_start=False,
             supported_rows_only=True, histograms=True)  # fmt: skip
RECORD = Policy(catch_up=False, grace_s=RECORD_GRACE_S, drop_before_start=True,
                supported_rows_only=False)  # fmt: skip


@dataclass(frozen=True, slots=True)
class GroupHealth:
    """One group's sampler health at a window's end, counted since the window before."""

    ticks: int
    late: int
    missed: int
    lost_rows: int  # overwritten in the ring before they were read
    stalled_s: float  # > 0 while stalled: how long it had not ticked when that was found
    stall_found: bool  # found stalled at this window (to be said once)
    resumed_after_s: float | None  # ticks again at this window, after this long without


@dataclass(frozen=True, slots=True)
class GroupWindow:
    """One group's part of a window."""

    plan: GroupPlan
    rows: RingRows
    stats: WindowStats
    ticks: TickStats
    health: GroupHealth
    # each histogram series' cumulative counts at the window's end (``histogram_counts``)
    histograms: tuple[CountedHistogram, ...] = ()


@dataclass(frozen=True, slots=True)
class Window:
    """Every group's rows and statistics over ``[t0_ns, t1_ns)``, in the plan's order."""

    t0_ns: int
    t1_ns: int
    groups: tuple[GroupWindow, ...]
    devices: tuple[DeviceInfo, ...]  # the rows' devices (a MIG slot's instance may change)
    mixed: BoolArray  # rows whose device changed inside the window: two instances' samples
    gpu_up: BoolArray  # per row, as the sampler last said

    @property
    def stats(self) -> dict[str, WindowStats]:
        return {g.plan.name: g.stats for g in self.groups}

    @property
    def ticks(self) -> dict[str, TickStats]:
        return {g.plan.name: g.ticks for g in self.groups}


@dataclass(slots=True)
class _Group:
    plan: GroupPlan
    index: int
    reader: WindowReader
    rows: list[int] | None  # the rows reduced (None: all)
    ticks: int = 0
    late: int = 0
    missed: int = 0
    progressed_ns: int | None = None  # when its tick count last grew
    stalled_s: float = 0.0

    def health(self, sampler: Sampler, now_ns: int) -> GroupHealth:
        c = sampler.counters(self.index)
        found, resumed = False, None
        if c.ticks > self.ticks or self.progressed_ns is None:
            if self.stalled_s:
                resumed = (now_ns - (self.progressed_ns or now_ns)) / 1e9
            self.progressed_ns, self.stalled_s = now_ns, 0.0
        else:
            idle_s = (now_ns - self.progressed_ns) / 1e9
            limit_s = max(STALL_MIN_S, STALL_INTERVALS * self.plan.interval_s)
            if not self.stalled_s and idle_s >= limit_s:
                self.stalled_s, found = idle_s, True
        health = GroupHealth(
            c.ticks - self.ticks,
            c.late - self.late,
            c.missed - self.missed,
            self.reader.lost_rows,
            self.stalled_s,
            found,
            resumed,
        )
        self.ticks, self.late, self.missed = c.ticks, c.late, c.missed
        self.reader.lost_rows = 0
        return health


def rows_with_fields(inventory: Inventory, plan: GroupPlan) -> list[int]:
    """The rows with a supported field of the group (not a MIG slot's, mostly)."""
    wanted = set(plan.fields)
    cols = [k for k, f in enumerate(inventory.fields) if f in wanted]
    return [int(r) for r in np.flatnonzero(inventory.supported[:, cols].any(axis=1))]


def _stepping(plan: RunPlan, window_s: float, clock: Clock, cap: int) -> Sampler | None:
    """A ``SteppingSampler`` for a test's ``VirtualClock`` (None for another clock), imported
    only here: `run` and `record` never need it."""
    from hfsampler.sampling.stepping import SteppingSampler, VirtualClock

    if not isinstance(clock, VirtualClock):
        return None
    return SteppingSampler(
        plan.spec, plan.inventory, plan.groups, window_s, clock, max_ring_bytes=cap
    )


class Pipeline:
    """The sampler, its rings' readers and the window clock of one `run` or `record`."""

    def __init__(
        self,
        plan: RunPlan,
        policy: Policy,
        *,
        clock: Clock = WALL,
        realtime_priority: int = 0,
        log: logging.Logger = _log,
    ) -> None:
        """``log``: the command's logger, which says a catch-up. The rings are made here (a
        ``ConfigError`` when they cannot be); the sampler starts in ``start``."""
        self.plan = plan
        self.policy = policy
        self.clock = clock
        self._log = log
        window_s, cap = plan.config.window_s, plan.config.max_ring_bytes
        self.sampler: Sampler
        stepping = None if isinstance(clock, WallClock) else _stepping(plan, window_s, clock, cap)
        if stepping is not None:
            self.sampler = stepping
        else:
            self.sampler = Sampler(
                plan.spec,
                plan.inventory,
                plan.groups,
                window_s,
                realtime_priority=realtime_priority,
                max_ring_bytes=cap,
            )
        self._groups: list[_Group] = []
        self._histograms = (
            HistogramCounter(plan.groups, plan.inventory.devices, choice_of(plan.config))
            if policy.histograms
            else None
        )
        self._clock: WindowClock | None = None
        self.died = False  # ``windows`` ended because the sampler is gone

    @property
    def groups(self) -> tuple[GroupPlan, ...]:
        return self.plan.groups

    def choose_histograms(self, choice: HistogramChoice) -> None:
        """What to count from the next window on (a reload); unchanged fields keep counting."""
        if self._histograms is not None:
            self._histograms.choose(choice)

    def start(self) -> None:
        """Start the sampler (it ticks when this returns) and follow its rings from now."""
        self.sampler.start()
        only = self.policy.supported_rows_only
        self._groups = [
            _Group(p, i, WindowReader(self.sampler.rings[p.name]),
                   rows_with_fields(self.plan.inventory, p) if only else None)
            for i, p in enumerate(self.plan.groups)
        ]  # fmt: skip

    def begin(self) -> int:
        """Start the window clock now: the first window runs to the next multiple of the window
        length. Returns its start."""
        start_ns = self.clock.now_ns()
        self._clock = WindowClock(self.plan.config.window_s, self.policy.grace_s,
                                  clock_ns=self.clock.now_ns, start_ns=start_ns)  # fmt: skip
        if self.policy.drop_before_start:
            for g in self._groups:
                g.reader.take(start_ns)
        return start_ns

    @property
    def _window_clock(self) -> WindowClock:
        if self._clock is None:
            raise RuntimeError("the pipeline has not begun")
        return self._clock

    @property
    def t0_ns(self) -> int:
        return self._window_clock.t0_ns

    @property
    def t1_ns(self) -> int:
        return self._window_clock.t1_ns

    @property
    def due_ns(self) -> int:
        """When the window in progress can be read: its end and the grace."""
        return self._window_clock.due_ns

    def window(self, t1_ns: int | None = None) -> Window:
        """The window in progress, up to its end or to ``t1_ns`` (earlier: the last of a
        recording, or what was sampled before the sampler died). It stays the window in progress
        until ``advance``."""
        t0 = self.t0_ns
        t1 = self.t1_ns if t1_ns is None else t1_ns
        sampler = self.sampler
        parts = []
        for g in self._groups:
            rows = g.reader.take(t1)
            stats = reduce(rows, g.plan.fields, t0, t1, only=g.rows)
            parts.append((g, rows, stats, TickStats.of(rows)))
        devices, mixed = sampler.layout(t0, t1)
        gpu_up = sampler.gpu_up()
        counted: list[list[CountedHistogram]] = [[] for _ in parts]
        if self._histograms is not None:
            counted = self._histograms.count(
                [rows for _, rows, _, _ in parts], [g.rows for g in self._groups], devices, mixed
            )
        now_ns = self.clock.now_ns()
        groups = tuple(
            GroupWindow(g.plan, rows, stats, ticks, g.health(sampler, now_ns), tuple(hist))
            for (g, rows, stats, ticks), hist in zip(parts, counted, strict=True)
        )
        return Window(t0, t1, groups, devices, mixed, gpu_up)

    def advance(self) -> int:
        """On to the next window; with the catch-up policy, past every window a stall missed
        (the rows are kept). Returns how many window ends it skipped."""
        clock = self._window_clock
        clock.advance()
        if not self.policy.catch_up:
            return 0
        skipped = clock.catch_up()
        if skipped:
            self._log.warning("window loop fell %d window(s) behind; catching up", skipped)
        return skipped

    async def windows(
        self, stop: asyncio.Event, duration_s: float | None = None
    ) -> AsyncIterator[Window]:
        """Each window when it is due (read off the event loop), from now until ``stop`` is set,
        ``duration_s`` has passed, or the sampler is gone (``died`` then says so)."""
        self.begin()
        end_ns = self.t0_ns + int(duration_s * 1e9) if duration_s else None
        loop = asyncio.get_running_loop()
        while True:
            if end_ns is not None and self.t1_ns > end_ns:
                await self.clock.wait(end_ns, stop)
                return
            if await self.clock.wait(self.due_ns, stop):
                return
            if not self.sampler.alive():
                self.died = True
                return
            yield await loop.run_in_executor(None, self.window)
            self.advance()

    def alive(self) -> bool:
        return self.sampler.alive()

    def stalled(self) -> Sequence[str]:
        """The groups stalled at the last window."""
        return [g.plan.name for g in self._groups if g.stalled_s]

    def close(self) -> None:
        """Stop the sampler and free its rings; safe to call twice."""
        self.sampler.close()

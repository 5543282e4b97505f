"""In-process runs for tests: a virtual clock, and a sampler that reads the source as it moves.

``VirtualClock`` moves only when the code that runs on it waits (``wait``, ``sleep``): it jumps to
the time waited for, first running what a test scheduled there (``at``: scrape /metrics, reload,
pause the sampler). ``SteppingSampler`` is the ``Sampler`` with its process replaced: at each move
of the clock it reads every group's ticks up to the new time with ``Source.read`` (the sim, or the
fake NVML), in time order, and writes them to the same shared-memory rings and status block the
sampler process writes. So the window pipeline and everything after it (`run`'s /metrics and
writers, `record`'s file) run unchanged through N windows in milliseconds, without a process or
a real sleep. The ticks are never late; a paused sampler's deadlines count as missed.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

from hfsampler.config.settings import DEFAULT_MAX_RING_BYTES
from hfsampler.errors import SourceError
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.lanes import ERROR, FAILED, GLOBAL_SLOTS, HEARTBEAT_NS, PER_GROUP, STATE
from hfsampler.sampling.lanes import RUNNING as _RUNNING
from hfsampler.sampling.sampler import Sampler
from hfsampler.sources.base import DeviceInfo, Inventory, Source, SourceSpec
from hfsampler.sources.registry import open_source

Action = Callable[[], object]  # may return an awaitable, which ``wait`` awaits


class VirtualClock:
    """Wall-clock nanoseconds that move only when waited on."""

    def __init__(self, start_ns: int) -> None:
        self._now_ns = start_ns
        self._tickers: list[Callable[[int], None]] = []
        self._actions: list[tuple[int, int, Action]] = []  # a heap of (time, order, action)
        self._order = itertools.count()

    def now_ns(self) -> int:
        return self._now_ns

    def monotonic_s(self) -> float:
        return self._now_ns / 1e9

    def at(self, t_ns: int, action: Action) -> None:
        """Run ``action`` when the clock reaches ``t_ns`` (before anything waiting past it)."""
        heapq.heappush(self._actions, (t_ns, next(self._order), action))

    def attach(self, ticker: Callable[[int], None]) -> None:
        """``ticker`` is told every new time (a stepping sampler reads up to it)."""
        self._tickers.append(ticker)

    def detach(self, ticker: Callable[[int], None]) -> None:
        if ticker in self._tickers:
            self._tickers.remove(ticker)

    def _move(self, t_ns: int) -> None:
        if t_ns > self._now_ns:
            self._now_ns = t_ns
            for ticker in list(self._tickers):
                ticker(t_ns)

    def sleep(self, seconds: float) -> None:
        until = self._now_ns + int(seconds * 1e9)
        while self._actions and self._actions[0][0] <= until:
            t_ns, _, action = heapq.heappop(self._actions)
            self._move(t_ns)
            result = action()
            if inspect.isawaitable(result):
                raise TypeError("an action for a sleeping (synchronous) caller cannot be async")
        self._move(until)

    async def wait(self, until_ns: int, stop: asyncio.Event) -> bool:
        while self._actions and self._actions[0][0] <= until_ns and not stop.is_set():
            t_ns, _, action = heapq.heappop(self._actions)
            self._move(t_ns)
            result = action()
            if inspect.isawaitable(result):
                await result
        if not stop.is_set():
            self._move(until_ns)
        await asyncio.sleep(0)  # the others on the loop get their turn, as in a real wait
        return stop.is_set()


class SteppingSampler(Sampler):
    """The sampler's rings and status block, written in this process as a ``VirtualClock``
    moves."""

    def __init__(
        self,
        spec: SourceSpec,
        inventory: Inventory,
        groups: Sequence[GroupPlan],
        window_s: float,
        clock: VirtualClock,
        max_ring_bytes: int = DEFAULT_MAX_RING_BYTES,
    ) -> None:
        super().__init__(spec, inventory, groups, window_s, max_ring_bytes=max_ring_bytes)
        self._clock = clock
        self._source: Source | None = None
        self._deadlines: list[int] = []
        self._published: tuple[DeviceInfo, ...] | None = None
        self._paused_to: int | None = None  # the last time seen while paused
        self.paused = False
        self._failed: str | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        source = open_source(replace(self.spec, reopened=True))
        try:
            source.open([f for g in self.groups for f in g.fields])
        except Exception as exc:
            source.close()
            raise SourceError(
                f"the stepping sampler could not open the source: cannot open the "
                f"{self.spec.kind} source: {exc}"
            ) from None
        self._source = source
        now = self._clock.now_ns()
        self._deadlines = [
            now - now % int(g.interval_s * 1e9) + int(g.interval_s * 1e9) for g in self.groups
        ]
        s = self._array()
        gpu_slot = GLOBAL_SLOTS + PER_GROUP * len(self.groups)
        s[gpu_slot : gpu_slot + len(self.inventory.devices)] = 1
        s[STATE] = _RUNNING
        self._clock.attach(self.step)

    def pause(self) -> None:
        """Stop ticking, as a sampler process stopped (SIGSTOP) or stuck in a read."""
        self.paused = True

    def resume(self) -> None:
        """Tick again; the deadlines passed meanwhile are counted missed."""
        self.paused = False

    def fail(self, reason: str) -> None:
        """End as a sampler process does that died: not alive, and ``reason`` is why."""
        self._failed = reason
        s = self._array()
        s[ERROR], s[STATE] = 1, FAILED
        self.stop()

    def step(self, now_ns: int) -> None:
        """Read every tick due by ``now_ns``, earliest first (the fastest group on a tie)."""
        src = self._source
        if src is None:
            return
        if self.paused:
            self._paused_to = now_ns
            return
        s = self._array()
        intervals = [int(g.interval_s * 1e9) for g in self.groups]
        if self._paused_to is not None:
            for k, interval in enumerate(intervals):
                if self._deadlines[k] <= self._paused_to:
                    missed = (self._paused_to - self._deadlines[k]) // interval + 1
                    self._deadlines[k] += missed * interval
                    s[GLOBAL_SLOTS + PER_GROUP * k + 2] += missed
            self._paused_to = None
        try:
            while True:
                k = min(range(len(self.groups)), key=self._deadlines.__getitem__)
                t_ns = self._deadlines[k]
                if t_ns > now_ns:
                    break
                ring = self.rings[self.groups[k].name]
                values, driver = ring.slot()
                src.read(self.groups[k].fields, values, driver, t_ns)
                ring.commit(t_ns, 0)
                s[GLOBAL_SLOTS + PER_GROUP * k] += 1
                s[HEARTBEAT_NS] = t_ns
                if src.devices is not self._published:
                    self._published = src.devices
                    self._layouts.add(t_ns, self._published)
                self._deadlines[k] = t_ns + intervals[k]
        except Exception as exc:  # as the process's loop ends: the pipeline sees it gone
            self.fail(f"the sampler loop failed: {type(exc).__name__}: {exc}")
            return
        gpu_slot = GLOBAL_SLOTS + PER_GROUP * len(self.groups)
        s[gpu_slot : gpu_slot + len(self.inventory.devices)] = src.gpu_up

    def alive(self) -> bool:
        return self._source is not None and self._failed is None

    def exit_reason(self) -> str | None:
        return self._failed

    @property
    def pid(self) -> int | None:
        return None

    def stop(self, timeout_s: float = 5.0) -> None:
        self._clock.detach(self.step)
        if self._source is not None:
            self._source.close()
        self._source = None

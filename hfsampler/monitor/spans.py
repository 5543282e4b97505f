"""Reading a span of the rings into a window's numbers: where each quantity is, which rows a span
is, and its ``Answer`` per GPU.

What the Monitor's reducer process does for each window (``monitor.reducer``), and what the
job's process does itself where it cannot ask that process (a forked child, a test's virtual
clock, a window reaching back near the rings' oldest row or longer than they hold). Finding a
span's rows is a binary search over the rings' read times in pure Python (``Ring.seq_at``);
copying them (``Ring.columns``) and reducing them (``measurement.reduce_span``) is the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hfsampler.errors import SourceError
from hfsampler.fields import CLOCK_EVENTS, ENERGY, FB_USED, POWER, locate
from hfsampler.monitor.measurement import Answer, Layout, Span, counter_energy_j, reduce_span
from hfsampler.sampling.plan import RunPlan
from hfsampler.sampling.ring import Ring, RingCells

# The energy counter answers only for windows this many of its sampling intervals long.
COUNTER_STEPS = 10


@dataclass(frozen=True, slots=True)
class Parts:
    """Where each quantity is: the power's group, and the columns of it a window reads."""

    group: str
    cols: list[int]  # the group's columns a window reads, in this order: the power first,
    memory: int | None  # then these (their positions in ``cols``; None: not with the power)
    events: int | None
    energy: tuple[str, int] | None  # the energy counter's group and column
    intervals_ns: dict[str, int]

    @classmethod
    def of(cls, plan: RunPlan) -> Parts:
        groups = [g.fields for g in plan.groups]
        power = locate(POWER, groups)
        if power is None:
            raise SourceError(f"the {plan.spec.kind} source reports no power for these GPUs")
        # throttle reasons and memory are read with the power, from its ring, when they are in
        # its group (the fast one, by default)
        found = [locate(role, groups) for role in (CLOCK_EVENTS, FB_USED)]
        cols = [power[1], *(f[1] for f in found if f is not None and f[0] == power[0])]
        events, memory = (cols.index(f[1]) if f is not None and f[0] == power[0] else None
                          for f in found)  # fmt: skip
        energy = locate(ENERGY, groups)
        intervals = {g.name: int(g.interval_s * 1e9) for g in plan.groups}
        return cls(
            plan.groups[power[0]].name, cols, memory, events,
            None if energy is None else (plan.groups[energy[0]].name, energy[1]), intervals,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Rows:
    """A span's rows of the power's ring, as rows ever written: ``[start, stop)``, where
    ``start`` is the last row read before the window (its value holds at the window's start),
    or, ``own``, the window's own first row (nothing was sampled before the window)."""

    start: int
    stop: int
    own: bool


def bounds(ring: Ring, t0_ns: int, t1_ns: int, stop: int | None = None) -> Rows | None:
    """The rows read in ``[t0_ns, t1_ns]`` and the last one before; None when the ring no longer
    holds the row before. ``stop``: the ring's head when the window ended, for a window that
    ended then: the rows up to it count too (one read since ``t1_ns`` holds a value the driver
    had by then, or clips to nothing). Rows are published after their read: one read before
    ``t1_ns`` may come after the head, and counts (asked later, as the reducer is)."""
    first, oldest = ring.seq_at(t0_ns)
    end = ring.seq_at(t1_ns + 1)[0]
    if stop is not None:
        end = max(end, stop)
    if first > oldest:
        return Rows(first - 1, end, False)
    if oldest == 0:
        return Rows(first, end, True)
    return None


class SpanReader:
    """Reads spans of one Monitor's rings: the cells of its GPUs, made once."""

    def __init__(self, parts: Parts, rows: Sequence[int], rings: Mapping[str, Ring]) -> None:
        """``rows``: the Monitor's GPUs' rows in the rings; ``rings`` by group name."""
        self._parts = parts
        self._gpus = len(rows)
        self._rings = rings
        self._ring = rings[parts.group]
        self._cells = self._ring.cell_index(rows, parts.cols)
        self._layout = Layout.of(len(rows), parts.memory, parts.events)
        energy = parts.energy
        self._energy_cells: list[int] | None = None
        if energy is not None:
            self._energy_cells = rings[energy[0]].cell_index(rows, [energy[1]]).tolist()

    @property
    def ring(self) -> Ring:
        """The power's ring, whose rows ``bounds`` finds."""
        return self._ring

    def answer(self, t0_ns: int, t1_ns: int, stop: int | None = None) -> Answer | None:
        """The numbers of ``[t0_ns, t1_ns)`` (``stop``: as ``bounds`` takes it); None when the
        ring no longer held all its rows."""
        rows = bounds(self._ring, t0_ns, t1_ns, stop)
        if rows is None:
            return None
        span = self.span(rows, t0_ns, t1_ns)
        if span is None:
            return None
        return Answer.of(span, self._counter(t0_ns, t1_ns))

    def span(self, rows: Rows, t0_ns: int, t1_ns: int, histogram: bool = False) -> Span | None:
        """The span's reductions (``histogram``: with the power's, as running statistics keep
        it); None when the ring no longer held all its rows."""
        cells = self._read(rows, t0_ns)
        if cells is None:
            return None
        return reduce_span(cells, t0_ns, t1_ns, self._layout, histogram=histogram)

    def _read(self, rows: Rows, t0_ns: int) -> RingCells | None:
        """The rows of the window's cells, the first one's timestamps moved to ``t0_ns`` where it
        is the window's own."""
        cells, whole = self._ring.columns(rows.start, rows.stop, self._cells)
        if not whole:
            return None
        if rows.own and len(cells):
            cells.driver_ts_us[:, 0] = t0_ns // 1000
        return cells

    def _counter(self, t0_ns: int, t1_ns: int) -> list[float | None]:
        """Per GPU, the energy counter's answer in J where the window is long enough: the
        counter's mean power between its own updates (its rise over their driver timestamps)
        times the window, so that its ~100 ms steps are not taken for the job's energy."""
        none: list[float | None] = [None] * self._gpus
        p = self._parts
        if p.energy is None or self._energy_cells is None:
            return none
        group = p.energy[0]
        if t1_ns - t0_ns < COUNTER_STEPS * p.intervals_ns[group]:
            return none
        ring = self._rings[group]
        found = bounds(ring, t0_ns, t1_ns)
        if found is None or found.stop - found.start < 2:
            return none
        first = ring.row(found.start, self._energy_cells)
        last = ring.row(found.stop - 1, self._energy_cells)
        if not ring.holds(found.start):
            return none
        if found.own:
            first = (first[0], [t0_ns // 1000] * len(first[1]))
        return counter_energy_j(first, last, t1_ns - t0_ns)

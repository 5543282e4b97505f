"""Running statistics of the open windows: a window longer than the rings hold, still answered.

The rings keep the last ``history_s`` of samples. Every quarter of that (a pass), the span since
the pass before is reduced once, with a power histogram (``Span``), and added to each open
window's running statistics; a window begun since the pass before starts its own from its begin.
The rings still hold all of that at a pass, so the running statistics are as exact as a read of
the rings: energy, peak, throttled time and memory exactly; the p99 from the histogram, to a
watt. A window whose begin the rings no longer hold is then its running statistics up to the last
pass and a read of the rings from there. A pass that came too late (the rings had moved past the
pass before: a job that held the GIL for a quarter of the history, or a pass before it that took
as long, reducing thousands of windows begun since the one before it, one by one) leaves the
open windows without running statistics: they are refused rather than answered from part of
their span, with a ``Missed`` that says which of those it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from hfsampler.monitor.measurement import Span

# [t0_ns, t1_ns) -> the span's reductions with a histogram; None: the rings no longer hold it
Reduce = Callable[[int, int], Span | None]


@dataclass(frozen=True, slots=True)
class Missed:
    """Why a window has no running statistics: the pass that came too late, or none yet."""

    gap_s: float  # from the pass before to the one that could not read (or to now: none yet)
    took_s: float  # how long the pass before it took (or the pass running now, so far)
    begun: int  # the windows that pass reduced one by one: those begun since the one before
    passing: bool = False  # no pass since the window began: the one running now is that long

    def cause(self, pass_s: float, more: str) -> str:
        """For a person: what kept the passes (one due every ``pass_s``) from reading the
        window, and the fix; ``more``: the fix that a longer history would be."""
        if self.passing or self.took_s >= self.gap_s / 2:
            so_far = " so far" if self.passing else ""
            return (
                f"its running statistics (a pass every {pass_s:g} s) missed part of it: a pass "
                f"took {self.took_s:.1f} s{so_far}, reducing the {self.begun} windows begun "
                "since the pass before one by one, and the rings moved on meanwhile; keep "
                "fewer windows open at once (each one begun costs the next pass a read of the "
                "rings from its begin)"
            )
        return (
            f"its running statistics missed part of it: no pass of them ran for "
            f"{self.gap_s:.1f} s, though one is due every {pass_s:g} s (the job kept their "
            f"thread from running, holding the GIL); {more}, which gives them more time"
        )


@dataclass(frozen=True, slots=True)
class _Running:
    begin_ns: int
    span: Span | None  # from begin_ns to the last pass; None: a pass could not read its part
    missed: Missed | None = None  # why span is None


class RunningStats:
    """Each open window's statistics up to the last pass."""

    def __init__(self, reduce: Reduce, start_ns: int, now_ns: Callable[[], int] = time.time_ns):
        """``now_ns``: the clock a pass's own time is read from (a test's, moved by its
        reductions)."""
        self._reduce = reduce
        self._now_ns = now_ns
        self._lock = threading.Lock()
        self._running: dict[Hashable, _Running] = {}
        self.passed_ns = start_ns  # the last pass
        self._took_s, self._begun = 0.0, 0  # the last pass's time, and the windows it began
        self._passing: tuple[int, int] | None = None  # the pass running now: its start, begun

    def advance(self, now_ns: int, open_windows: Mapping[Hashable, int]) -> None:
        """A pass at ``now_ns``: ``open_windows`` are the windows open now and their begins."""
        started = self._now_ns()
        since = self.passed_ns
        begun = {k: b for k, b in open_windows.items()
                 if k not in self._running or self._running[k].begin_ns != b}  # fmt: skip
        self._passing = (started, len(begun))
        chunk = self._reduce(since, now_ns)
        starts = {k: self._reduce(b, now_ns) for k, b in begun.items()}
        # why a span this pass could not read is missing: it came this long after the one
        # before, which took this long
        missed = Missed((now_ns - since) / 1e9, self._took_s, self._begun)
        with self._lock:
            running: dict[Hashable, _Running] = {}
            for key, begin in open_windows.items():
                if key in starts:
                    span = starts[key]
                    running[key] = _Running(begin, span, missed if span is None else None)
                    continue
                old = self._running.get(key)
                if old is None:  # ended (and taken) since the pass began
                    continue
                if old.span is None or chunk is None:
                    running[key] = _Running(begin, None, old.missed or missed)
                else:
                    running[key] = _Running(begin, old.span.merge(chunk))
            self._running = running
            self.passed_ns = now_ns
            self._took_s, self._begun = (self._now_ns() - started) / 1e9, len(begun)
            self._passing = None

    def claim(self, key: Hashable, begin_ns: int, now_ns: int) -> tuple[Span, int] | Missed:
        """The window's statistics up to the last pass and that pass's time, once; or why it
        has none: the pass that could not read its part; or, for a window begun since the last
        pass, the time from that pass to ``now_ns`` and, if a pass is running now, how long it
        has run and for how many windows."""
        with self._lock:
            found = self._running.pop(key, None)
            passed = self.passed_ns
        if found is not None and found.begin_ns == begin_ns:
            if found.span is not None:
                return found.span, passed
            if found.missed is not None:
                return found.missed
        return self.behind(now_ns)

    def behind(self, now_ns: int) -> Missed:
        """How far behind the passes are at ``now_ns``: the time since the last pass, and how
        long that one took, or the one running now has so far, for how many windows."""
        with self._lock:
            passed, took_s, begun, passing = (self.passed_ns, self._took_s, self._begun,
                                              self._passing)  # fmt: skip
        if passing is not None:
            took_s, begun = (self._now_ns() - passing[0]) / 1e9, passing[1]
        return Missed((now_ns - passed) / 1e9, took_s, begun, passing=passing is not None)

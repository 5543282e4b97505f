"""Running statistics of the open windows: a window longer than the rings hold, still answered.

The rings keep the last ``history_s`` of samples. Every quarter of that (a pass), the span since
the pass before is reduced once, with a power histogram (``Span``), and added to each open
window's running statistics; a window begun since the pass before starts its own from its begin.
The rings still hold all of that at a pass, so the running statistics are as exact as a read of
the rings: energy, peak, throttled time and memory exactly; the p99 from the histogram, to a
watt. A window whose begin the rings no longer hold is then its running statistics up to the last
pass and a read of the rings from there. A pass that came too late (the rings had moved past the
pass before: a job that held the GIL for a quarter of the history) leaves the open windows
without running statistics: they are refused rather than answered from part of their span.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from hfsampler.monitor.measurement import Span

# [t0_ns, t1_ns) -> the span's reductions with a histogram; None: the rings no longer hold it
Reduce = Callable[[int, int], Span | None]


@dataclass(frozen=True, slots=True)
class _Running:
    begin_ns: int
    span: Span | None  # from begin_ns to the last pass; None: a pass could not read its part


class RunningStats:
    """Each open window's statistics up to the last pass."""

    def __init__(self, reduce: Reduce, start_ns: int) -> None:
        self._reduce = reduce
        self._lock = threading.Lock()
        self._running: dict[Hashable, _Running] = {}
        self.passed_ns = start_ns  # the last pass

    def advance(self, now_ns: int, open_windows: Mapping[Hashable, int]) -> None:
        """A pass at ``now_ns``: ``open_windows`` are the windows open now and their begins."""
        since = self.passed_ns
        chunk = self._reduce(since, now_ns)
        begun = {k: b for k, b in open_windows.items()
                 if k not in self._running or self._running[k].begin_ns != b}  # fmt: skip
        starts = {k: self._reduce(b, now_ns) for k, b in begun.items()}
        with self._lock:
            running: dict[Hashable, _Running] = {}
            for key, begin in open_windows.items():
                if key in starts:
                    running[key] = _Running(begin, starts[key])
                    continue
                old = self._running.get(key)
                if old is None:  # ended (and taken) since the pass began
                    continue
                merged = None if old.span is None or chunk is None else old.span.merge(chunk)
                running[key] = _Running(begin, merged)
            self._running = running
            self.passed_ns = now_ns

    def take(self, key: Hashable, begin_ns: int) -> tuple[Span, int] | None:
        """The window's statistics up to the last pass and that pass's time, once; None when it
        has none (begun since the last pass, or a pass could not read its part)."""
        with self._lock:
            found = self._running.pop(key, None)
            passed = self.passed_ns
        if found is None or found.begin_ns != begin_ns or found.span is None:
            return None
        return found.span, passed

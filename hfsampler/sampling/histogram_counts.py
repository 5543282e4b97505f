"""Native histograms of every distinct sample: the sampling stage's cumulative counts per series.

A ``HistogramCounter`` keeps one ``HistogramAccumulator`` per GPU row (a GPU, or a MIG slot's
instance) and histogram field of each group, and counts each window's ring rows into them with
one ``add_window`` per group (every row and field at once; NaN, a repeat, is no sample). It hands
back each accumulator's snapshot for the metric model to name (``CountedHistogram``).

The counts follow the series they will be exported as, so they restart (reset hint YES) where
that series does:
- a MIG slot whose instance changed: the new instance's histogram starts from 0; the window
  of the change mixes two instances' samples and is counted into neither (its floats are left
  out as well), so no instance's histogram ever holds another's samples;
- a reload that changes the histogram fields or the error: the changed fields' accumulators
  start over (a new schema cannot be merged into old buckets), the others keep counting.
A GPU that is down has no samples to count; its counts wait for it and go on when it is back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.config.settings import Config
from hfsampler.histograms import HistogramAccumulator, NativeHistogram, add_window
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sources.base import DeviceInfo

BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class HistogramChoice:
    """What to count: the fields (by catalogue name) and the bucket schema."""

    names: frozenset[str] = frozenset()
    schema: int = 3


def choice_of(config: Config) -> HistogramChoice:
    """What ``config`` asks to count (``histograms``, ``histogram_relative_error``)."""
    return HistogramChoice(
        frozenset(f.name for f in config.histogram_fields()), config.histogram_schema
    )


@dataclass(frozen=True, slots=True)
class CountedHistogram:
    """One series' cumulative histogram at a window's end: its row and its column among the
    group's fields."""

    row: int
    column: int
    histogram: NativeHistogram


class _GroupCounts:
    """One group's accumulators, ``[row][k]`` for its k-th histogram column (None: none yet)."""

    __slots__ = ("accumulators", "columns", "schema")

    def __init__(self, columns: Sequence[int], rows: int, schema: int) -> None:
        self.columns = np.asarray(columns, dtype=np.intp)
        self.schema = schema
        self.accumulators: list[list[HistogramAccumulator | None]] = [
            [None] * len(columns) for _ in range(rows)
        ]

    def restart_row(self, row: int) -> None:
        self.accumulators[row] = [None] * len(self.columns)

    def count(self, values: npt.NDArray[np.float64], rows: Sequence[int]) -> None:
        """``values[n, row, field]`` of the group's ring rows; only ``rows`` are counted."""
        if not len(rows) or not values.shape[0]:
            return
        k = len(self.columns)
        block = values[:, np.asarray(rows, dtype=np.intp)][:, :, self.columns]
        present = ~np.isnan(block).all(axis=0)  # [row, k]: cells with a sample this window
        cells = np.flatnonzero(present.ravel())
        if not cells.size:
            return
        targets = []
        for cell in cells.tolist():
            r, c = rows[cell // k], cell % k
            acc = self.accumulators[r][c]
            if acc is None:
                acc = self.accumulators[r][c] = HistogramAccumulator(self.schema)
            targets.append(acc)
        add_window(targets, block.reshape(block.shape[0], -1)[:, cells])

    def snapshots(self) -> list[CountedHistogram]:
        out = []
        for r, accs in enumerate(self.accumulators):
            for c, acc in enumerate(accs):
                if acc is not None:
                    out.append(CountedHistogram(r, int(self.columns[c]), acc.snapshot()))
        return out


class HistogramCounter:
    """Every group's accumulators, for the devices of ``devices`` (one per GPU row)."""

    def __init__(
        self,
        groups: Sequence[GroupPlan],
        devices: Sequence[DeviceInfo],
        choice: HistogramChoice = HistogramChoice(),
    ) -> None:
        self._plans = tuple(groups)
        self._devices = tuple(devices)
        self._choice = choice
        self._wanted = choice  # set by ``choose``, taken at the next window
        self._groups = [self._group(p, choice.schema, choice.names) for p in self._plans]

    def _group(self, plan: GroupPlan, schema: int, names: frozenset[str]) -> _GroupCounts:
        columns = [j for j, f in enumerate(plan.fields) if f.name in names]
        return _GroupCounts(columns, len(self._devices), schema)

    def choose(self, choice: HistogramChoice) -> None:
        """A reload's choice, taken at the next window (``count`` runs off the event loop: the
        swap is one assignment, read once there)."""
        self._wanted = choice

    def _take_choice(self) -> None:
        wanted, running = self._wanted, self._choice
        if wanted == running:
            return
        for i, plan in enumerate(self._plans):
            old = self._groups[i]
            new = self._group(plan, wanted.schema, wanted.names)
            if wanted.schema == running.schema:  # unchanged fields keep their counts
                kept = {int(c): k for k, c in enumerate(old.columns)}
                for k, c in enumerate(new.columns.tolist()):
                    if c in kept:
                        for r in range(len(self._devices)):
                            new.accumulators[r][k] = old.accumulators[r][kept[c]]
            self._groups[i] = new
        self._choice = wanted

    def count(
        self,
        rows: Sequence[RingRows],
        counted_rows: Sequence[Sequence[int] | None],
        devices: Sequence[DeviceInfo],
        mixed: BoolArray,
    ) -> list[list[CountedHistogram]]:
        """Count one window: ``rows[g]`` of group ``g`` (its rows ``counted_rows[g]``, None:
        all), the window's ``devices`` and the rows whose device changed inside it. Returns
        every group's snapshots: each series that has counted anything, once per window."""
        self._take_choice()
        for r, device in enumerate(devices):
            if device != self._devices[r] or mixed[r]:
                for g in self._groups:
                    g.restart_row(r)
        self._devices = tuple(devices)
        out = []
        for g, group_rows, only in zip(self._groups, rows, counted_rows, strict=True):
            if len(g.columns):
                wanted = range(len(devices)) if only is None else only
                g.count(group_rows.values, [r for r in wanted if not mixed[r]])
            out.append(g.snapshots())
        return out

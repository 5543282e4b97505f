"""The health of an open nvml source's rows: which answer, what has failed, and saying so once.

Every piece of failure state the source keeps lives here, and only this object's methods change
it, under one lock that is never held across an NVML call (reads of different field sets run at
once on the sampler's two lanes). Between any two of its calls these hold:

1. A GPU row that goes down stays down while open (a lost GPU is not asked again), and its MIG
   slots are down with it: no method brings up a slot of a GPU that is down.
2. ``slot_down`` (slots down because their own instance stopped answering, which the rescan asks
   again) holds only slots that are down, of GPUs that are up.
3. ``slot_failing`` (slots whose last read failed, each of which made one rescan due) holds
   slots only.
4. Every held warning (a slot's call that failed as a destroyed instance's handle does, said only
   if the rescan finds the instance still there) is of a call in ``failing_calls``, on a slot.
5. ``errors`` (per row, cells that had a value to read and got an error instead) only grows.
6. A row's streak of NVML_ERROR_UNKNOWN answers stays below ``UNKNOWN_LIMIT`` while it is up.
7. A slot whose instance changes, or that answers again after going down, starts clean: no
   streak, not failing, no failing call or cell, nothing held.

What readers look at on the hot path is published read-only: ``up`` (a numpy view that cannot be
written) and ``failing_calls`` (a frozenset replaced, not changed, on the rare change).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from hfsampler.sources.base import BoolArray, IntArray
from hfsampler.sources.nvml import calls, mig
from hfsampler.sources.nvml.rows import Rows

log = logging.getLogger("hfsampler.sources.nvml.source")

UNKNOWN_LIMIT = 10  # consecutive NVML_ERROR_UNKNOWN answers before a GPU is taken as lost

CallKey = tuple[int, str]  # (row, reader key) of a per-device call


class Health:
    """Which rows answer, what failed on each, and the log lines that say so."""

    __slots__ = (
        "_cells",
        "_errors",
        "_held",
        "_lock",
        "_physical",
        "_rescan_due",
        "_rows",
        "_slot_down",
        "_slot_failing",
        "_unknown",
        "_up",
        "failing_calls",
        "up",
    )

    def __init__(self, rows: Rows) -> None:
        self._rows = rows
        self._physical = rows.physical
        n = len(rows)
        self._up = np.ones(n, dtype=np.bool_)
        self._up[rows.physical :] = False  # until an instance is found in the slot
        self.up: BoolArray = self._up.view()  # the rows up now, for readers; changes as they do
        self.up.flags.writeable = False
        self._unknown = [0] * n
        self._errors = np.zeros(n, dtype=np.int64)
        self._lock = threading.Lock()
        self.failing_calls: frozenset[CallKey] = frozenset()  # whose last read failed
        self._held: dict[CallKey, str] = {}
        self._slot_down: set[int] = set()
        self._slot_failing: set[int] = set()
        self._rescan_due = False
        self._cells: list[BoolArray] = []  # every batch's failing cells, [row, entry]

    # -- what it holds, read-only ----------------------------------------------------------

    @property
    def errors(self) -> IntArray:
        """Per row: cells that had a value to read and got an error instead, since open."""
        return self._errors.copy()

    @property
    def slot_down(self) -> frozenset[int]:
        """Slots down because their own instance stopped answering (asked again each rescan)."""
        return frozenset(self._slot_down)

    @property
    def slot_failing(self) -> frozenset[int]:
        """Slots whose last read failed."""
        return frozenset(self._slot_failing)

    @property
    def held_calls(self) -> frozenset[CallKey]:
        """The calls whose warning waits for the rescan to say whether their instance went."""
        return frozenset(self._held)

    def unknown_streak(self, g: int) -> int:
        return self._unknown[g]

    @property
    def rescan_due(self) -> bool:
        """A slot started failing since the last rescan: its instance may have gone."""
        return self._rescan_due

    def rescan_started(self) -> None:
        self._rescan_due = False

    # -- rows answering or not -------------------------------------------------------------

    def answered(self, g: int) -> None:
        """Row ``g`` answered: its streak of unknown errors ends, and a slot's failing (no lock
        when there is neither: the hot path)."""
        if self._unknown[g] or (self._slot_failing and g in self._slot_failing):
            with self._lock:
                self._unknown[g] = 0
                self._slot_failing.discard(g)

    def failed(self, g: int, code: int, cells: int = 0) -> bool:
        """Account an error answer from row ``g`` that cost ``cells`` values.

        True when it takes the row down (or found it down already for this code).
        """
        with self._lock:
            if g >= self._physical and code not in calls.LOST_CODES and g not in self._slot_failing:
                # a slot that starts failing: most likely its instance went, so look at the
                # layout soon; one that goes on failing while its instance stays forces no more
                self._slot_failing.add(g)
                self._rescan_due = True
            self._errors[g] += cells
            if code in calls.LOST_CODES:
                pass
            elif code == calls.UNKNOWN_CODE:
                self._unknown[g] += 1
                if self._unknown[g] < UNKNOWN_LIMIT:
                    return False
            else:
                return False
            down = self._take_down(g, code)
        if down is not None:
            self._say_down(down, code)
        return True

    def entry_errors(self, bad: BoolArray, rets: Any) -> None:
        """A batch's entries that answered an error (``bad``, [row, entry]; ``rets`` their
        codes): counted, and a lost GPU's code takes it down."""
        with self._lock:
            self._errors += bad.sum(axis=1)
        for g in np.flatnonzero(bad.any(axis=1)):
            lost = [int(r) for r in rets[g][bad[g]] if int(r) in calls.LOST_CODES]
            if lost:
                self.mark_down(int(g), lost[0])

    def mark_down(self, g: int, code: int) -> None:
        """Row ``g`` stopped answering (``code``): down, said once."""
        with self._lock:
            down = self._take_down(g, code)
        if down is not None:
            self._say_down(down, code)

    def _take_down(self, g: int, code: int) -> int | None:
        """Under the lock: the row that goes down (None: it was down already)."""
        if g >= self._physical and code in calls.LOST_CODES:
            # an instance answering "GPU lost" speaks for its GPU: one line, every row down
            g = self._rows.gpu_of(g)
        if not self._up[g]:
            return None
        self._up[g] = False
        if g >= self._physical:
            self._slot_down.add(g)
        slots = self._rows.slots_of(g)
        if slots:
            self._up[list(slots)] = False  # its instances go with it
            self._slot_down.difference_update(slots)  # down for good with it
        return g

    def _say_down(self, g: int, code: int) -> None:
        info = self._rows.devices[g]
        if g >= self._physical:
            # only the instance went: its GPU's row and the other instances keep sampling
            log.error(
                "%s stopped answering: %s; the instance's series go stale, GPU %s and its other "
                "instances continue; asked again once a second",
                self._rows.name(g), calls.error_text(code), info.index,
            )  # fmt: skip
            return
        log.error(
            "GPU %s (%s) stopped answering: %s; no longer sampled, the others continue",
            info.index, info.uuid, calls.error_text(code),
        )  # fmt: skip

    # -- calls and cells that fail, and read again -----------------------------------------

    def call_failed(self, g: int, key: str, names: str, code: int) -> None:
        """Row ``g``'s call ``key`` (reading ``names``) starts failing with ``code``: said.

        On a MIG slot, a code a destroyed instance's handle answers is said only if the rescan
        (soon: the failure forced one) finds the instance still there; gone, the layout change
        says it.
        """
        line = (
            f"{self._rows.name(g)}: reading {names} failed: {calls.error_text(code)}; its series "
            "go stale while it fails (said again when it reads)"
        )
        with self._lock:
            self.failing_calls = self.failing_calls | {(g, key)}
            if g >= self._physical and code in mig.GONE_CODES:
                self._held[(g, key)] = line
                return
        log.warning("%s", line)

    def call_answers(self, g: int, key: str, names: str) -> None:
        """Row ``g``'s failing call ``key`` reads again: said, unless its failure never was."""
        with self._lock:
            self.failing_calls = self.failing_calls - {(g, key)}
            unsaid = self._held.pop((g, key), None) is not None
        if not unsaid:
            log.info("%s: %s reads again", self._rows.name(g), names)

    def failing_cells(self, entries: int) -> BoolArray:
        """A new [row, entry] record of a batch's entries whose last read failed."""
        cells = np.zeros((len(self._rows), entries), dtype=np.bool_)
        self._cells.append(cells)
        return cells

    def cells_read(
        self, failing: BoolArray, bad: BoolArray, ok: BoolArray, rets: Any, names: tuple[str, ...]
    ) -> None:
        """A batch read: ``bad`` entries answered an error, ``ok`` ones a value. A field that
        starts failing on a GPU is said once, and so is its first good read after: a field that
        fails for good is a warning, not series vanishing without a word. ``failing`` is the
        batch's record from ``failing_cells``, updated in place."""
        started = bad & ~failing
        ended = ok & failing
        failing |= bad
        failing &= ~ok
        for g, k in zip(*np.nonzero(started), strict=True):
            code = int(rets[g][k])
            if code in calls.LOST_CODES:
                continue  # the GPU is lost: mark_down says so
            log.warning(
                "%s: reading %s failed: %s; its series go stale while it fails (said again "
                "when it reads)",
                self._rows.name(int(g)), names[k], calls.error_text(code),
            )  # fmt: skip
        for g, k in zip(*np.nonzero(ended), strict=True):
            log.info("%s: %s reads again", self._rows.name(int(g)), names[k])

    # -- MIG slots, as the rescan finds them -----------------------------------------------

    def release_held(self, slot: int, *, warn: bool) -> None:
        """The rescan found the slot's instance still there (``warn``: its calls' failures were
        its own, said now) or empty (the held lines are dropped: the layout change says it)."""
        if not self._held:
            return
        with self._lock:
            lines = [self._held.pop(k) for k in [k for k in self._held if k[0] == slot]]
        if warn:
            for line in lines:
                log.warning("%s", line)

    def slot_changed(self, slot: int, *, occupied: bool) -> None:
        """Another instance (``occupied``) or none is in the slot now: it starts clean, up while
        occupied and its GPU is up; what failed was the one before's and is not said again."""
        with self._lock:
            self._forget(slot)
            self._up[slot] = occupied and bool(self._up[self._rows.gpu_of(slot)])
            self._unknown[slot] = 0
            self._slot_down.discard(slot)
            self._slot_failing.discard(slot)

    def slot_answers(self, slot: int) -> bool:
        """A slot down while its instance stays answers again: up and clean. False when it is
        not down for its own (the layout changed, or its GPU went, meanwhile)."""
        with self._lock:
            if slot not in self._slot_down:
                return False
            self._slot_down.discard(slot)
            self._slot_failing.discard(slot)
            self._up[slot] = True
            self._unknown[slot] = 0
            self._forget(slot)  # said by the caller, not again as each call reads
        return True

    def _forget(self, slot: int) -> None:
        """Under the lock: the slot's failing calls, cells and held lines end with it."""
        for key in [k for k in self._held if k[0] == slot]:
            del self._held[key]
        if any(k[0] == slot for k in self.failing_calls):
            self.failing_calls = frozenset(k for k in self.failing_calls if k[0] != slot)
        for cells in self._cells:
            cells[slot] = False

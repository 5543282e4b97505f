"""A job's phases and steps, from its markers: the spans a report tables and shades.

Rules, so that a killed or sloppy job still reads sensibly:
- A ``begin`` opens a phase; an ``end`` closes the most recent open phase of the same name, so
  phases of one name nest (``begin a, begin a, end a, end a``) and phases of different names may
  nest or overlap freely. An ``end`` with no open phase of its name is ignored and said.
- A phase still open when the recording ends (the job was killed, or never ended it) ends there
  and is marked unterminated (``ended`` false).
- Steps are per marker name: step k of a name runs from its marker to the next marker of that
  name; the last runs to the end of the innermost phase that encloses its start, else to the end
  of the recording. Time between steps that holds no step marker (an evaluation between two
  training steps) belongs to the step before it.
- Markers outside the recording's time are clipped to it. Past ``MAX_PHASES`` phases (by start)
  or ``MAX_STEPS`` steps the rest are counted, not tabled, and the report says how many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.recording import Marker

IntArray = npt.NDArray[np.int64]

MAX_PHASES = 100  # phases tabled and shaded (each keeps a power histogram per GPU)
MAX_STEPS = 500_000  # steps of all names together
MAX_MARKS = 200  # instant marks drawn


@dataclass(frozen=True, slots=True)
class Phase:
    """One ``begin`` / ``end`` pair: ``[start_ns, end_ns)``."""

    name: str
    occurrence: int  # 1 for the first phase of its name, 2 for the next, ...
    start_ns: int
    end_ns: int
    ended: bool  # False: no end marker came; it ends where the recording ends
    depth: int = 0  # how many tabled phases enclose it

    @property
    def label(self) -> str:
        return self.name if self.occurrence == 1 else f"{self.name} #{self.occurrence}"


@dataclass(frozen=True, slots=True)
class StepSeries:
    """The steps of one marker name: step ``numbers[k]`` runs ``[start_ns[k], end_ns[k])``."""

    name: str
    numbers: IntArray
    start_ns: IntArray
    end_ns: IntArray


@dataclass(frozen=True, slots=True)
class Timeline:
    """Everything the markers say, resolved into spans."""

    phases: tuple[Phase, ...]
    steps: tuple[StepSeries, ...]
    marks: tuple[Marker, ...]  # instants
    problems: tuple[str, ...]  # markers that could not be used, in words
    phases_not_tabled: int = 0
    steps_not_tabled: int = 0

    def edges_ns(self) -> tuple[IntArray, IntArray]:
        """The sorted distinct edges of the phases, and of the steps."""
        phase = [t for p in self.phases for t in (p.start_ns, p.end_ns)]
        steps = [np.concatenate([s.start_ns, s.end_ns]) for s in self.steps]
        step = np.unique(np.concatenate(steps)) if steps else np.empty(0, np.int64)
        return np.unique(np.array(phase, np.int64)), step.astype(np.int64)


def timeline(markers: Sequence[Marker], start_ns: int, end_ns: int) -> Timeline:
    """Resolve markers (in time order) into phases, step series and marks (see the module)."""
    problems: list[str] = []
    open_: dict[str, list[int]] = {}
    spans: list[tuple[str, int, int, bool]] = []
    steps: dict[str, list[tuple[int, int]]] = {}
    marks: list[Marker] = []

    def clip(t: int) -> int:
        return min(max(t, start_ns), end_ns)

    for m in markers:
        at = clip(m.t_ns)
        if m.kind == "begin":
            open_.setdefault(m.name, []).append(at)
        elif m.kind == "end":
            stack = open_.get(m.name)
            if stack:
                spans.append((m.name, stack.pop(), at, True))
            else:
                problems.append(f"end of {m.name!r} at {(at - start_ns) / 1e9:.3f} s without a "
                                "begin: ignored")  # fmt: skip
        elif m.kind == "step":
            steps.setdefault(m.name, []).append((at, -1 if m.step is None else m.step))
        else:
            marks.append(m)
    for name, stack in open_.items():
        for begun in stack:
            spans.append((name, begun, end_ns, False))
            problems.append(f"phase {name!r} begun at {(begun - start_ns) / 1e9:.3f} s has no end: "
                            "it runs to the end of the recording")  # fmt: skip
    spans.sort(key=lambda s: (s[1], -s[2]))
    dropped = max(0, len(spans) - MAX_PHASES)
    spans = spans[:MAX_PHASES]
    seen: dict[str, int] = {}
    tabled_list: list[Phase] = []
    for i, (name, s, e, ended) in enumerate(spans):
        seen[name] = seen.get(name, 0) + 1
        # sorted by (start, -end): whatever encloses a phase comes before it
        depth = sum(1 for o in spans[:i] if o[1] <= s and o[2] >= e)
        tabled_list.append(Phase(name, seen[name], s, e, ended, depth))
    tabled = tuple(tabled_list)
    series, budget, not_tabled = [], MAX_STEPS, 0
    for name, items in steps.items():
        times = np.array([i[0] for i in items], np.int64)
        numbers = np.array([i[1] for i in items], np.int64)
        order = np.argsort(times, kind="stable")
        t, n = times[order], numbers[order]
        keep = min(len(t), budget)
        not_tabled += len(t) - keep
        budget -= keep
        if not keep:
            continue
        t, n = t[:keep], n[:keep]
        last_end = _enclosing_end(tabled, int(t[-1]), end_ns)
        ends = np.append(t[1:], max(last_end, int(t[-1])))
        series.append(StepSeries(name, n, t, ends))
    return Timeline(tabled, tuple(series), tuple(marks[:MAX_MARKS]), tuple(problems), dropped,
                    not_tabled)  # fmt: skip


def _enclosing_end(phases: Sequence[Phase], t_ns: int, default_ns: int) -> int:
    """The end of the innermost phase that holds ``t_ns``, else ``default_ns``."""
    holding = [p for p in phases if p.start_ns <= t_ns < p.end_ns]
    return min(holding, key=lambda p: p.end_ns - p.start_ns).end_ns if holding else default_ns

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
- Markers outside the recording's time are clipped to it; a phase wholly outside it is ignored
  and said. Past ``MAX_PHASES`` phases (by start) or ``MAX_STEPS`` steps the rest are counted,
  not tabled, and the report says how many; past ``MAX_PROBLEMS`` problems, the same.
- A job of several processes (the ranks of a DDP job) speaks with one voice: a ``begin`` / ``end``
  pairs within its own process; phases of one name from different processes that overlap are
  one phase, earliest begin to latest end; a step number said by several processes is one step,
  at the earliest time it was said.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import Marker

IntArray = npt.NDArray[np.int64]

MAX_PHASES = 100  # phases tabled and shaded (each keeps a power histogram per GPU)
MAX_STEPS = 500_000  # steps of all names together
MAX_MARKS = 200  # instant marks drawn
MAX_PROBLEMS = 20  # marker problems said in words; the rest are counted
MERGE_WINDOW = 64  # open phases of one name a process's phase may merge with (more ranks: rare)


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
    problems_not_listed: int = 0  # past MAX_PROBLEMS, counted only

    def edges_ns(self) -> tuple[IntArray, IntArray]:
        """The sorted distinct edges of the phases, and of the steps."""
        phase = [t for p in self.phases for t in (p.start_ns, p.end_ns)]
        steps = [np.concatenate([s.start_ns, s.end_ns]) for s in self.steps]
        step = np.unique(np.concatenate(steps)) if steps else np.empty(0, np.int64)
        return np.unique(np.array(phase, np.int64)), step.astype(np.int64)


def timeline(markers: Sequence[Marker], start_ns: int, end_ns: int) -> Timeline:
    """Resolve markers (in time order) into phases, step series and marks (see the module)."""
    problems, steps = _Problems(), _StepColumns()
    steps.extend([m.to_json() for m in markers if m.kind == "step"], problems)
    others = [m for m in markers if m.kind != "step"]
    return _resolve(others, steps, problems, start_ns, end_ns)


def read_timeline(rec: Recording, start_ns: int, end_ns: int) -> Timeline:
    """``timeline`` of a recording's markers, read a chunk at a time: steps go straight into
    arrays (a million steps hold some 24 MB, not a Python object each); the other markers, sorted
    by time as ``Recording.markers`` sorts them."""
    problems, steps = _Problems(), _StepColumns()
    others: list[Marker] = []
    for stored in rec.marker_chunks():
        steps.extend([d for d in stored if d.get("kind") == "step"], problems)
        others += [Marker.from_json(d) for d in stored if d.get("kind") != "step"]
    others.sort(key=lambda m: m.t_ns)
    return _resolve(others, steps, problems, start_ns, end_ns)


@dataclass(slots=True)
class _StepColumns:
    """Per step name, the steps' times, numbers (-1: none) and pids (-1: none), in chunks."""

    parts: dict[str, list[tuple[IntArray, IntArray, IntArray]]] = field(default_factory=dict)

    def extend(self, stored: Sequence[Mapping[str, Any]], problems: _Problems) -> None:
        """Step markers as stored (``Marker.to_json``); a number outside ``[0, 2**63)`` is a
        problem, not a step."""
        by_name: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for d in stored:
            step, pid = d.get("step"), d.get("pid")
            if step is not None and not 0 <= int(step) < 2**63:
                problems.add(f"step {step} of {d['name']!r}: not a step number in [0, 2**63), "
                             "ignored")  # fmt: skip
                continue
            t, n, p = by_name.setdefault(str(d["name"]), ([], [], []))
            t.append(int(d["t_ns"]))
            n.append(-1 if step is None else int(step))
            p.append(-1 if pid is None else int(pid))
        for name, (t, n, p) in by_name.items():
            arrays = (np.array(t, np.int64), np.array(n, np.int64), np.array(p, np.int64))
            self.parts.setdefault(name, []).append(arrays)

    def columns(self, name: str) -> tuple[IntArray, IntArray, IntArray]:
        parts = self.parts[name]
        t, n, p = (np.concatenate([part[k] for part in parts]) for k in range(3))
        return t, n, p


def _resolve(markers: Sequence[Marker], steps: _StepColumns, problems: _Problems, start_ns: int,
             end_ns: int) -> Timeline:  # fmt: skip
    """Phases and marks from the other markers (in time order), then the step series."""
    open_: dict[tuple[int | None, str], list[int]] = {}  # (pid, name): raw begin times
    spans: list[_Span] = []
    marks: list[Marker] = []

    def clip(t: int) -> int:
        return min(max(t, start_ns), end_ns)

    def close(name: str, pid: int | None, begun: int, ended_at: int, ended: bool) -> None:
        if ended_at < start_ns or begun > end_ns:
            problems.add(f"phase {name!r} from {(begun - start_ns) / 1e9:.3f} s to "
                         f"{(ended_at - start_ns) / 1e9:.3f} s is wholly outside the recording "
                         f"(0 s to {(end_ns - start_ns) / 1e9:.3f} s): ignored")  # fmt: skip
            return
        spans.append(_Span(name, clip(begun), clip(ended_at), ended, pid))

    for m in markers:
        if m.kind == "begin":
            open_.setdefault((m.pid, m.name), []).append(m.t_ns)
        elif m.kind == "end":
            stack = open_.get((m.pid, m.name))
            if stack:
                close(m.name, m.pid, stack.pop(), m.t_ns, True)
            else:
                at = clip(m.t_ns)
                problems.add(f"end of {m.name!r} at {(at - start_ns) / 1e9:.3f} s without a "
                             "begin: ignored")  # fmt: skip
        elif m.kind != "step":
            marks.append(m)
    for (pid, name), stack in open_.items():
        for begun in stack:
            if begun <= end_ns:
                problems.add(f"phase {name!r} begun at {(clip(begun) - start_ns) / 1e9:.3f} s "
                             "has no end: it runs to the end of the recording")  # fmt: skip
            close(name, pid, begun, end_ns, False)
    merged = _merge_ranks(spans)
    merged.sort(key=lambda s: (s[1], -s[2]))
    dropped = max(0, len(merged) - MAX_PHASES)
    merged = merged[:MAX_PHASES]
    seen: dict[str, int] = {}
    tabled_list: list[Phase] = []
    for i, (name, s, e, ended) in enumerate(merged):
        seen[name] = seen.get(name, 0) + 1
        # sorted by (start, -end): whatever encloses a phase comes before it
        depth = sum(1 for o in merged[:i] if o[1] <= s and o[2] >= e)
        tabled_list.append(Phase(name, seen[name], s, e, ended, depth))
    tabled = tuple(tabled_list)
    series, budget, not_tabled = [], MAX_STEPS, 0
    for name in steps.parts:
        times, numbers, pids = steps.columns(name)
        t, n = _one_step_per_number(times.clip(start_ns, end_ns), numbers, pids)
        # each step ends where the next begins, whether or not the next is tabled
        last_end = _enclosing_end(tabled, int(t[-1]), end_ns)
        ends = np.append(t[1:], max(last_end, int(t[-1])))
        keep = min(len(t), budget)
        not_tabled += len(t) - keep
        budget -= keep
        if not keep:
            continue
        series.append(StepSeries(name, n[:keep], t[:keep], ends[:keep]))
    return Timeline(tabled, tuple(series), tuple(marks[:MAX_MARKS]), tuple(problems.listed),
                    dropped, not_tabled, problems.not_listed)  # fmt: skip


@dataclass(slots=True)
class _Problems:
    """The first ``MAX_PROBLEMS`` problems in words, and a count of the rest."""

    listed: list[str] = field(default_factory=list)
    not_listed: int = 0

    def add(self, text: str) -> None:
        if len(self.listed) < MAX_PROBLEMS:
            self.listed.append(text)
        else:
            self.not_listed += 1


class _Span(NamedTuple):
    name: str
    start_ns: int
    end_ns: int
    ended: bool
    pid: int | None


def _merge_ranks(spans: Sequence[_Span]) -> list[tuple[str, int, int, bool]]:
    """Phases of one name from different processes that overlap become one, from the earliest
    begin to the latest end (the ranks of a DDP job each say ``phase("epoch 0")``); phases of one
    name within one process stay apart (they nest). A span joins the first phase of its name
    still open at its start that has none from its process yet, among the latest
    ``MERGE_WINDOW`` of that name (so that 50,000 phases never ended cost no more than that
    each)."""
    by_start = sorted(spans, key=lambda s: (s.start_ns, -s.end_ns))
    out: list[tuple[str, int, int, bool]] = []
    active: dict[str, list[tuple[int, set[int | None]]]] = {}  # name: (index in out, pids)
    for span in by_start:
        groups = active.setdefault(span.name, [])
        groups[:] = [g for g in groups[-MERGE_WINDOW:] if out[g[0]][2] > span.start_ns]
        for k, pids in groups:
            if span.pid not in pids:
                name, s, e, ended = out[k]
                out[k] = (name, s, max(e, span.end_ns), ended and span.ended)
                pids.add(span.pid)
                break
        else:
            groups.append((len(out), {span.pid}))
            out.append((span.name, span.start_ns, span.end_ns, span.ended))
    return out


def _one_step_per_number(times: IntArray, numbers: IntArray,
                         pids: IntArray) -> tuple[IntArray, IntArray]:  # fmt: skip
    """Step times and numbers in time order: a number said by several processes is one step, at
    the first time it was said (every rank of a DDP job says ``step(n)``); the process that said
    it first keeps all its repeats of it."""
    order = np.argsort(times, kind="stable")
    t, n, pid = times[order], numbers[order], pids[order]
    _, first, inverse = np.unique(n, return_index=True, return_inverse=True)
    keep = pid == pid[first][inverse.ravel()]
    return t[keep], n[keep]


def _enclosing_end(phases: Sequence[Phase], t_ns: int, default_ns: int) -> int:
    """The end of the innermost phase that holds ``t_ns``, else ``default_ns``."""
    holding = [p for p in phases if p.start_ns <= t_ns < p.end_ns]
    return min(holding, key=lambda p: p.end_ns - p.start_ns).end_ns if holding else default_ns

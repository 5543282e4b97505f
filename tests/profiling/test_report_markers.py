"""`hfsampler report` on markers as real jobs send them: the ranks of a DDP job, more steps than
the report tables, hostile floods of unmatched markers, phases outside the recording."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sim_recordings import synthesize
from test_report import report, report_json

from hfsampler.profiling import phases
from hfsampler.profiling.recording_format import Marker

S = 1_700_000_000 * 10**9  # a whole-second start
MS = 10**6


def test_ddp_ranks_phases_and_steps_are_merged(tmp_path: Path) -> None:
    """8 ranks each say phase("epoch e") and step(n), microseconds apart: one phase per epoch,
    one step per number, and the phases' energies add up to at most the job's."""
    ranks = range(8)
    mk = [Marker(S + e * 10**9 + r * 1000 + MS, kind, f"epoch {e}", None, "api", 100 + r)
          for e in range(4) for r in ranks for kind in ("begin",)]  # fmt: skip
    mk += [Marker(S + (e + 1) * 10**9 - MS + r * 1000, "end", f"epoch {e}", None, "api", 100 + r)
           for e in range(4) for r in ranks]  # fmt: skip
    mk += [Marker(S + n * 100 * MS + r * 50_000, "step", "step", n, "api", 100 + r)
           for n in range(40) for r in ranks]  # fmt: skip
    # one rank nests a phase of the same name inside its own: that one stays apart
    mk += [Marker(S + 1200 * MS, "begin", "epoch 1", None, "api", 100),
           Marker(S + 1300 * MS, "end", "epoch 1", None, "api", 100)]  # fmt: skip
    path = tmp_path / "ddp.hfs"
    synthesize(path, 1, 5, True, start_ns=S, markers=mk)
    d = report_json(str(path))
    labels = [p["label"] for p in d["phases"]]
    assert labels == ["epoch 0", "epoch 1", "epoch 1 #2", "epoch 2", "epoch 3"]
    e0 = d["phases"][0]
    assert e0["start_s"] == pytest.approx(0.001)
    assert e0["end_s"] == pytest.approx(0.999 + 7e-6)
    assert d["phases"][2]["depth"] == 1
    assert (
        sum(p["energy_j"] for p in d["phases"] if p["depth"] == 0)
        < d["gpus"][0]["energy_integrated_j"]
    )
    (steps,) = d["steps"]
    assert steps["steps"] == 40
    assert steps["duration_s"]["mean"] == pytest.approx(0.1, abs=1e-4)  # not 50 us


def test_steps_past_the_cap_end_at_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last tabled step ends where the first untabled one begins, not at the end."""
    monkeypatch.setattr(phases, "MAX_STEPS", 3)
    mk = [Marker(S + k * 100 * MS, "step", "s", k) for k in range(10)]
    tl = phases.timeline(mk, S, S + 60 * 10**9)
    (series,) = tl.steps
    assert list(series.end_ns - S) == [100 * MS, 200 * MS, 300 * MS]
    assert tl.steps_not_tabled == 7


def test_a_flood_of_unmatched_markers_stays_small(tmp_path: Path) -> None:
    """20k ends without a begin and 5k phases never ended: the first problems in words, the rest
    counted; the page stays small."""
    mk = [Marker(S + k * 200_000, "end", "loss") for k in range(20_000)]
    mk += [Marker(S + k * MS, "begin", f"b{k % 7}") for k in range(5_000)]
    path = tmp_path / "flood.hfs"
    synthesize(path, 1, 6, True, start_ns=S, markers=mk)
    d = report_json(str(path))
    assert len(d["marker_problems"]) == phases.MAX_PROBLEMS
    assert d["marker_problems_not_listed"] == 25_000 - phases.MAX_PROBLEMS
    page = tmp_path / "flood.html"
    made = report(str(path), "-o", str(page))
    assert made.returncode == 0, made.stderr
    text = page.read_text()
    assert text.count("<li>") == phases.MAX_PROBLEMS
    assert f"{25_000 - phases.MAX_PROBLEMS} more problems with the markers" in text
    assert page.stat().st_size < 15 * 10**6


def test_phases_outside_the_recording_are_problems(tmp_path: Path) -> None:
    mk = [Marker(S - 5 * 10**9, "begin", "before"), Marker(S - 4 * 10**9, "end", "before"),
          Marker(S + 100 * 10**9, "begin", "after"), Marker(S + 101 * 10**9, "end", "after"),
          Marker(S + 200 * 10**9, "begin", "never ended, after"),
          Marker(S + 1 * 10**9, "begin", "in"), Marker(S + 2 * 10**9, "end", "in")]  # fmt: skip
    path = tmp_path / "outside.hfs"
    synthesize(path, 1, 3, True, start_ns=S, markers=mk)
    d = report_json(str(path))
    assert [p["label"] for p in d["phases"]] == ["in"]
    outside = [p for p in d["marker_problems"] if "wholly outside the recording" in p]
    assert len(outside) == 3


def test_nested_phases_are_indented_in_the_page(tmp_path: Path) -> None:
    mk = [Marker(S + 1 * 10**9, "begin", "outer"), Marker(S + 2 * 10**9, "begin", "inner"),
          Marker(S + 3 * 10**9, "end", "inner"), Marker(S + 4 * 10**9, "end", "outer")]  # fmt: skip
    path = tmp_path / "nested.hfs"
    synthesize(path, 1, 5, True, start_ns=S, markers=mk)
    page = tmp_path / "nested.html"
    assert report(str(path), "-o", str(page)).returncode == 0
    text = page.read_text()
    assert "<tr><th>outer</th>" in text
    assert "<tr><th style='padding-left:2em'>inner</th>" in text


def test_steps_are_read_without_a_marker_object_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report reads steps chunk by chunk into arrays (1M steps: 329 MB peak, 523 MB with a
    Marker each): the same timeline as from ``Recording.markers``, a ``Marker`` per other
    marker only."""
    from hfsampler.profiling.recording import Recording

    mk = [Marker(S + k * MS, "step", "s", k, "api", 7) for k in range(3000)]
    mk += [Marker(S + 5 * MS, "begin", "a"), Marker(S + 900 * MS, "end", "a")]
    mk += [Marker(S + 6 * MS, "step", "s", 2**63 - 1), Marker(S + 7 * MS, "mark", "m")]
    path = tmp_path / "steps.hfs"
    synthesize(path, 1, 4, True, start_ns=S, markers=mk)
    rec = Recording(path)
    start, end = rec.time_range_ns()
    want = phases.timeline(rec.markers(), start, end)
    built: list[object] = []
    from_json = Marker.from_json

    def counted(d: Any) -> Marker:
        built.append(d)
        return from_json(d)

    monkeypatch.setattr(phases.Marker, "from_json", staticmethod(counted))
    got = phases.read_timeline(rec, start, end)
    assert len(built) == 3
    assert got.phases == want.phases
    assert got.marks == want.marks
    ((g,), (w,)) = (got.steps, want.steps)
    assert (g.numbers == w.numbers).all()
    assert (g.start_ns == w.start_ns).all()
    assert (g.end_ns == w.end_ns).all()
    assert len(g.numbers) == 3001


def test_a_step_number_past_int64_is_a_problem_not_a_crash() -> None:
    mk = [Marker(S + MS, "step", "s", 2**63), Marker(S + 2 * MS, "step", "s", 1)]
    tl = phases.timeline(mk, S, S + 10**9)
    (series,) = tl.steps
    assert series.numbers.tolist() == [1]
    assert any("2**63" in p for p in tl.problems)

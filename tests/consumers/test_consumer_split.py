"""A window's GPU energy split among consumers by SM share: the parts add up to the GPU's energy,
the SM ratio is the window's mean, memory the window's highest."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfsampler.consumers.identity import Consumer, Kind
from hfsampler.consumers.split import WindowUse, split

JOB_A = Consumer(Kind.HPC_JOB, hpc_job="1")
JOB_B = Consumer(Kind.HPC_JOB, hpc_job="2")
GIB = float(1 << 30)


def test_split_by_sm_share() -> None:
    # two periods; pids 10 and 11 are job A, pid 20 job B
    samples = [(10, 100, 30.0), (11, 100, 10.0), (20, 100, 20.0),
               (10, 200, 50.0), (11, 200, 10.0), (20, 200, 0.0)]  # fmt: skip
    entries = [(10, 0, 2 * GIB), (11, 0, GIB), (20, 0, 4 * GIB),
               (10, 1, 3 * GIB), (11, 1, GIB), (20, 1, GIB)]  # fmt: skip
    consumers = {10: JOB_A, 11: JOB_A, 20: JOB_B}
    got = split(WindowUse.of(120.0, samples, entries), consumers)
    by = {s.consumer: s for s in got.shares}
    # A: (30 + 10 + 50 + 10) / 2 periods = 50 %; B: 20 / 2 = 10 %
    assert by[JOB_A].sm_ratio == pytest.approx(0.5)
    assert by[JOB_B].sm_ratio == pytest.approx(0.1)
    assert by[JOB_A].energy_j == pytest.approx(100.0)
    assert by[JOB_B].energy_j == pytest.approx(20.0)
    assert got.unattributed_j == 0.0
    # memory: A's highest read is 4 GiB (3 + 1), not 2 + 3 + 1 + 1; B's is 4 GiB
    assert by[JOB_A].memory_used_bytes == 4 * GIB
    assert by[JOB_B].memory_used_bytes == 4 * GIB


def test_no_process_or_no_activity_is_unattributed() -> None:
    assert split(WindowUse.of(50.0), {}).unattributed_j == 50.0
    idle = split(WindowUse.of(50.0, [(10, 100, 0.0)], [(10, 0, GIB)]), {10: JOB_A})
    assert idle.unattributed_j == 50.0
    assert idle.shares[0].energy_j == 0.0
    assert idle.shares[0].memory_used_bytes == GIB  # still present: holds memory


def test_a_late_starter_counts_for_its_part_of_the_window() -> None:
    samples = [(10, t, 60.0) for t in range(0, 600, 100)] + [(20, 500, 60.0)]
    got = split(WindowUse.of(70.0, samples), {10: JOB_A, 20: JOB_B})
    by = {s.consumer: s for s in got.shares}
    assert by[JOB_B].sm_ratio == pytest.approx(0.1)  # 60 % for one of six periods
    assert by[JOB_A].energy_j == pytest.approx(60.0)


def test_unknown_pids_and_missing_memory() -> None:
    got = split(WindowUse.of(10.0, [(99, 0, 40.0)], [(99, 0, None), (98, 0, None)]), {})
    assert [s.consumer for s in got.shares] == [Consumer.unknown()]
    assert math.isnan(got.shares[0].memory_used_bytes)
    assert got.shares[0].energy_j == 10.0


def test_same_process_in_two_lists_counts_once() -> None:
    got = split(WindowUse.of(1.0, [], [(10, 0, GIB), (10, 0, GIB)]), {10: JOB_A})
    assert got.shares[0].memory_used_bytes == GIB


def test_mps_over_100_percent_is_clipped() -> None:
    got = split(WindowUse.of(1.0, [(10, 0, 90.0), (11, 0, 90.0)]), {10: JOB_A, 11: JOB_A})
    assert got.shares[0].sm_ratio == 1.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="energy"):
        WindowUse.of(-1.0)
    with pytest.raises(ValueError, match="length"):
        WindowUse(1.0, np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(2),
                  np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))  # fmt: skip


sample = st.tuples(st.integers(1, 12), st.integers(0, 5), st.floats(0, 100))
entry = st.tuples(st.integers(1, 12), st.integers(0, 3),
                  st.one_of(st.none(), st.floats(0, 80 * GIB)))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    energy=st.floats(0, 1e6),
    samples=st.lists(sample, max_size=40),
    entries=st.lists(entry, max_size=40),
    jobs=st.lists(st.integers(0, 3), min_size=12, max_size=12),
)
def test_parts_add_up_to_the_gpu_energy(
    energy: float,
    samples: list[tuple[int, int, float]],
    entries: list[tuple[int, int, float | None]],
    jobs: list[int],
) -> None:
    consumers = {pid: Consumer(Kind.HPC_JOB, hpc_job=str(jobs[pid - 1])) for pid in range(1, 13)}
    del consumers[12]  # one pid that nothing names: unknown
    got = split(WindowUse.of(energy, samples, entries), consumers)
    assert got.total_j == pytest.approx(energy, rel=1e-12, abs=1e-9)
    assert all(s.energy_j >= 0.0 for s in got.shares)
    assert got.unattributed_j >= 0.0
    assert all(0.0 <= s.sm_ratio <= 1.0 for s in got.shares)
    assert len({s.consumer for s in got.shares}) == len(got.shares)
    active = sum(s.sm_ratio for s in got.shares)
    if active > 0 and energy > 0:
        assert got.unattributed_j == 0.0
        for s in got.shares:  # in proportion to the SM share
            assert s.energy_j == pytest.approx(energy * s.sm_ratio / active, rel=1e-9, abs=1e-6)
    else:
        assert got.unattributed_j == energy

"""The nvml source's health: its invariants hold after every sequence of what reads and rescans do.

``Health`` needs no NVML: rows are labels and the codes are NVML's real ones. Two GPUs, GPU 0
with MIG on and three instance slots (rows 2, 3, 4), as open makes them.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np
import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hfsampler.sources.base import DeviceInfo, MigInstance
from hfsampler.sources.nvml import calls
from hfsampler.sources.nvml.health import UNKNOWN_LIMIT, Health
from hfsampler.sources.nvml.mig import MigGpu
from hfsampler.sources.nvml.rows import Rows

LOST = pynvml.NVML_ERROR_GPU_IS_LOST
GONE = calls.NOT_FOUND  # what a destroyed instance's handle answers
OTHER = calls.NOT_SUPPORTED
GPU, OTHER_GPU, SLOTS = 0, 1, (2, 3, 4)
CODES = [LOST, GONE, OTHER, calls.UNKNOWN_CODE]
KEYS = ["memory", "clock_sm"]


def make_rows() -> Rows:
    gpus = tuple(
        DeviceInfo(i, f"GPU-{i}", "NVIDIA H100", f"0000:{i:02x}:00.0", "570.133.20", i)
        for i in range(2)
    )
    slots = tuple(
        DeviceInfo(0, "GPU-0", "NVIDIA H100", "0000:00:00.0", "570.133.20", 0, mig_slot=k)
        for k in range(len(SLOTS))
    )
    return Rows([None] * 5, (*gpus, *slots), 2, [MigGpu(GPU, None, SLOTS)])


def occupy(rows: Rows, health: Health, slot: int) -> None:
    """As the rescan does when it finds an instance in ``slot``."""
    devices = list(rows.devices)
    devices[slot] = replace(devices[slot], mig=MigInstance(slot, 0, "1g.10gb", f"MIG-{slot}"))
    rows.devices = tuple(devices)
    health.slot_changed(slot, occupied=True)


def check(rows: Rows, health: Health, went_down: set[int], errors: np.ndarray) -> None:
    """Every invariant the health's docstring states; ``went_down``: GPU rows seen down."""
    up = health.up
    slots = set(rows.slots)
    for g in range(rows.physical):  # 1: a GPU down stays down, and so do its slots
        if not up[g]:
            went_down.add(g)
        if g in went_down:
            assert not up[g]
            assert not up[list(rows.slots_of(g))].any()
    for s in health.slot_down:  # 2: down for its own instance, of a GPU up
        assert s in slots
        assert not up[s]
        assert up[rows.gpu_of(s)]
    assert health.slot_failing <= slots  # 3
    assert health.held_calls <= health.failing_calls  # 4: a held line's call is failing
    assert all(g in slots for g, _ in health.held_calls)
    assert (health.errors >= errors).all()  # 5: only grows
    for g in range(len(rows)):  # 6: a streak at the limit takes the row down
        if up[g]:
            assert health.unknown_streak(g) < UNKNOWN_LIMIT


def assert_clean(health: Health, cells: np.ndarray, slot: int) -> None:
    """7: a slot that changes, or answers again, carries nothing of what failed before."""
    assert health.unknown_streak(slot) == 0
    assert slot not in health.slot_failing | health.slot_down
    assert not any(g == slot for g, _ in health.failing_calls | health.held_calls)
    assert not cells[slot].any()


def test_a_lost_gpu_takes_its_slots_down_for_good() -> None:
    rows = make_rows()
    health = Health(rows)
    for s in SLOTS:
        occupy(rows, health, s)
    for _ in range(UNKNOWN_LIMIT):
        health.failed(3, calls.UNKNOWN_CODE)
    assert health.slot_down == {3}  # its own instance stopped answering
    assert health.up.tolist() == [True, True, True, False, True]
    assert health.failed(GPU, LOST, cells=2)
    assert health.up.tolist() == [False, True, False, False, False]
    assert health.slot_down == set()  # down for good with its GPU, not asked again
    health.slot_changed(2, occupied=True)  # a rescan that raced the loss brings nothing up
    assert not health.slot_answers(3)
    assert health.up.tolist() == [False, True, False, False, False]
    assert health.errors.tolist() == [2, 0, 0, 0, 0]


def test_an_instance_answering_gpu_lost_speaks_for_its_gpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = make_rows()
    health = Health(rows)
    occupy(rows, health, 2)
    with caplog.at_level(logging.ERROR):
        health.mark_down(2, LOST)
        health.mark_down(GPU, LOST)  # said once
    assert health.up.tolist() == [False, True, False, False, False]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 0 (GPU-0) stopped answering: GPU is lost; no longer sampled, the others continue"
    ]


def test_an_unknown_streak_ends_when_the_row_answers() -> None:
    rows = make_rows()
    health = Health(rows)
    for _ in range(UNKNOWN_LIMIT - 1):
        assert not health.failed(OTHER_GPU, calls.UNKNOWN_CODE)
    health.answered(OTHER_GPU)
    assert health.unknown_streak(OTHER_GPU) == 0
    for _ in range(UNKNOWN_LIMIT - 1):
        assert not health.failed(OTHER_GPU, calls.UNKNOWN_CODE)
    assert health.failed(OTHER_GPU, calls.UNKNOWN_CODE)
    assert not health.up[OTHER_GPU]


def test_a_slot_failing_makes_one_rescan_due() -> None:
    rows = make_rows()
    health = Health(rows)
    occupy(rows, health, 2)
    health.failed(GPU, OTHER)
    assert not health.rescan_due  # a GPU's failure is no layout question
    health.failed(2, OTHER)
    assert health.rescan_due
    assert health.slot_failing == {2}
    health.rescan_started()
    health.failed(2, OTHER)  # goes on failing while its instance stays: no more rescans
    assert not health.rescan_due
    health.answered(2)
    assert health.slot_failing == set()


def test_a_held_warning_is_said_only_if_the_instance_stayed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = make_rows()
    health = Health(rows)
    occupy(rows, health, 2)
    occupy(rows, health, 3)
    with caplog.at_level(logging.INFO):
        health.call_failed(2, "memory", "DCGM_FI_DEV_FB_USED", GONE)
        health.call_failed(3, "memory", "DCGM_FI_DEV_FB_USED", GONE)
        assert caplog.records == []
        assert health.held_calls == {(2, "memory"), (3, "memory")}
        health.release_held(2, warn=True)  # still there: its failure was its own
        health.call_answers(2, "memory", "DCGM_FI_DEV_FB_USED")
        health.call_answers(3, "memory", "DCGM_FI_DEV_FB_USED")  # never said: not "again"
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 0 MIG instance GPU_I_ID=2 (MIG-2): reading DCGM_FI_DEV_FB_USED failed: Not Found; "
        "its series go stale while it fails (said again when it reads)",
        "GPU 0 MIG instance GPU_I_ID=2 (MIG-2): DCGM_FI_DEV_FB_USED reads again",
    ]
    assert health.failing_calls == frozenset()
    assert health.held_calls == frozenset()


def test_a_slot_whose_instance_changes_starts_clean(caplog: pytest.LogCaptureFixture) -> None:
    rows = make_rows()
    health = Health(rows)
    cells = health.failing_cells(2)
    occupy(rows, health, 2)
    health.call_failed(2, "memory", "DCGM_FI_DEV_FB_USED", GONE)
    health.call_failed(2, "clock_sm", "DCGM_FI_DEV_SM_CLOCK", OTHER)
    health.failed(2, calls.UNKNOWN_CODE, cells=1)
    cells[2] = True
    health.slot_changed(2, occupied=False)  # the instance went
    assert_clean(health, cells, 2)
    assert not health.up[2]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        health.release_held(2, warn=True)  # nothing left to say of the one that went
    assert caplog.records == []


def test_a_slot_down_for_its_own_comes_back_clean() -> None:
    rows = make_rows()
    health = Health(rows)
    cells = health.failing_cells(1)
    occupy(rows, health, 4)
    assert not health.slot_answers(4)  # not down: nothing to bring back
    health.call_failed(4, "memory", "DCGM_FI_DEV_FB_USED", OTHER)
    cells[4] = True
    for _ in range(UNKNOWN_LIMIT):
        health.failed(4, calls.UNKNOWN_CODE, cells=1)
    assert health.slot_down == {4}
    assert not health.up[4]
    assert health.slot_answers(4)
    assert health.up[4]
    assert_clean(health, cells, 4)
    assert health.errors[4] == UNKNOWN_LIMIT  # what failed stays counted


def test_cells_that_fail_are_said_once_and_when_they_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = make_rows()
    health = Health(rows)
    failing = health.failing_cells(2)
    rets = np.full((5, 2), OTHER, dtype=np.int64)
    bad = np.zeros((5, 2), dtype=np.bool_)
    bad[1, 0] = True
    none = np.zeros_like(bad)
    with caplog.at_level(logging.INFO):
        health.cells_read(failing, bad, none, rets, ("A", "B"))
        health.cells_read(failing, bad, none, rets, ("A", "B"))  # still failing: said once
        health.cells_read(failing, none, bad, rets, ("A", "B"))  # reads again
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1: reading A failed: Not Supported; its series go stale while it fails (said again "
        "when it reads)",
        "GPU 1: A reads again",
    ]
    assert not failing.any()


row = st.integers(0, 4)
slot = st.sampled_from(SLOTS)
code = st.sampled_from(CODES)
key = st.sampled_from(KEYS)
OPS = st.one_of(
    st.tuples(st.just("answered"), row),
    st.tuples(st.just("failed"), row, code, st.integers(0, 3)),
    st.tuples(st.just("mark_down"), row, code),
    st.tuples(st.just("call_failed"), row, key, code),
    st.tuples(st.just("call_answers"), row, key),
    st.tuples(st.just("release_held"), slot, st.booleans()),
    st.tuples(st.just("slot_changed"), slot, st.booleans()),
    st.tuples(st.just("slot_answers"), slot),
    st.tuples(st.just("cells"), st.lists(st.tuples(row, code), max_size=4), st.booleans()),
    st.tuples(st.just("rescan_started")),
)


@given(st.lists(OPS, max_size=60))
def test_every_sequence_of_reads_and_rescans_keeps_the_invariants(ops: list[Any]) -> None:
    rows = make_rows()
    health = Health(rows)
    cells = health.failing_cells(1)
    went_down: set[int] = set()
    for op in ops:
        errors = health.errors
        name, *args = op
        if name == "answered":
            health.answered(args[0])
        elif name == "failed":
            health.failed(*args)
        elif name == "mark_down":
            health.mark_down(*args)
        elif name == "call_failed":
            g, k, c = args
            if (g, k) not in health.failing_calls:  # as the read calls it
                health.call_failed(g, k, "F", c)
        elif name == "call_answers":
            if tuple(args) in health.failing_calls:
                health.call_answers(args[0], args[1], "F")
        elif name == "release_held":
            health.release_held(args[0], warn=args[1])
        elif name == "slot_changed":
            health.slot_changed(args[0], occupied=args[1])
            assert_clean(health, cells, args[0])
        elif name == "slot_answers":
            if health.slot_answers(args[0]):
                assert_clean(health, cells, args[0])
                assert health.up[args[0]]
        elif name == "cells":
            bad = np.zeros((5, 1), dtype=np.bool_)
            rets = np.zeros((5, 1), dtype=np.int64)
            for g, c in args[0]:
                bad[g, 0], rets[g, 0] = True, c
            bad &= health.up[:, None]  # a read asks the rows up only
            ok = health.up[:, None] & ~bad if args[1] else np.zeros_like(bad)
            health.cells_read(cells, bad, ok, rets, ("F",))
            health.entry_errors(bad, rets)
        else:
            health.rescan_started()
        check(rows, health, went_down, errors)

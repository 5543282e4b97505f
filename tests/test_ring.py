"""Shared-memory rings: one writer, readers that copy out, overwrites counted, memory released."""

from __future__ import annotations

import os

import pytest

from hfsampler.ring import Ring, SharedInts


def _write(ring: Ring, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        values, driver = ring.slot()
        values[:] = i
        driver[:] = i * 10
        ring.commit(1_000 + i, i)


def test_reader_in_another_mapping_sees_rows_in_order() -> None:
    ring = Ring.create(8, 2, 3)
    reader = Ring.attach(ring.name)
    try:
        _write(ring, 5)
        seq, rows, lost = reader.read_since(0)
        assert (seq, lost) == (5, 0)
        assert rows.time_ns.tolist() == [1000, 1001, 1002, 1003, 1004]
        assert rows.values[:, 1, 2].tolist() == [0, 1, 2, 3, 4]
        assert rows.driver_ts_us[4, 0, 0] == 40
        seq2, rows2, lost2 = reader.read_since(seq)
        assert (seq2, len(rows2), lost2) == (5, 0, 0)
    finally:
        reader.close()
        ring.close()


def test_a_lagging_reader_loses_the_oldest_rows_and_counts_them() -> None:
    ring = Ring.create(8, 1, 1)
    try:
        _write(ring, 20)
        seq, rows, lost = ring.read_since(0)
        assert seq == 20
        assert len(rows) + lost == 20
        assert rows.time_ns[-1] == 1019
        assert lost >= 12
    finally:
        ring.close()


def test_close_releases_the_shared_memory() -> None:
    ring = Ring.create(4, 1, 1)
    status = SharedInts.create(4)
    names = [ring.name, status.name]
    ring.close()
    status.close()
    for name in names:
        assert not os.path.exists(f"/dev/shm/{name}")
        with pytest.raises(FileNotFoundError):
            Ring.attach(name)


def test_attaching_does_not_take_ownership() -> None:
    ring = Ring.create(4, 1, 1)
    try:
        other = Ring.attach(ring.name)
        other.close()
        assert os.path.exists(f"/dev/shm/{ring.name}")
    finally:
        ring.close()


def test_ring_refuses_degenerate_sizes() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Ring.create(1, 1, 1)


def test_blocks_of_a_dead_creator_are_swept() -> None:
    import subprocess
    import sys

    from hfsampler.ring import sweep_orphans

    # a process that creates a ring and dies by SIGKILL together with its resource tracker
    script = (
        "import os, signal; from hfsampler.ring import Ring; r = Ring.create(4, 1, 1); "
        "print(r.name, flush=True); os.killpg(0, signal.SIGKILL)"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as p:
        assert p.stdout is not None
        name = p.stdout.readline().strip()
        p.wait(10)
    assert os.path.exists(f"/dev/shm/{name}")
    mine = Ring.create(4, 1, 1)
    try:
        removed = sweep_orphans()
        assert name in removed
        assert not os.path.exists(f"/dev/shm/{name}")
        assert os.path.exists(f"/dev/shm/{mine.name}")  # a live owner's block stays
    finally:
        mine.close()

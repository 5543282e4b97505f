"""Shared-memory rings: one writer, readers that copy out, overwrites counted, memory released."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import shm_dirs

from hfsampler.errors import ConfigError
from hfsampler.sampling.ring import Ring, SharedInts, check_room


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


def test_columns_reads_some_cells_of_a_span_across_the_wrap_field_by_field() -> None:
    ring = Ring.create(8, 3, 4)
    try:
        for i in range(13):  # rows 5..12 held, row 8's at the ring's start
            values, driver = ring.slot()
            values[:] = np.arange(12).reshape(3, 4) + 100 * i
            driver[:] = i
            ring.commit(1_000 + i, 0)
        cells = ring.cell_index([0, 2], [3, 1])  # field 3 of GPUs 0 and 2, then field 1's
        rows, whole = ring.columns(6, 11, cells)
        assert whole
        assert rows.time_ns.tolist() == [1006, 1007, 1008, 1009, 1010]
        assert rows.values[0].tolist() == [603, 703, 803, 903, 1003]  # cell by cell
        assert rows.values[:, 0].tolist() == [603, 611, 601, 609]
        assert rows.driver_ts_us[3].tolist() == [6, 7, 8, 9, 10]
        assert not ring.columns(4, 11, cells)[1]  # row 4 was overwritten
        # a span in one stretch of the ring (rows 8..11 are its slots 0..3): the same cells
        rows, whole = ring.columns(8, 12, cells)
        assert whole
        assert rows.time_ns.tolist() == [1008, 1009, 1010, 1011]
        assert rows.values[:, 1].tolist() == [903, 911, 901, 909]
        assert rows.driver_ts_us[2].tolist() == [8, 9, 10, 11]
        assert len(ring.columns(9, 9, cells)[0]) == 0
    finally:
        ring.close()


def test_row_reads_one_rows_cells_as_python_numbers_and_holds_says_if_it_was_overwritten() -> None:
    ring = Ring.create(8, 3, 4)
    reader = Ring.attach(ring.name)
    try:
        for i in range(13):
            values, driver = ring.slot()
            values[:] = np.arange(12).reshape(3, 4) + 100 * i
            driver[:] = i
            ring.commit(1_000 + i, 0)
        cells = ring.cell_index([0, 2], [3, 1]).tolist()
        assert reader.row(12, cells) == ([1203.0, 1211.0, 1201.0, 1209.0], [12, 12, 12, 12])
        assert reader.row(6, cells)[0] == [603.0, 611.0, 601.0, 609.0]
        assert reader.holds(6)
        assert not reader.holds(5)  # the row at the head minus the capacity may be torn
    finally:
        reader.close()
        ring.close()


def _write_driver(ring: Ring, driver_ts: list[list[int]]) -> None:
    """One row per entry: its driver timestamps (one per field), its value the row's number."""
    for ts in driver_ts:
        values, driver = ring.slot()
        values[:] = ring.write_seq
        driver[0, :] = ts
        ring.commit(1_000 + ring.write_seq, 0)


def test_a_reader_gets_nan_where_the_driver_timestamp_repeats() -> None:
    """The writer stores what it read; a repeat of the row before's timestamp is no sample."""
    ring = Ring.create(8, 1, 2)
    try:
        _write_driver(ring, [[10, 10], [10, 20], [30, 20], [30, 20]])
        seq, rows, _ = ring.read_since(0)
        assert np.array_equal(rows.values[:, 0, 0], [0, np.nan, 2, np.nan], equal_nan=True)
        assert np.array_equal(rows.values[:, 0, 1], [0, 1, np.nan, np.nan], equal_nan=True)
        assert rows.driver_ts_us[:, 0, 0].tolist() == [10, 10, 30, 30]  # kept as read
        # the next read judges its first row against the last one already handed out
        _write_driver(ring, [[30, 40], [50, 40]])
        _, rows, _ = ring.read_since(seq)
        assert np.array_equal(rows.values[:, 0, :], [[np.nan, 4], [5, np.nan]], equal_nan=True)
    finally:
        ring.close()


def test_a_lagging_reader_keeps_the_first_row_it_can_judge_as_a_sample() -> None:
    ring = Ring.create(4, 1, 1)
    try:
        _write_driver(ring, [[10]] * 10)  # one sample, repeated
        seq, rows, lost = ring.read_since(0)
        assert (seq, len(rows), lost) == (10, 3, 7)  # the oldest slot is the next written
        # the row before the oldest one kept may be torn: the oldest counts as a sample
        assert np.array_equal(rows.values[:, 0, 0], [7, np.nan, np.nan], equal_nan=True)
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

    from hfsampler.sampling.ring import sweep_orphans

    # a process that creates a ring and dies by SIGKILL together with its resource tracker
    script = (
        "import os, signal; from hfsampler.sampling.ring import Ring; r = Ring.create(4, 1, 1); "
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


small_shm = shm_dirs.small_shm
readonly_shm = shm_dirs.readonly_shm
shm_dir = shm_dirs.shm_dir


def test_blocks_live_in_the_shared_memory_directory(shm_dir: Path) -> None:
    ring = Ring.create(8, 1, 1)
    try:
        assert (shm_dir / ring.name).stat().st_size == ring.nbytes
        assert not os.path.exists(f"/dev/shm/{ring.name}")
        reader = Ring.attach(ring.name)
        _write(ring, 3)
        assert reader.read_since(0)[1].time_ns.tolist() == [1000, 1001, 1002]
        reader.close()
    finally:
        ring.close()
    assert list(shm_dir.iterdir()) == []


def test_a_full_tmpfs_refuses_the_block_when_it_is_made(small_shm: Path) -> None:
    """Without the pages reserved up front, the block is made and the writer dies of SIGBUS."""
    with pytest.raises(OSError, match="No space left on device") as caught:
        Ring.create(100_000, 2, 8)  # 25 MiB in a 1 MiB tmpfs
    assert caught.value.errno == errno.ENOSPC
    assert list(small_shm.iterdir()) == []  # nothing half-made is left


def test_room_is_checked_before_anything_is_made(small_shm: Path) -> None:
    check_room(512 << 10)
    with pytest.raises(ConfigError) as caught:
        check_room(5 << 30)
    text = str(caught.value)
    assert text.startswith(f"{small_shm}: the sample rings need 5.00 GiB ({5 << 30} bytes), ")
    assert "1.0 MiB free" in text
    assert "--shm-size" in text
    assert "sizeLimit" in text
    assert "\n" not in text


def test_a_read_only_directory_is_named(readonly_shm: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^{readonly_shm}: is mounted read-only \(mount a"):
        check_room(4096)


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nowhere: cannot use it: No such file or directory"):
        check_room(4096, tmp_path / "nowhere")

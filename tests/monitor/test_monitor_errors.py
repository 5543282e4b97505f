"""A Monitor refused at construction says the fix in the Monitor's own terms.

The limits come from the `run` machinery under it (the ring cap, the room in ``/dev/shm``, the
sources), whose messages speak of flags (``--window``, ``--source``) a script never gave.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import shm_dirs

from hfsampler import Monitor
from hfsampler.errors import ConfigError
from hfsampler.sampling.stepping import VirtualClock

START_NS = 1_780_000_000 * 10**9
small_shm = shm_dirs.small_shm


def refusal(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as refused:
        Monitor(env={}, **kwargs)  # type: ignore[arg-type]
    return str(refused.value)


def test_a_history_over_the_ring_cap_names_history_s() -> None:
    text = refusal(source="sim", history_s=3600.0, clock=VirtualClock(START_NS))
    assert text.startswith("history_s: 3600 s on 2 GPU(s) needs ")
    assert "--window" not in text
    assert "shorter history_s" in text


def test_no_room_in_dev_shm_names_history_s_not_window(small_shm: Path) -> None:
    text = refusal(source="sim", history_s=600.0)
    assert "--shm-size" in text
    assert "--window" not in text
    assert "shorter history_s" in text


def test_jetson_on_a_machine_without_one_names_the_source_argument() -> None:
    text = refusal(source="jetson")
    assert "--source" not in text
    assert "source=" in text


def test_no_room_for_the_answers_table_after_the_rings_names_the_cause_and_fix(
    small_shm: Path,
) -> None:
    """/dev/shm with room for the sample rings but not for the reducer's table of answers,
    made after them: refused at construction with the directory, the bytes and the fix, not
    an OSError, and nothing left behind."""
    history_s = 2.0
    with Monitor(source="sim", env={}, history_s=history_s, clock=VirtualClock(START_NS)):
        rings = sum(-(-p.stat().st_size // 4096) * 4096 for p in small_shm.iterdir())
    free = os.statvfs(small_shm).f_bavail * os.statvfs(small_shm).f_frsize
    filler = small_shm / "filler"
    with filler.open("wb") as f:  # leave the rings their room, and 64 KiB
        os.posix_fallocate(f.fileno(), 0, free - rings - (64 << 10))
    text = refusal(source="sim", history_s=history_s)
    assert text.startswith(f"{small_shm}: cannot make the Monitor's table of answers")
    assert "No space left on device" in text
    assert "--shm-size" in text
    assert "shorter history_s" in text
    assert "--window" not in text
    assert [p.name for p in small_shm.iterdir()] == ["filler"]

"""The sim's consumers: deterministic processes that come and go, whose SM utilisation and memory
are the GPU's own shared out, and a procfs tree naming them written only where it is the sim's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hfsampler.consumers.procfs import ProcfsReader
from hfsampler.fields import FB_USED, GPU_UTIL
from hfsampler.sources.base import DeviceInfo
from hfsampler.sources.sim.consumers import MARKER, PID_BASE, SimConsumerLists
from hfsampler.sources.sim.source import SimSource

S = 10**9
T0 = 1_796_000_000 * S


def _lists(root: Path, clock: list[int], gpus: int = 2) -> SimConsumerLists:
    """The sim's lists of ``gpus`` GPUs without MIG, on ``clock[0]``."""
    lists = SimConsumerLists(gpus, 0, str(root), lambda: clock[0])
    lists.set_devices([DeviceInfo(g, f"GPU-{g}", "sim", f"0:{g}", "1", g) for g in range(gpus)])
    return lists


def test_processes_come_and_go_and_share_the_gpus_own_utilisation_and_memory(
    tmp_path: Path,
) -> None:
    clock = [T0]
    lists = _lists(tmp_path / "proc", clock)
    sim = SimSource(2)
    seen: set[int] = set()
    for k in range(40):  # 10 s, four reads a second
        clock[0] = T0 + k * S // 4
        lists.read()
        if k % 4 == 3:
            uses = lists.take()
            for g, use in uses.items():
                seen.update(use.mem_pid.tolist())
                assert all(PID_BASE <= p < 1 << 22 for p in use.mem_pid.tolist())
                # at each sampling instant the processes' SM adds up to no more than the GPU's
                for ts in np.unique(use.util_timestamp_us):
                    at = use.util_timestamp_us == ts
                    gpu_pct = float(sim.value_at(GPU_UTIL.names[0], int(ts) * 1000, g))
                    assert use.util_sm_pct[at].sum() <= gpu_pct + 1e-9
                # at each read, their memory adds up to no more than the GPU's used memory
                for read in np.unique(use.mem_read):
                    at = use.mem_read == read
                    used = float(sim.value_at(FB_USED.names[0], clock[0], g)) * (1 << 20)
                    assert use.mem_used_bytes[at].sum() <= used * 1.01
    assert len(seen) > 2 * 3  # more processes than slots: they came and went


def test_the_same_seed_gives_the_same_processes(tmp_path: Path) -> None:
    clock = [T0 + 7 * S]
    a = _lists(tmp_path / "a", clock)
    b = _lists(tmp_path / "b", clock)
    for lists in (a, b):
        lists.read()
    ua, ub = a.take(), b.take()
    for g in ua:
        assert ua[g].mem_pid.tolist() == ub[g].mem_pid.tolist()
        assert ua[g].util_sm_pct.tolist() == ub[g].util_sm_pct.tolist()


def test_its_procfs_tree_names_each_process(tmp_path: Path) -> None:
    clock = [T0]
    root = tmp_path / "proc"
    lists = _lists(root, clock)
    lists.read()
    assert (root / MARKER).exists()
    pids = sorted({p for use in lists.take().values() for p in use.mem_pid.tolist()})
    reader = ProcfsReader(str(root))
    kinds = {c.kind.value for c in reader.consumers(pids).values()}
    assert "unknown" not in kinds
    assert not reader.faults


def test_a_second_run_on_the_same_directory_leaves_the_first_s_tree_alone(
    tmp_path: Path,
) -> None:
    root = tmp_path / "proc"
    first = _lists(root, [T0])
    first.read()
    live = sorted(p.name for p in root.iterdir())
    assert len(live) > 2  # pid 1, the marker and the first run's processes
    second = _lists(root, [T0 + 10 * S])  # other processes by then
    second.read()
    assert sorted(p.name for p in root.iterdir()) == live  # nothing deleted, nothing added
    second.close()
    first.close()
    third = _lists(root, [T0])  # the first has gone: its tree is taken over
    third.read()
    assert (root / MARKER).exists()
    third.close()


@pytest.mark.parametrize("whose", ["another user's", "writable by others"])
def test_it_never_writes_in_a_directory_others_may_write_in(tmp_path: Path, whose: str) -> None:
    # its tree from an earlier run, but others could have put links where it writes next
    root = tmp_path / "proc"
    first = _lists(root, [T0])
    first.read()
    first.close()
    if whose == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(root, 4242, 4242)
    else:
        root.chmod(0o777)
    before = sorted(p.name for p in root.iterdir())
    later = _lists(root, [T0 + 10 * S])  # other processes by then
    later.read()
    later.close()
    assert sorted(p.name for p in root.iterdir()) == before


def test_a_directory_its_own_group_may_write_in_is_still_its_own(tmp_path: Path) -> None:
    # umask 002 with a group of one's own (Debian's user private groups): not the others'
    root = tmp_path / "proc"
    root.mkdir()
    root.chmod(0o775)
    os.chown(root, -1, os.getegid())
    lists = _lists(root, [T0])
    lists.read()
    lists.close()
    assert (root / MARKER).exists()


@pytest.mark.parametrize("kind", ["a real procfs", "someone's files"])
def test_it_never_writes_where_the_directory_is_not_its_own(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "proc"
    root.mkdir()
    (root / ("1" if kind == "a real procfs" else "notes.txt")).mkdir()
    before = sorted(p.name for p in root.iterdir())
    lists = _lists(root, [T0])
    lists.read()
    assert sorted(p.name for p in root.iterdir()) == before
    assert lists.take()  # its processes are still listed: their consumers are unknown there

"""The sampler process: ticks at its interval, keeps repeats out, frees shared memory on exit."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import shm_dirs

from hfsampler import fields
from hfsampler.errors import ConfigError, SourceError
from hfsampler.sampling.groups import GroupPlan, plan_groups
from hfsampler.sampling.lanes import calibrate_spin_ns
from hfsampler.sampling.plan import discover
from hfsampler.sampling.sampler import Sampler, ring_capacity, shared_bytes_needed
from hfsampler.sources.base import SourceSpec

# It measures the machine's time (lateness, deadlines, rates): it runs alone.
pytestmark = pytest.mark.alone

SPEC = SourceSpec("sim", gpus=2, seed=1)


small_shm = shm_dirs.small_shm
readonly_shm = shm_dirs.readonly_shm
shm_dir = shm_dirs.shm_dir


def _fast_slow(sampled: Sequence[fields.Field]) -> list[fields.Field]:
    """The fields of the two groups these tests sample (the gpm group has no interval here)."""
    return [f for f in sampled if f.group in ("fast", "slow")]


def _sampler(spin_s: float | None = 0.0, window_s: float = 1.0, **kwargs: int) -> Sampler:
    inventory = discover(SPEC, fields.CATALOGUE)
    groups = plan_groups(_fast_slow(inventory.fields), {"fast": 0.001, "slow": 0.1})
    return Sampler(SPEC, inventory, groups, window_s=window_s, spin_s=spin_s, **kwargs)


def _wait(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ticks_counted_and_repeats_kept_out() -> None:
    with _sampler() as sampler:
        sampler.start()
        _wait(lambda: sampler.counters(0).ticks >= 600)
        fast = sampler.counters(0)
        _, rows, lost = sampler.rings["fast"].read_since(0)
        assert lost == 0
        names = [f.name for f in sampler.groups[0].fields]
        ticks = len(rows)
        assert ticks >= 600
        # POWER_USAGE refreshes every 20 ms: about one distinct sample in 20 ticks
        distinct_avg = (~np.isnan(rows.values[:, 0, names.index("DCGM_FI_DEV_POWER_USAGE")])).sum()
        assert distinct_avg <= ticks / 10
        # POWER_USAGE_INSTANT refreshes every 1 ms: nearly every tick is distinct
        j = names.index("DCGM_FI_DEV_POWER_USAGE_INSTANT")
        distinct_instant = (~np.isnan(rows.values[:, 0, j])).sum()
        assert distinct_instant >= (ticks - fast.missed) * 0.8
        assert (np.diff(rows.time_ns) > 0).all()
        assert sampler.gpu_up().tolist() == [True, True]
        assert sampler.counters(1).ticks >= 3  # the slow group ticks too


def test_ring_is_sized_for_windows() -> None:
    assert ring_capacity(0.001, 1.0) == 4000
    assert ring_capacity(0.1, 1.0) == 40
    with _sampler() as sampler:
        assert sampler.rings["fast"].capacity >= 2 * 1000


def test_dead_sampler_is_noticed_and_memory_freed() -> None:
    sampler = _sampler()
    names = [r.name for r in sampler.rings.values()]
    try:
        sampler.start()
        assert sampler.alive()
        assert sampler.pid is not None
        os.kill(sampler.pid, signal.SIGKILL)
        _wait(lambda: not sampler.alive())
        assert sampler.exit_reason() == "killed by SIGKILL (the out-of-memory killer, or kill -9)"
    finally:
        sampler.close()
    for name in names:
        assert not os.path.exists(f"/dev/shm/{name}")
    sampler.close()  # twice is fine


def test_a_source_that_cannot_open_fails_start() -> None:
    inventory = discover(SPEC, fields.CATALOGUE)
    bad = SourceSpec("nvml")  # no driver here: the child cannot open it
    groups = [GroupPlan("fast", 0.001, inventory.fields[:2])]
    with Sampler(bad, inventory, groups, 1.0) as sampler, pytest.raises(SourceError) as caught:
        sampler.start()
    # the child's reason, in the parent's one line
    assert str(caught.value).startswith(
        "the sampler process could not open the source: cannot open the nvml source: NVML"
    )


def test_spin_calibration_is_bounded() -> None:
    spin = calibrate_spin_ns(200_000, 1_000_000, trials=20)
    assert 0 <= spin <= 250_000


def test_sampler_dies_with_its_parent(tmp_path: object) -> None:
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys, time
        from hfsampler import fields
        from hfsampler.sampling.sampler import Sampler
        from hfsampler.sampling.plan import discover, plan_groups
        from hfsampler.sources.base import SourceSpec

        if __name__ == "__main__":
            spec = SourceSpec("sim", gpus=1)
            inv = discover(spec, fields.CATALOGUE)
            sampled = [f for f in inv.fields if f.group != "gpm"]
            s = Sampler(spec, inv, plan_groups(sampled, {"fast": 0.001, "slow": 0.1}), 1.0)
            s.start()
            print(s.pid, flush=True)
            time.sleep(60)
        """
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout is not None
            child = int(p.stdout.readline())
            p.kill()  # SIGKILL: the parent cannot clean up
            p.wait(10)
            _wait(lambda: _zombie(child), 10)
        finally:
            p.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_group_signals_do_not_stop_the_sampler() -> None:
    with _sampler() as sampler:
        sampler.start()
        assert sampler.pid is not None
        os.kill(sampler.pid, signal.SIGTERM)
        os.kill(sampler.pid, signal.SIGINT)
        before = sampler.counters(0).ticks
        _wait(lambda: sampler.counters(0).ticks > before + 200)
        assert sampler.alive()


def test_an_hour_window_is_refused_before_any_memory_is_taken(shm_dir: Path) -> None:
    """An hour of 1 ms ticks for 2 GPUs is gigabytes of rings: over max_ring_bytes, one line."""
    with pytest.raises(ConfigError) as caught:
        _sampler(window_s=3600.0)
    text = str(caught.value)
    assert text.startswith("max_ring_bytes: --window 3600s with intervals fast 1ms, slow 100ms")
    assert "on 2 GPU(s) needs " in text
    assert "GiB" in text
    assert "over the 256.0 MiB allowed" in text
    assert "shorten --window, lengthen the intervals" in text
    assert list(shm_dir.iterdir()) == []


def test_max_ring_bytes_is_the_cap(shm_dir: Path) -> None:
    inventory = discover(SPEC, fields.CATALOGUE)
    groups = plan_groups(_fast_slow(inventory.fields), {"fast": 0.001, "slow": 0.1})
    need = shared_bytes_needed(groups, 2, 20.0)
    with _sampler(window_s=20.0, max_ring_bytes=need) as sampler:
        assert sampler.shared_bytes <= need
    with pytest.raises(ConfigError, match=r"^max_ring_bytes: "):
        _sampler(window_s=20.0, max_ring_bytes=need - 1)


def test_a_small_shm_is_refused_naming_it_and_the_bytes(small_shm: Path) -> None:
    inventory = discover(SPEC, fields.CATALOGUE)
    groups = plan_groups(_fast_slow(inventory.fields), {"fast": 0.001, "slow": 0.1})
    need = shared_bytes_needed(groups, 2, 10.0)
    with pytest.raises(ConfigError) as caught:
        _sampler(window_s=10.0)
    text = str(caught.value)
    assert text.startswith(f"{small_shm}: the sample rings need ")
    assert f"({need} bytes)" in text
    assert "--shm-size" in text
    assert list(small_shm.iterdir()) == []


def test_a_read_only_shm_is_refused_naming_it(readonly_shm: Path) -> None:
    """It used to fail with an AttributeError from the half-built sampler's cleanup."""
    with pytest.raises(ConfigError, match=rf"^{readonly_shm}: is mounted read-only"):
        _sampler()


def test_a_sampler_killed_by_sigbus_says_so(shm_dir: Path) -> None:
    """Shared memory pulled from under the writer (a tmpfs that ran out) ends it with SIGBUS."""
    with _sampler() as sampler:
        sampler.start()
        os.truncate(shm_dir / sampler.rings["fast"].name, 0)
        _wait(lambda: not sampler.alive())
        reason = sampler.exit_reason()
    assert reason is not None
    assert reason.startswith("killed by SIGBUS (its shared memory ran out")


def test_an_exception_in_the_sampler_reaches_the_parent(shm_dir: Path) -> None:
    with _sampler() as sampler:
        (shm_dir / sampler.rings["slow"].name).unlink()  # the child cannot attach it
        with pytest.raises(SourceError) as caught:
            sampler.start()
    text = str(caught.value)
    assert text.startswith("the sampler process did not start: FileNotFoundError: ")
    assert "No such file or directory" in text
    assert "\n" not in text


def test_the_sampler_process_logs_as_the_service_does() -> None:
    """The process's level and format (text or JSON lines) are the parent's at construction."""
    import logging

    from hfsampler import logs

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.setup("debug", "json")
        with _sampler() as s:
            assert (s.plan.log_level, s.plan.log_json) == (logging.DEBUG, True)
        logs.setup("warning", "text")
        with _sampler() as s:
            assert (s.plan.log_level, s.plan.log_json) == (logging.WARNING, False)
    finally:
        root.handlers[:], root.level = saved

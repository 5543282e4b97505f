"""The sim's consumers start and leave every few seconds: in a run on a virtual clock (the
stepping sampler, a minute of windows in seconds) the consumer series stay bounded, every consumer
that left ends with a stale marker when it leaves, and the series registry does not grow.
(The same for ten real minutes, with the parent's RSS: benchmarks/consumers_soak.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conformance import ConformanceReceiver, is_stale_marker
from inprocess import run_plan, start_ns

from hfsampler.export import consumer_series as cs
from hfsampler.export.service import Service
from hfsampler.sampling.stepping import VirtualClock
from hfsampler.sources.sim.consumers import DEFAULT_PER_GPU, MARKER

S = 10**9
WINDOWS = 30
GPUS = 1


async def test_consumers_that_come_and_go_end_with_stale_markers_and_stay_bounded(
    tmp_path: Path,
) -> None:
    procfs = tmp_path / "proc"
    started = start_ns()
    clock = VirtualClock(started)
    registry_sizes: list[int] = []
    service: Service | None = None

    async def look() -> None:
        assert service is not None
        registry_sizes.append(len(service.model.registry))

    for k in range(10, WINDOWS, 5):
        clock.at(started + k * S + S // 2, look)
    async with ConformanceReceiver() as rx:
        plan = run_plan("--source", "sim", "--gpus", str(GPUS), "--consumers", "on",
                        "--procfs", str(procfs), "--interval", "20ms", "--duration", f"{WINDOWS}s",
                        "--listen", "", "--remote-write", rx.url)  # fmt: skip
        service = Service(plan, clock=clock)
        assert await service.run() == 0
    rx.assert_conformant()
    assert (procfs / MARKER).exists()
    energy = rx.series_named(cs.ENERGY)
    end_ms = max(ts for s in energy.values() for ts, _ in s)
    left = [labels for labels, s in energy.items() if s[-1][0] < end_ms]
    # churn: many more consumers than the 2 x 3 slots, most of them gone before the end
    assert len(energy) > 4 * GPUS * DEFAULT_PER_GPU
    assert len(left) > 3 * GPUS * DEFAULT_PER_GPU
    for name in (cs.SM_RATIO, cs.MEMORY_USED, cs.ENERGY):
        for labels, samples in rx.series_named(name).items():
            assert is_stale_marker(samples[-1][1]), (name, labels)  # every one ended
            if any(is_stale_marker(v) for _, v in samples[:-1]):  # ended, then back again:
                # only a unit's or a user's command's identity comes back; a job or pod never
                assert {"systemd_unit", "command"} & set(dict(labels)), labels
    # at no window more consumers per GPU than the sim's slots
    stamps = sorted({ts for s in energy.values() for ts, v in s if math.isfinite(v)})
    for ts in stamps:
        for gpu in [str(g) for g in range(GPUS)]:
            live = [
                lb
                for lb, s in energy.items()
                if dict(lb)["gpu"] == gpu and any(t == ts and math.isfinite(v) for t, v in s)
            ]
            assert len(live) <= DEFAULT_PER_GPU, ts  # fmt: skip
    # the registry forgets who left: its size moves with who is there, it does not grow
    assert len(registry_sizes) >= 4
    slack = 3 * GPUS * DEFAULT_PER_GPU  # the three consumer series of every slot
    assert max(registry_sizes) - min(registry_sizes) <= slack
    # every kind of consumer the sim makes was seen
    kinds = {next(k for k in ("hpc_job", "pod_uid", "systemd_unit", "command") if k in dict(lb))
             for lb in energy}  # fmt: skip
    assert kinds == {"hpc_job", "pod_uid", "systemd_unit", "command"}


@pytest.mark.parametrize("layout", ["3g,2g,1g,1g"])
async def test_sim_consumers_on_mig_instances_carry_their_instance(
    tmp_path: Path, layout: str
) -> None:
    clock = VirtualClock(start_ns())
    async with ConformanceReceiver() as rx:
        plan = run_plan("--source", "sim", "--gpus", "1", "--sim-mig", layout, "--consumers",
                        "on", "--procfs", str(tmp_path / "proc"), "--interval", "20ms",
                        "--duration", "4s", "--listen", "", "--remote-write", rx.url)  # fmt: skip
        assert await Service(plan, clock=clock).run() == 0
    rx.assert_conformant()
    energy = rx.series_named(cs.ENERGY)
    assert energy
    assert all("GPU_I_ID" in dict(lb) for lb in energy)
    rows = {dict(lb).get("GPU_I_ID", "GPU") for lb in rx.series_named(cs.UNATTRIBUTED)}
    assert "GPU" in rows
    assert len(rows) > 1

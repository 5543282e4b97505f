"""Benchmark: what a MIG GPU's ticks cost against a GPU without MIG, on the fake NVML, per instance.

The nvml source reads one GPU through the real pynvml over the fake libnvidia-ml of the tests
(``tests/support/fake_nvml.py``), with the
catalogue's fields and their per-instance twins in the default
groups (fast 1 ms, slow and gpm 100 ms). Scenarios: MIG off (the peer, in the same run), MIG on
with 1, 3 and 7 instances. Per group, the mean time of one ``read`` (the tick's source work) over
many reads at the group's interval (so the slow group's mean includes the layout look one slow
read a second does, ``nvml_mig.RESCAN_S``), and for the slow group a read that looks at the
layout every time, to show that look's own cost. Last, what the service spends reducing one
1 s window of each group's ring, as it does: only the rows with a field of the group (a MIG
GPU's ring has a row per instance slot in every group, the fast one included, where they are
empty). All four GPUs are on one fake library and the scenarios' rounds are interleaved; each
figure is the median of the rounds. The table gives each against the peer, and the extra cost
per instance: (MIG read - peer read) / instances.

The fake's C functions are Python, so a call costs what the fake costs, not the driver: the ratio
and the per-instance count of calls are what carry over, not the microseconds. The machine is
shared and noisy: compare rows of one run only.

    python benchmarks/mig.py [--reads 1000] [--rounds 7] [--out benchmarks/out/mig.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import fake_nvml  # noqa: E402  (the tests' fake libnvidia-ml)

from hfsampler import fields as F  # noqa: E402
from hfsampler.sampling.groups import GroupPlan, plan_groups  # noqa: E402
from hfsampler.sampling.ring import RingRows  # noqa: E402
from hfsampler.sampling.window import reduce  # noqa: E402
from hfsampler.sources.nvml import mig as nvml_mig  # noqa: E402
from hfsampler.sources.nvml.source import NvmlSource  # noqa: E402

LAYOUTS: dict[str, list[tuple[int, str]]] = {
    "mig off": [],
    "mig 1": [(0, "7g.80gb")],
    "mig 3": [(1, "3g.40gb"), (5, "2g.20gb"), (13, "1g.10gb")],
    "mig 7": [(gi, "1g.10gb") for gi in range(7, 14)],
}


@dataclass
class _Scenario:
    name: str
    instances: int
    source: NvmlSource
    groups: list[GroupPlan]
    rows: int
    live: dict[str, list[int]]  # group -> the rows the service reduces (those with its fields)
    t_ns: dict[str, int] = field(default_factory=dict)
    means: dict[str, list[float]] = field(default_factory=dict)  # group -> per-round read us
    calls: dict[str, float] = field(default_factory=dict)
    rescan_us: list[float] = field(default_factory=list)
    reduce_ms: dict[str, list[float]] = field(default_factory=dict)  # group -> per-round ms


def _open(fake: fake_nvml.FakeNvml, gpu: int, name: str) -> _Scenario:
    source = NvmlSource(indices=(gpu,))
    fields = F.expand_mig(F.expand_xid(F.CATALOGUE), F.DEFAULT_GROUP_INTERVALS_S)
    inv = source.open(fields)
    keep = inv.supported.any(axis=0)
    kept = tuple(f for f, k in zip(inv.fields, keep, strict=True) if k)
    groups = plan_groups(kept, F.DEFAULT_GROUP_INTERVALS_S)
    live = {}
    for g in groups:
        cols = [k for k, f in enumerate(inv.fields) if f in set(g.fields)]
        live[g.name] = [int(r) for r in np.flatnonzero(inv.supported[:, cols].any(axis=1))]
    return _Scenario(name, len(LAYOUTS[name]), source, groups, len(source.gpu_up), live)


def _round(sc: _Scenario, fake: fake_nvml.FakeNvml, now_us: list[int], reads: int) -> None:
    """One round of reads of every group at its interval (the slow group rescans once a
    second, as in a run), then, for the slow group of a MIG GPU, reads that each rescan."""
    for g in sc.groups:
        values = np.zeros((sc.rows, len(g.fields)))
        ts = np.zeros(values.shape, dtype=np.int64)
        n = reads if g.name == F.FAST else max(20, reads // 8)
        step_us = int(g.interval_s * 1e6)
        t_ns = sc.t_ns.get(g.name, 10_000_000_000)
        source = sc.source
        source.read(g.fields, values, ts, t_ns)  # the plan is built on the first: not timed
        calls_before = sum(fake.calls.values())
        start = time.perf_counter_ns()
        for _ in range(n):
            now_us[0] += step_us
            t_ns += step_us * 1000
            source.read(g.fields, values, ts, t_ns)
        sc.means.setdefault(g.name, []).append((time.perf_counter_ns() - start) / n / 1e3)
        sc.calls[g.name] = (sum(fake.calls.values()) - calls_before) / n
        if g.name == F.SLOW and sc.instances:
            m = 20
            start = time.perf_counter_ns()
            for _ in range(m):
                now_us[0] += step_us
                t_ns += int(nvml_mig.RESCAN_S * 1e9)
                source.read(g.fields, values, ts, t_ns)
            sc.rescan_us.append((time.perf_counter_ns() - start) / m / 1e3)
        sc.t_ns[g.name] = t_ns
        sc.reduce_ms.setdefault(g.name, []).append(_reduce_ms(sc, g, fake, now_us, t_ns))


def _reduce_ms(
    sc: _Scenario, g: GroupPlan, fake: fake_nvml.FakeNvml, now_us: list[int], t_ns: int
) -> float:
    """What the service spends reducing one 1 s window of the group (the rows with a field of
    the group, as the service does): a window of real reads, reduced a few times."""
    n = max(1, round(1.0 / g.interval_s))
    values = np.zeros((n, sc.rows, len(g.fields)))
    ts = np.zeros(values.shape, dtype=np.int64)
    times = np.zeros(n, dtype=np.int64)
    step_us = int(g.interval_s * 1e6)
    for k in range(n):
        now_us[0] += step_us
        times[k] = t_ns + k * step_us * 1000
        sc.source.read(g.fields, values[k], ts[k], int(times[k]))
    rows = RingRows(times, np.zeros(n, dtype=np.int64), values, ts)
    repeats = 5
    start = time.perf_counter_ns()
    for _ in range(repeats):
        reduce(rows, g.fields, int(times[0]), int(times[-1]) + 1, only=sc.live[g.name])
    return (time.perf_counter_ns() - start) / repeats / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reads", type=int, default=1000, help="fast-group reads per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds, scenarios interleaved")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "mig.json"))
    args = ap.parse_args(argv)
    # one fake library, a GPU per scenario, rounds interleaved: the machine's drift between
    # scenarios (other users, CPU frequency) lands on all of them alike; medians of the rounds
    fake = fake_nvml.make_fake(len(LAYOUTS))
    for gpu, layout in enumerate(LAYOUTS.values()):
        if layout:
            fake_nvml.enable_mig(fake.gpus[gpu], gpu, layout)
    now_us = [1_000_000]
    fake.clock_us = lambda: now_us[0]
    # the fake under the real pynvml (imported by nvml_calls alone), as the tests put it
    fake_nvml.install(pytest.MonkeyPatch(), fake)
    scenarios = [_open(fake, gpu, name) for gpu, name in enumerate(LAYOUTS)]
    try:
        for _ in range(args.rounds):
            for sc in scenarios:
                _round(sc, fake, now_us, args.reads)
    finally:
        for sc in scenarios:
            sc.source.close()
    results: dict[str, Any] = {}
    for sc in scenarios:
        groups: dict[str, Any] = {}
        for g in sc.groups:
            groups[g.name] = {
                "fields": len(g.fields),
                "read_us": statistics.median(sc.means[g.name]),
                "read_us_rounds": sc.means[g.name],
                "nvml_calls_per_read": sc.calls[g.name],
                "reduce_window_ms": statistics.median(sc.reduce_ms[g.name]),
            }
            if g.name == F.SLOW and sc.rescan_us:
                groups[g.name]["read_with_rescan_us"] = statistics.median(sc.rescan_us)
        results[sc.name] = {"instances": sc.instances, "rows": sc.rows, "groups": groups}
    peer = results["mig off"]["groups"]
    header = (
        f"{'scenario':<9} {'group':<5} {'fields':>6} {'calls':>6} {'read us':>9} {'x peer':>7} "
        f"{'+us/inst':>9} {'rescan us':>10} {'reduce ms':>10}"
    )
    print("MIG tick cost on the fake NVML (a GPU per scenario; peer: MIG off, same run)")
    print("shared, noisy machine: compare rows of this run only; the fake's calls are Python")
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        n = res["instances"]
        for group, row in res["groups"].items():
            base = peer[group]["read_us"]
            per = (row["read_us"] - base) / n if n else 0.0
            row["x_peer"] = row["read_us"] / base
            row["extra_us_per_instance"] = per if n else None
            rescan = row.get("read_with_rescan_us")
            print(
                f"{name:<9} {group:<5} {row['fields']:>6} {row['nvml_calls_per_read']:>6.1f} "
                f"{row['read_us']:>9.1f} {row['x_peer']:>7.2f} "
                f"{(f'{per:.1f}' if n else '-'):>9} {(f'{rescan:.0f}' if rescan else '-'):>10} "
                f"{row['reduce_window_ms']:>10.2f}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "mig",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "note": "fake NVML (Python C functions); shared noisy machine; compare within a run",
        "results": results,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

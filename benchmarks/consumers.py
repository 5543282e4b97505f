"""Benchmark: what `run`'s consumers cost, per consumer, and what they do to the fast lane.

1. **Cost per consumer.** On the fake NVML of the tests (``tests/support/fake_nvml.py``; its C
   functions are Python, so a call costs what the fake costs, not what the driver does) and a
   made-up procfs tree (``tests/support/procfs_trees.py``: Slurm, Kubernetes, systemd and user
   processes in turn), one window of `run`'s consumer work as the service does it: four reads of
   every GPU's process lists and utilisation samples (``NvmlConsumerLists``), the take, and the
   attribution (procfs look-ups, the split, the series) — with 0, 8 and 32 processes per GPU,
   the scenarios interleaved round by round. Per consumer: (scenario - none) / consumers, in µs,
   for the reads and the attribution apart.
2. **The fast lane.** The real sampler process on the sim (1 ms fast lane, ``--gpus`` GPUs), its
   windows taken as `run` takes them, while this process does (``32/GPU``) or does not
   (``none``) the consumer work of 32 processes per GPU on a thread of its own, four reads a
   window, as `run` does: segments of ``--segment`` seconds alternate, ``--rounds`` each. Per
   segment the fast lane's late ticks (over its threshold), p99 and max lateness per window; the
   table gives the median over windows and the worst, per mode.

    python benchmarks/consumers.py [--gpus 8] [--rounds 3] [--segment 10] [--out FILE]

Prints a table and writes JSON (``benchmarks/out/consumers.json`` by default).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import fake_nvml  # noqa: E402  (the tests' fake libnvidia-ml)
import procfs_trees as trees  # noqa: E402

from hfsampler.config.settings import Config  # noqa: E402
from hfsampler.export.consumer_attribution import ConsumerAttribution, GpuWindow  # noqa: E402
from hfsampler.export.consumer_run import READS_PER_WINDOW  # noqa: E402
from hfsampler.sampling.pipeline import RUN, Pipeline  # noqa: E402
from hfsampler.sampling.plan import build_run  # noqa: E402
from hfsampler.series import SeriesRegistry  # noqa: E402
from hfsampler.sources.base import DeviceInfo  # noqa: E402
from hfsampler.sources.nvml.consumer_reads import NvmlConsumerLists  # noqa: E402

GIB = 1 << 30
KINDS = (trees.SLURM_V2, trees.K8S_SYSTEMD_CONTAINERD, trees.SYSTEMD_SERVICE, trees.ROOT_CGROUP)
SCENARIOS = (0, 8, 32)


class ConsumerWork:
    """One window's consumer work for ``gpus`` fake GPUs with ``per_gpu`` processes each."""

    def __init__(self, gpus: int, per_gpu: int, root: Path, fake: fake_nvml.FakeNvml) -> None:
        self.fake = fake
        self.gpus = gpus
        self.per_gpu = per_gpu
        self.procs: list[list[fake_nvml.FakeProcess]] = []
        for g in range(gpus):
            procs = []
            for k in range(per_gpu):
                pid = 1000 + g * 100 + k
                cgroup = KINDS[k % len(KINDS)]
                if k % len(KINDS) == 0:  # every job its own
                    cgroup = cgroup.replace(trees.JOB, str(10_000 + pid))
                trees.add_process(root, pid, cgroup, comm=f"p{k}", uid=1000 + k % 3)
                procs.append(fake_nvml.FakeProcess(pid, GIB, 100.0 / max(per_gpu, 1)))
            self.procs.append(procs)
        self.use()
        devices = [DeviceInfo(g, f"GPU-{g}", "fake", f"0:{g}", "1", g) for g in range(gpus)]
        self.lists = NvmlConsumerLists(devices)
        self.attribution = ConsumerAttribution(SeriesRegistry(), procfs=str(root))
        self.labels = [{"gpu": str(g), "UUID": f"GPU-{g}"} for g in range(gpus)]
        self.now_us = 0

    def use(self) -> None:
        """This scenario's processes on the fake GPUs (one fake serves every scenario), and
        its clock."""
        for g in range(self.gpus):
            self.fake.gpus[g].processes = self.procs[g]
        self.fake.clock_us = lambda: self.now_us

    def read(self) -> None:
        self.now_us += 250_000
        self.lists.read()

    def window(self) -> tuple[float, float]:
        """(seconds reading, seconds attributing) of one window."""
        t0 = time.perf_counter()
        for _ in range(READS_PER_WINDOW):
            self.read()
        uses = self.lists.take()
        t1 = time.perf_counter()
        gpus = [GpuWindow(self.labels[g], 100.0, uses[g]) for g in range(self.gpus)]
        self.attribution.gpus(gpus)
        return t1 - t0, time.perf_counter() - t1

    def close(self) -> None:
        self.lists.close()


def cost_per_consumer(gpus: int, rounds: int, windows: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        per: dict[int, dict[str, list[float]]] = {n: {"read": [], "attribute": []}
                                                  for n in SCENARIOS}  # fmt: skip
        works = {}
        fake = fake_nvml.install(mp, fake_nvml.make_fake(gpus))
        for n in SCENARIOS:
            works[n] = ConsumerWork(gpus, n, trees.host_procfs(Path(tmp) / f"proc{n}"), fake)
            works[n].window()  # the first: procfs read, series made; not counted
        for r in range(rounds):
            order = SCENARIOS[r % 3 :] + SCENARIOS[: r % 3]
            for n in order:
                works[n].use()
                reads, attrs = zip(*(works[n].window() for _ in range(windows)), strict=True)
                per[n]["read"].append(statistics.median(reads))
                per[n]["attribute"].append(statistics.median(attrs))
        for w in works.values():
            w.close()
    base = {k: statistics.median(v) for k, v in per[0].items()}
    for n in SCENARIOS:
        med = {k: statistics.median(v) for k, v in per[n].items()}
        row = {f"{k}_ms_per_window": med[k] * 1e3 for k in med}
        if n:
            for k in med:
                row[f"{k}_us_per_consumer"] = (med[k] - base[k]) / (n * gpus) * 1e6
        row["spread_ms"] = {k: [min(v) * 1e3, max(v) * 1e3] for k, v in per[n].items()}
        out[str(n)] = row
    return out


def fast_lane(gpus: int, rounds: int, segment_s: float) -> dict[str, Any]:
    config = Config(source="sim", sim_gpus=gpus, listen=None, realtime_priority=1)
    plan = build_run(config)
    pipeline = Pipeline(plan, RUN)
    results: dict[str, list[dict[str, float]]] = {"none": [], "32/GPU": []}
    segments: dict[str, list[float]] = {"none": [], "32/GPU": []}  # late per 1000 ticks each
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        fake = fake_nvml.install(mp, fake_nvml.make_fake(gpus))
        work = ConsumerWork(gpus, 32, trees.host_procfs(Path(tmp) / "proc"), fake)
        pipeline.start()
        pipeline.begin()
        try:
            for r in range(rounds):
                for mode in ("none", "32/GPU") if r % 2 == 0 else ("32/GPU", "none"):
                    stop = threading.Event()
                    worker = None
                    if mode != "none":
                        worker = threading.Thread(target=_work, args=(work, stop), daemon=True)
                        worker.start()
                    end = time.monotonic() + segment_s
                    first = True
                    begun = len(results[mode])
                    while time.monotonic() < end:
                        time.sleep(max(pipeline.due_ns - time.time_ns(), 0) / 1e9)
                        window = pipeline.window()
                        pipeline.advance()
                        if first:  # the window the switch fell in belongs to neither mode
                            first = False
                            continue
                        g = window.groups[0]
                        results[mode].append({
                            "ticks": g.health.ticks, "late": g.health.late,
                            "missed": g.health.missed,
                            "p99_us": g.ticks.lateness_p99_ns / 1e3,
                            "max_us": g.ticks.lateness_max_ns / 1e3,
                        })  # fmt: skip
                    stop.set()
                    if worker is not None:
                        worker.join()
                    part = results[mode][begun:]
                    ticks = sum(x["ticks"] for x in part)
                    segments[mode].append(1000 * sum(x["late"] for x in part) / max(ticks, 1))
        finally:
            pipeline.close()
            work.close()
    out: dict[str, Any] = {"fast_group": plan.groups[0].name}
    for mode, rows in results.items():
        ticks = sum(x["ticks"] for x in rows)
        out[mode] = {
            "windows": len(rows),
            "late_per_1000_ticks": 1000 * sum(x["late"] for x in rows) / max(ticks, 1),
            "missed": sum(x["missed"] for x in rows),
            "p99_us_median": statistics.median(x["p99_us"] for x in rows) if rows else None,
            "max_us_median": statistics.median(x["max_us"] for x in rows) if rows else None,
            "max_us_worst": max((x["max_us"] for x in rows), default=None),
            "late_per_1000_by_segment": segments[mode],
        }
    return out


def _work(work: ConsumerWork, stop: threading.Event) -> None:
    """`run`'s consumer thread and window work, at its pace: four reads a second, a window's
    take and attribution every fourth."""
    k = 0
    while not stop.wait(1.0 / READS_PER_WINDOW):
        work.read()
        k += 1
        if k % READS_PER_WINDOW == 0:
            uses = work.lists.take()
            work.attribution.gpus([GpuWindow(work.labels[g], 100.0, uses[g])
                                   for g in range(work.gpus)])  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=10, help="windows per round (cost part)")
    ap.add_argument("--segment", type=float, default=10.0, help="seconds per fast-lane segment")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "consumers.json"))
    args = ap.parse_args()
    cost = cost_per_consumer(args.gpus, args.rounds, args.windows)
    lane = fast_lane(args.gpus, args.rounds * 2, args.segment)
    print(f"consumer work per window, {args.gpus} GPUs (median of {args.rounds} rounds)")
    print(f"{'per GPU':>8} {'read ms':>9} {'attrib ms':>10} {'read us/c':>10} {'attrib us/c':>12}")
    for n in SCENARIOS:
        row = cost[str(n)]
        print(f"{n:>8} {row['read_ms_per_window']:>9.2f} {row['attribute_ms_per_window']:>10.2f} "
              f"{row.get('read_us_per_consumer', 0):>10.1f} "
              f"{row.get('attribute_us_per_consumer', 0):>12.1f}")  # fmt: skip
    print(f"\nfast lane ({lane['fast_group']}, 1 ms) while this process does the consumer work")
    print(f"{'mode':>8} {'windows':>8} {'late/1000':>10} {'by segment':>22} {'missed':>7} "
          f"{'p99 us':>8} {'max us':>8} {'worst us':>9}")  # fmt: skip
    for mode in ("none", "32/GPU"):
        m = lane[mode]
        seg = m["late_per_1000_by_segment"]
        spread = f"{min(seg):.0f}-{max(seg):.0f} (med {statistics.median(seg):.0f})" if seg else "-"
        print(f"{mode:>8} {m['windows']:>8} {m['late_per_1000_ticks']:>10.2f} {spread:>22} "
              f"{m['missed']:>7} {m['p99_us_median']:>8.1f} {m['max_us_median']:>8.1f} "
              f"{m['max_us_worst']:>9.1f}")  # fmt: skip
    result = {"args": vars(args), "machine": platform.platform(), "cost": cost, "fast_lane": lane}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Window energy: the Monitor's integral against the energy counter's difference, and their cost.

1. Accuracy, on fake GPUs whose power is known every millisecond (the tests' ``KnownPower``: a
   moving baseline and 5 ms spikes, served through the real pynvml over the fake libnvidia-ml,
   on a virtual clock so that minutes of windows take seconds) and whose energy counter is that
   power integrated, updated every 100 ms as on real GPUs. For windows of 10 ms, 100 ms, 1 s and
   10 s at random offsets, in the same run: the Monitor's ``gpu_energy``, and the peer, the
   counter-difference method (what Zeus's ``ZeusMonitor`` does: the difference of
   ``nvmlDeviceGetTotalEnergyConsumption`` at the window's ends). Relative error of each against
   the exact energy: median, p95, max.
2. Cost, with the real sampler process on the sim source (wall clock): ``begin_window`` and
   ``end_window`` (median, p99, min) for windows of 10 ms, 100 ms and 1 s, each right after the
   window's sleep; then how long until the numbers can be read (``answer``: the Monitor's
   reducer process reduces the window and the Measurement waits for it on its first read; 0 in
   trees before it, whose ``end_window`` reduced in the job's process), then the first read of
   the p99 and the throttled time (made on first use in older trees); and the CPU time of the
   job's whole process over all of it (``job CPU``: every thread). Also ``begin_window`` and
   ``end_window`` back to back with no sleep between (``back to back``: their own code, warm),
   and the same 10 ms and 1 s spans measured and read back to back (``warm``). With
   ``--peer-ref`` (a commit of this repository, exported with ``git archive``), the cost of this
   tree and of the peer's, each in a process of its own, alternating ``--rounds`` times: the same
   machine and load for both.

    python benchmarks/measure.py [--windows 40] [--cost-windows 300] [--peer-ref c79951a]
                                 [--rounds 2] [--out benchmarks/out/measure.json]

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# --tree: the package to measure (a peer's, exported by ``cost_against``); this one by default
TREE = Path(sys.argv[sys.argv.index("--tree") + 1]) if "--tree" in sys.argv else REPO
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(0, str(TREE))

from fake_nvml import install  # noqa: E402  (the tests' fake libnvidia-ml)
from known_power import MS_NS, KnownPower  # noqa: E402

from hfsampler import Monitor  # noqa: E402
from hfsampler.sampling.stepping import VirtualClock  # noqa: E402
from hfsampler.sources.nvml import calls as nvml  # noqa: E402  (the one module on pynvml)

WINDOWS_MS = (10, 100, 1000, 10_000)
START_NS = 1_780_000_000 * 10**9


def accuracy(windows: int, seed: int) -> dict[str, Any]:
    """Each window length ``windows`` times (10 s windows: a quarter as many), both methods."""
    rng = np.random.default_rng(seed)
    plan = [(ms, int(rng.integers(0, 997))) for ms in WINDOWS_MS
            for _ in range(windows if ms < 10_000 else max(2, windows // 4))]  # fmt: skip
    total_s = sum(ms + gap for ms, gap in plan) / 1e3 + 2.0
    truth = KnownPower(START_NS, total_s, seed=seed)
    for g in range(truth.gpus):  # a 5 ms spike at a random point of every 200 ms
        for k in range(int(total_s * 5)):
            at = START_NS + k * 200 * MS_NS + int(rng.integers(0, 190)) * MS_NS
            truth.spike(g, at, 5, 900.0)
    clock = VirtualClock(START_NS)
    fake = truth.fake()
    fake.clock_us = lambda: clock.now_ns() // 1000
    install(pytest.MonkeyPatch(), fake)
    handles = [nvml.device_handle(g) for g in range(truth.gpus)]
    (energy_mj,) = nvml.READERS["total_energy"]

    def counter_mj() -> list[int]:
        return [int(energy_mj(h)) for h in handles]

    def run_ms(ms: int) -> None:
        for _ in range(ms):
            clock.sleep(0.001)  # a tick at a time: the fake's driver reads the clock's now

    errors: dict[str, dict[int, list[float]]] = {"monitor": {}, "counter": {}}
    with Monitor(source="nvml", clock=clock, env={}, history_s=30.0) as mon:
        run_ms(200)
        nvml.init()
        for ms, gap in plan:
            run_ms(gap)
            clock.sleep(float(rng.integers(0, 1000)) / 1e6)  # not on a tick
            t0 = clock.now_ns()
            mon.begin_window("w")
            before = counter_mj()
            run_ms(ms)
            m = mon.end_window("w")
            after = counter_mj()
            t1 = clock.now_ns()
            for g in range(truth.gpus):
                exact = truth.truth_j(g, t0, t1)
                errors["monitor"].setdefault(ms, []).append(abs(m.gpu_energy[g] / exact - 1))
                counter_j = (after[g] - before[g]) / 1e3
                errors["counter"].setdefault(ms, []).append(abs(counter_j / exact - 1))
        nvml.shutdown()
    out: dict[str, Any] = {}
    for method, by_ms in errors.items():
        out[method] = {
            str(ms): {
                "windows": len(e),
                "median": float(np.median(e)),
                "p95": float(np.percentile(e, 95)),
                "max": float(np.max(e)),
            }
            for ms, e in by_ms.items()
        }
    return out


def _spread(us: list[float]) -> dict[str, float]:
    return {"median": float(np.median(us)), "p99": float(np.percentile(us, 99)),
            "min": float(np.min(us))}  # fmt: skip


# each window's length, and the share of --cost-windows timed at it
COST_WINDOWS = {"10ms": (0.01, 1.0), "100ms": (0.1, 0.25), "1s": (1.0, 0.05)}


def cost(windows: int) -> dict[str, Any]:
    """begin/end cost with the real sampler process on the sim: wall clock, and the thread's CPU
    time (which leaves out being preempted); ``warm``: the same span measured back to back,
    caches hot, as against right after the window's sleep. Only the Monitor's public calls, so
    that an older tree (``--peer-ref``) runs the same code."""
    out: dict[str, Any] = {}
    with Monitor(source="sim", env={}, history_s=10.0) as mon:
        time.sleep(1.2)  # some history, and the sampler settled
        for label, (length_s, share) in COST_WINDOWS.items():
            n = max(3, int(windows * share))
            begin, end, end_cpu, answer, deferred, job_cpu = [], [], [], [], [], []
            for k in range(n):
                a = time.perf_counter_ns()
                mon.begin_window(k)
                b = time.perf_counter_ns()
                time.sleep(length_s)
                c, c_cpu, c_job = time.perf_counter_ns(), time.thread_time_ns(), _job_cpu_ns()
                m = mon.end_window(k)
                d, d_cpu = time.perf_counter_ns(), time.thread_time_ns()
                _ = m.total_energy  # the answer (waited for, where a reducer process makes it)
                e = time.perf_counter_ns()
                m.gpu_p99_power[0], m.gpu_throttled_time[0]  # made on first use, in older trees
                f, f_job = time.perf_counter_ns(), _job_cpu_ns()
                begin.append((b - a) / 1e3)
                end.append((d - c) / 1e3)
                end_cpu.append((d_cpu - c_cpu) / 1e3)
                answer.append((e - d) / 1e3)
                deferred.append((f - e) / 1e3)
                job_cpu.append((f_job - c_job) / 1e3)
            out[label] = {"windows": n, "begin_us": _spread(begin), "end_us": _spread(end),
                          "end_cpu_us": _spread(end_cpu), "answer_us": _spread(answer),
                          "p99_and_throttling_us": _spread(deferred),
                          "job_cpu_us": _spread(job_cpu)}  # fmt: skip
        begin, end = [], []
        for k in range(windows * 10):  # begin and end back to back: their own code, warm
            a = time.perf_counter_ns()
            mon.begin_window(k)
            b = time.perf_counter_ns()
            mon.end_window(k)
            end.append((time.perf_counter_ns() - b) / 1e3)
            begin.append((b - a) / 1e3)
        out["back to back"] = {"windows": len(end), "begin_us": _spread(begin),
                               "end_us": _spread(end)}  # fmt: skip
        for label in ("10ms", "1s"):
            t1 = time.time_ns()
            span_ns = int(COST_WINDOWS[label][0] * 1e9)
            warm = []
            for _ in range(windows if label == "10ms" else windows // 10):
                a = time.perf_counter_ns()
                _ = mon.measure(t1 - span_ns, t1).total_energy
                warm.append((time.perf_counter_ns() - a) / 1e3)
            out[f"{label} warm"] = {"windows": len(warm), "end_us": _spread(warm)}
    return out


def _job_cpu_ns() -> int:
    """The CPU time of this process, every thread of it (the Monitor's own included)."""
    return time.process_time_ns()


def cost_against(windows: int, peer_ref: str, rounds: int) -> dict[str, Any]:
    """``cost`` of this tree and of ``peer_ref`` (this repository's package at that commit),
    each in a process of its own, alternating, ``rounds`` times: the same machine, the same
    load, for both."""
    from record import export_peer  # here: it imports this tree's package, not the peer's

    with tempfile.TemporaryDirectory() as tmp:
        peer = export_peer(peer_ref, Path(tmp, "peer"))
        if peer is None:
            raise SystemExit(f"cannot export {peer_ref} from {REPO}")
        sides = {"this": REPO, peer_ref: peer}
        out: dict[str, Any] = {side: [] for side in sides}
        for _ in range(rounds):
            for side, tree in sides.items():
                got = Path(tmp, "cost.json")
                env = {**os.environ, "PYTHONPATH": str(tree)}
                subprocess.run([sys.executable, __file__, "--cost-only", "--tree", str(tree),
                                "--cost-windows", str(windows), "--out", str(got)],
                               check=True, env=env)  # fmt: skip
                out[side].append(json.loads(got.read_text()))
    return out


def numpy_op_us(n: int = 2000) -> float:
    """The median time of one small numpy operation here: ``end_window`` is some thirty of them,
    so this is the machine's scale for its cost (about 1 us on an idle modern core)."""
    a, b = np.ones((12, 2, 3)), np.ones((12, 2, 3))
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        np.add(a, b)
        times.append(time.perf_counter_ns() - t)
    return float(np.median(times)) / 1e3


def numpy_op_after_sleep_us(n: int = 100) -> float:
    """The median time of the same operation right after a 10 ms sleep, as ``end_window`` runs
    after a step that waited: on a shared machine the core's caches held others' work
    meanwhile, and every distinct call pays for that again (the floor for any code there)."""
    a, b = np.ones((12, 2, 3)), np.ones((12, 2, 3))
    times = []
    for _ in range(n):
        time.sleep(0.01)
        t = time.perf_counter_ns()
        np.add(a, b)
        times.append(time.perf_counter_ns() - t)
    return float(np.median(times)) / 1e3


def _cost_table(costs: dict[str, Any]) -> None:
    print(f"{'window':>9} | {'begin median':>12} {'p99':>6} | {'end median':>10} {'p99':>7} "
          f"{'min':>6} | {'end CPU':>7} | {'answer':>6} | {'p99+thr':>7} | "
          f"{'job CPU':>7}")  # fmt: skip
    for label, c in costs.items():
        nan = {"median": np.nan, "p99": np.nan}
        b, e, cpu = c.get("begin_us", nan), c["end_us"], c.get("end_cpu_us", nan)
        answer, later = c.get("answer_us", nan), c.get("p99_and_throttling_us", nan)
        job = c.get("job_cpu_us", nan)
        print(f"{label:>9} | {b['median']:>12.1f} {b['p99']:>6.1f} | {e['median']:>10.1f} "
              f"{e['p99']:>7.1f} {e['min']:>6.1f} | {cpu['median']:>7.1f} | "
              f"{answer['median']:>6.1f} | {later['median']:>7.1f} | "
              f"{job['median']:>7.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=40, help="windows per length")
    parser.add_argument("--cost-windows", type=int, default=300, help="10 ms windows timed")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peer-ref", help="also time the package at this commit, alternating")
    parser.add_argument("--rounds", type=int, default=2, help="alternations with --peer-ref")
    parser.add_argument("--cost-only", action="store_true", help="only the cost (what a peer runs)")
    parser.add_argument("--tree", help="the package's tree to time (set by --peer-ref)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "measure.json"))
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.cost_only:
        Path(args.out).write_text(json.dumps(cost(args.cost_windows)) + "\n")
        return 0
    acc = accuracy(args.windows, args.seed)
    peers: dict[str, Any] = {}
    if args.peer_ref:
        peers = cost_against(args.cost_windows, args.peer_ref, args.rounds)
        costs = peers["this"][0]
    else:
        costs = cost(args.cost_windows)
    op_us, after_sleep_us = numpy_op_us(), numpy_op_after_sleep_us()
    print("relative energy error against the fake's exact energy (per GPU and window)")
    print(f"{'window':>8} | {'Monitor median':>14} {'p95':>9} {'max':>9} | "
          f"{'counter median':>14} {'p95':>9} {'max':>9}")  # fmt: skip
    for ms in WINDOWS_MS:
        a, c = acc["monitor"][str(ms)], acc["counter"][str(ms)]
        print(f"{ms:>6}ms | {a['median']:>14.2e} {a['p95']:>9.2e} {a['max']:>9.2e} | "
              f"{c['median']:>14.2%} {c['p95']:>9.2%} {c['max']:>9.2%}")  # fmt: skip
    if peers:
        for side, rounds in peers.items():
            for k, got in enumerate(rounds, 1):
                print(f"\ncost in the job's process, {side}, round {k} of {len(rounds)} "
                      "(alternating), real sampler process on 2 sim GPUs (us)")  # fmt: skip
                _cost_table(got)
    else:
        print("\ncost in the job's process, real sampler process on 2 sim GPUs (us)")
        _cost_table(costs)
    print(f"one small numpy operation here: {op_us:.2f} us, {after_sleep_us:.1f} us right after a "
          "10 ms sleep (the machine's scale)")  # fmt: skip
    result = {
        "benchmark": "measure",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_average": list(os.getloadavg())},
        "counter_update_period_ms": 100,
        "accuracy": acc,
        "cost": costs,
        "cost_rounds": peers,
        "numpy_op_us": op_us,
        "numpy_op_after_sleep_us": after_sleep_us,
        "seconds": time.monotonic() - started,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

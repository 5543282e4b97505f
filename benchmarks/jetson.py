"""Benchmark: the jetson source's fast tick on the AGX Orin fixture, and CPU at default intervals.

1. One fast tick (``JetsonSource.read`` of the fast group: GPU load and clock, every rail's power,
   voltage and current, memory, EMC), on the AGX Orin fixture tree (tests/support/jetson_trees.py):
   - ``every file due``: each file re-read (ticks 50 ms apart), the worst case a 1 ms tick
     must fit; once a second of that clock the read also checks every file's inode (a stat
     each), which a run does on a slow group's read, so it shows in the p99;
   - ``at 1 kHz``: ticks 1 ms apart on the source's clock, so rails are re-read only every half
     conversion cycle (3.5 ms), as in a run.
   The peer, in the same run: tegrastats / jtop-style reading of the same files, open + read +
   close of each path on every tick, against our ``os.pread`` on descriptors opened once. And the
   sim source's tick for one GPU and the same number of fields, the reference the sampler
   benchmark uses.
2. CPU at the default intervals (fast 1 ms, slow 100 ms, window 1 s): ``hfsampler run --source
   jetson`` on the fixture, its signals rewritten in place as the hardware would, no export,
   for ``--seconds``; CPU of the service and of the sampler process in the steady state
   (``/proc/<pid>/stat``), and of the whole run with its start-up; beside ``hfsampler run
   --source sim --gpus 1`` over the same time.

The fixture's files are page-cache reads: on a Jetson, a sysfs read runs the driver's show
function, and an INA3221 one is an I2C transfer (~0.1-0.3 ms), so the hardware's tick costs more;
this measures hfsampler's own share and the difference the open descriptors make.

    python benchmarks/jetson.py [--seconds 10] [--ticks 5000] [--out benchmarks/out/jetson.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))

import jetson_trees as jt  # noqa: E402

from hfsampler import fields as catalogue  # noqa: E402
from hfsampler.sources.jetson.files import parse_int  # noqa: E402
from hfsampler.sources.jetson.source import JetsonSource  # noqa: E402
from hfsampler.sources.sim.source import SimSource  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
MS = 1_000_000


def _stats(took_ns: list[int] | np.ndarray) -> dict[str, float]:
    us = np.asarray(took_ns, dtype=np.float64)[len(took_ns) // 10 :] / 1e3  # drop warm-up
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean())}  # fmt: skip


def _timed(fn: Callable[[int], None], ticks: int) -> list[int]:
    took = []
    for k in range(ticks):
        t = time.perf_counter_ns()
        fn(k)
        took.append(time.perf_counter_ns() - t)
    return took


def tick_cost(root: Path, ticks: int) -> dict[str, Any]:
    """The fast group's read on the fixture: ours in two regimes, the open/read/close peer, sim."""
    src = JetsonSource(root, measure_s=0.0)
    inv = src.open(catalogue.CATALOGUE)
    fast = tuple(f for f, ok in zip(inv.fields, inv.supported[0], strict=True)
                 if ok and f.group == catalogue.FAST)  # fmt: skip
    values = np.zeros((1, len(fast)))
    ts = np.zeros((1, len(fast)), dtype=np.int64)
    t0 = time.time_ns()
    src.read(fast, values, ts, t0)
    read_files = [str(f.blob.path) for f in src.files_for(fast)]  # what the peer opens per tick

    def every_due(k: int) -> None:  # 50 ms apart on the source's clock: every file is due (and
        # every 20th tick, once a second, the files' inode check runs, as on a slow group's read)
        src.read(fast, values, ts, t0 + (k + 1) * 50 * MS)

    base = t0 + (ticks + 2) * 50 * MS

    def at_1khz(k: int) -> None:
        src.read(fast, values, ts, base + k * MS)

    due = _timed(every_due, ticks)
    khz = _timed(at_1khz, ticks)
    read_errors = sum(f.errors for f in src.files)
    src.close()

    def open_read_close(_: int) -> None:  # tegrastats / jtop: open, read, close, each time
        for path in read_files:
            with open(path, "rb") as fh:
                data = fh.read()
            if b":" not in data:
                parse_int(data)

    peer = _timed(open_read_close, ticks)
    sim = SimSource(1)
    sim_fields = tuple(f for f in catalogue.CATALOGUE if f.group == catalogue.FAST
                       and f.nvml_readable)[: len(fast)]  # fmt: skip
    sim.open(sim_fields)
    sv = np.zeros((1, len(sim_fields)))
    st = np.zeros((1, len(sim_fields)), dtype=np.int64)
    sim_t0 = time.time_ns()
    sim_took = _timed(lambda k: sim.read(sim_fields, sv, st, sim_t0 + k * MS), ticks)
    return {
        "fields": len(fast),
        "files": len(read_files),
        "read_errors": read_errors,
        "jetson_every_file_due": _stats(due),
        "jetson_at_1khz": _stats(khz),
        "peer_open_read_close": _stats(peer),
        "sim_1gpu_same_field_count": {**_stats(sim_took), "fields": len(sim_fields)},
    }


def _proc_cpu_s(pid: int) -> float:
    text = Path(f"/proc/{pid}/stat").read_text()
    after = text[text.rindex(")") + 2 :].split()
    return (int(after[11]) + int(after[12])) / CLK_TCK


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_cpu(args: list[str], seconds: float) -> dict[str, Any]:
    """``hfsampler run ARGS`` for ``seconds``: CPU of the whole run (start-up included), and in
    the steady state (from /proc, between 2 s in and 0.5 s before the end) of the service and
    of the sampler process."""
    before = _children_cpu_s()
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "hfsampler", *args, "--duration",
                             f"{seconds:g}s", "--listen", ""], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    sampler_pid = None
    marks: list[tuple[float, float, float]] = []  # (elapsed, service CPU, sampler CPU)
    want = [2.0, seconds - 0.5]
    while proc.poll() is None:
        elapsed = time.monotonic() - started
        try:
            if sampler_pid is None:
                # the service starts the sampler from an executor thread: any task's children
                tasks = Path(f"/proc/{proc.pid}/task").glob("*/children")
                for pid in {int(p) for t in tasks for p in t.read_text().split()}:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
                        sampler_pid = pid
            if sampler_pid is not None and want and elapsed >= want[0]:
                marks.append((elapsed, _proc_cpu_s(proc.pid), _proc_cpu_s(sampler_pid)))
                want.pop(0)
        except OSError:
            pass  # it is ending
        time.sleep(0.02)
    _, err = proc.communicate()
    wall = time.monotonic() - started
    total = _children_cpu_s() - before
    out: dict[str, Any] = {
        "args": args,
        "returncode": proc.returncode,
        "wall_s": wall,
        "tree_cpu_s": total,
        "tree_cpu_pct_of_wall": 100 * total / wall,
        "stderr_tail": err.decode(errors="replace")[-600:] if proc.returncode else "",
    }
    if len(marks) == 2:
        (e0, s0, p0), (e1, s1, p1) = marks
        out["steady_service_cpu_pct"] = 100 * (s1 - s0) / (e1 - e0)
        out["steady_sampler_cpu_pct"] = 100 * (p1 - p0) / (e1 - e0)
        out["steady_s"] = e1 - e0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="each CPU run's length")
    ap.add_argument("--ticks", type=int, default=5000, help="reads per tick measurement")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/out/jetson.json")
    ns = ap.parse_args(argv)
    board = jt.BOARDS["agx-orin-jp6"]
    report: dict[str, Any] = {"board": board.name, "python": platform.python_version(),
                              "machine": platform.machine(), "cpus": os.cpu_count()}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = jt.build(board, Path(tmp) / board.name)
        report["tick"] = tick_cost(root, ns.ticks)
        config = Path(tmp) / "jetson.yml"
        config.write_text(f"source: jetson\njetson: {{sysfs_root: {root}}}\n")
        writer = jt.TreeWriter(board, root).start()
        try:
            report["run_jetson"] = run_cpu(["run", "--config", str(config)], ns.seconds)
        finally:
            writer.stop()
        report["writer_writes"] = writer.writes
        report["run_sim_1gpu"] = run_cpu(["run", "--source", "sim", "--gpus", "1"], ns.seconds)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"\nwrote {ns.out}")
    return 0


def print_report(r: dict[str, Any]) -> None:
    t = r["tick"]
    print(f"fast tick on the {r['board']} fixture: {t['fields']} fields from {t['files']} files "
          f"(µs per tick)")  # fmt: skip
    print(f"{'':<44}{'p50':>8}{'p99':>8}{'mean':>8}")
    rows = [
        ("jetson, every file due (pread, open fds)", t["jetson_every_file_due"]),
        ("jetson at 1 kHz (rails every 3.5 ms)", t["jetson_at_1khz"]),
        ("peer: open+read+close per file (tegrastats)", t["peer_open_read_close"]),
        (f"sim, 1 GPU, {t['sim_1gpu_same_field_count']['fields']} fields",
         t["sim_1gpu_same_field_count"]),
    ]  # fmt: skip
    for name, s in rows:
        print(f"{name:<44}{s['p50_us']:>8.1f}{s['p99_us']:>8.1f}{s['mean_us']:>8.1f}")
    ratio = t["peer_open_read_close"]["p50_us"] / t["jetson_every_file_due"]["p50_us"]
    print(f"peer / ours (every file due), p50: {ratio:.1f}x")
    print()
    print("CPU at the default intervals (fast 1 ms, slow 100 ms, window 1 s), % of one core;")
    print("steady state (2 s in to 0.5 s before the end) of the service and the sampler process,")
    print("and the whole run's process tree with start-up")
    print(f"{'':<34}{'service':>8}{'sampler':>9}{'whole':>8}{'wall s':>8}")
    nan = float("nan")
    for key, name in (("run_jetson", "run --source jetson (AGX Orin)"),
                      ("run_sim_1gpu", "run --source sim --gpus 1")):  # fmt: skip
        c = r[key]
        print(f"{name:<34}{c.get('steady_service_cpu_pct', nan):>8.1f}"
              f"{c.get('steady_sampler_cpu_pct', nan):>9.1f}{c['tree_cpu_pct_of_wall']:>8.1f}"
              f"{c['wall_s']:>8.1f}")  # fmt: skip
        if c["returncode"]:
            print(f"  exited {c['returncode']}: {c['stderr_tail']}")


if __name__ == "__main__":
    raise SystemExit(main())

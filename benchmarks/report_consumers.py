"""What consumers cost `record`'s file and `report`: bytes per GPU-hour and the report's CPU time.

Synthesizes two recordings of the same sim GPUs over the same seconds, offline (the writer and
window code of `hfsampler record`, ``tests/support/sim_recordings.py``): one without consumers,
the peer, and one with a ``CONS`` chunk every window holding ``--consumers`` consumers on every
GPU, each seen at two looks (what `record` stores for a job sharing its GPUs). Then summarises
each (``summarize`` and ``summary_dict``: the JSON report's work, in this process) in turns,
``--rounds`` times in an order rotated every round, and reports each side's median CPU seconds
with its lowest and highest, the difference per GPU-window (mostly ``consumers.split``, called
once per GPU and window as `run` calls it) and the bytes the consumers add per GPU-hour.

    python benchmarks/report_consumers.py [--gpus 2] [--seconds 600] [--consumers 2] [--rounds 3]

Prints a table and writes benchmarks/out/report_consumers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))

from sim_recordings import start_for, synthesize  # noqa: E402

from hfsampler.consumers.identity import Consumer, Kind  # noqa: E402
from hfsampler.consumers.split import WindowUse  # noqa: E402
from hfsampler.profiling.recording import Recording  # noqa: E402
from hfsampler.profiling.recording_format import ConsumerWindow  # noqa: E402
from hfsampler.profiling.summary import summarize  # noqa: E402
from hfsampler.profiling.tables import summary_dict  # noqa: E402


def windows(gpus: int, consumers: int) -> Callable[[int, int], ConsumerWindow]:
    """Each window: ``consumers`` jobs on every GPU, at two looks, with memory."""
    who = {100 + k: Consumer(Kind.HPC_JOB, hpc_job=str(4000 + k)) for k in range(consumers)}

    def make(t0: int, t1: int) -> ConsumerWindow:
        looks = (t0 // 1000 + 100_000, t0 // 1000 + 600_000)
        samples = [(pid, ts, 10.0 + k) for k, pid in enumerate(who) for ts in looks]
        entries: list[tuple[int, int, float | None]] = [
            (pid, r, 1e9 * (k + 1)) for k, pid in enumerate(who) for r in (1, 2)
        ]
        uses = {row: WindowUse.of(0.0, samples, entries) for row in range(gpus)}
        return ConsumerWindow(t0, t1, uses, who)

    return make


def cpu_s(path: Path) -> float:
    began = time.process_time()
    summary_dict(summarize(Recording(path)))
    return time.process_time() - began


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--seconds", type=int, default=600)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = start_for(ns.seconds)
        plain, shared = Path(tmp, "plain.hfs"), Path(tmp, "consumers.hfs")
        synthesize(plain, ns.gpus, ns.seconds, quantize=True, start_ns=start)
        synthesize(shared, ns.gpus, ns.seconds, quantize=True, start_ns=start,
                   consumers=windows(ns.gpus, ns.consumers))  # fmt: skip
        sides = {"without consumers": plain, "with consumers": shared}
        times: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for r in range(ns.rounds):
            for name in order[r % 2 :] + order[: r % 2]:
                times[name].append(cpu_s(sides[name]))
        size = {name: path.stat().st_size for name, path in sides.items()}
    gpu_hours = ns.gpus * ns.seconds / 3600
    median = {name: statistics.median(t) for name, t in times.items()}
    extra = median["with consumers"] - median["without consumers"]
    result = {
        "gpus": ns.gpus, "seconds": ns.seconds, "consumers_per_gpu": ns.consumers,
        "rounds": ns.rounds, "report_cpu_s": times, "report_cpu_s_median": median,
        "extra_cpu_us_per_gpu_window": extra / (ns.gpus * ns.seconds) * 1e6,
        "extra_bytes_per_gpu_hour": (size["with consumers"] - size["without consumers"])
        / gpu_hours,
        "bytes": size,
    }  # fmt: skip
    out = REPO / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report_consumers.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{ns.gpus} GPUs x {ns.seconds} s, {ns.consumers} consumers per GPU every window")
    print(f"{'report (JSON), CPU s':<36} {'median':>8} {'min':>8} {'max':>8}")
    for name, t in times.items():
        print(f"{name:<36} {median[name]:>8.2f} {min(t):>8.2f} {max(t):>8.2f}")
    print(f"{'extra CPU per GPU-window (µs)':<36} {result['extra_cpu_us_per_gpu_window']:>8.0f}")
    print(f"{'extra bytes per GPU-hour (KB)':<36} {result['extra_bytes_per_gpu_hour'] / 1e3:>8.0f}")
    print("(a shared machine: compare the two rows of one run, not runs)")


if __name__ == "__main__":
    main()

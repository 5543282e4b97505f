"""Recording cost: bytes per GPU-hour at 1 kHz, recorder CPU, report time and memory by length.

1. Synthesizes a recording offline from the sim source at virtual time (the same writer and
   window code as `hfsampler record`, without waiting an hour) and measures its size; once with the
   sim's full-precision noise (a worst case: random float bits do not compress), once with values
   rounded to NVML's own resolution (1 mW, 1 %, 1 MHz, 1 MiB), which is what real GPUs give.
2. Runs `hfsampler record --duration` and `hfsampler run --duration` (no export) on the same sim
   GPUs and compares their CPU time: the difference is what recording costs.
3. Runs `hfsampler report` (JSON and HTML) on synthesized recordings of 0.5, 2 and 8 GPU-hours
   (``--gpus`` GPUs, so 8 GPUs: 3.75, 15 and 60 min) and measures each run's wall time, CPU time
   and peak RSS (``wait4``: that process alone), and the HTML's size; GPU-hours reduced per CPU
   minute (the report is one thread: per core). Peer, in the same run: the report before it
   streamed (``--peer-ref``, a commit of this repository, exported with ``git archive``), on the
   recordings up to ``--peer-max-gpu-hours`` (its memory grows about 0.67 GB per GPU-hour).
   Each report reads a recording of the same sim GPUs over the same seconds written by its own
   version: the peer's by the synthesizer of its own ``benchmarks/record.py``, in its own
   format and catalogue (53 fields, all recorded). Today's files are not the peer's to read: its
   catalogue lacks DCGM_FI_DEV_FB_TOTAL (``KeyError``) and, given only the fields it knows, its
   reader still fails on today's raw chunks (``ValueError`` in ``Recording._raw``). Each side
   thus does the job a user of that version had: profile this run, then report it.

    python benchmarks/record.py [--gpus 8] [--hours 1] [--cpu-seconds 15]
                                [--report-gpu-hours 0.5,2,8] [--peer-ref 22a9a79]
                                [--peer-max-gpu-hours 2]

Prints a table and writes benchmarks/out/record.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "tests" / "support"))

from sim_recordings import synthesize  # noqa: E402  (the tests' offline sim recordings)


def cpu_of(args: list[str]) -> float:
    """User + system CPU seconds of a command and every process it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


# Runs `hfsampler ARGS` and, at exit, prints its own peak RSS (VmHWM): ru_maxrss would count the
# pages the child shared with this benchmark between fork and exec (the synthesizer's gigabytes).
PEAK_RSS = """import atexit, runpy, sys
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("PEAK_RSS_KB " + line.split()[1] + "\\n")
atexit.register(peak)
import hfsampler
sys.stderr.write("IMPORTED " + hfsampler.__file__ + "\\n")
sys.argv[0] = "hfsampler"
runpy.run_module("hfsampler", run_name="__main__")
"""


def measured(args: list[str], root: Path, cwd: Path) -> dict[str, float]:
    """Wall and CPU seconds (``wait4``: that process alone) and peak RSS of `hfsampler ARGS`,
    the package imported from ``root`` (run in ``cwd``, not the checkout, whose own package
    would come first on ``sys.path``)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", PEAK_RSS, *args], env=env, cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    err = proc.stderr.read().decode() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{args} failed ({proc.returncode}): {err[-2000:]}")
    peak_kb = [int(line.split()[1]) for line in err.splitlines() if line.startswith("PEAK_RSS_KB")]
    imported = [line for line in err.splitlines() if line.startswith("IMPORTED ")]
    if not imported or not imported[-1].endswith(str(root / "hfsampler" / "__init__.py")):
        raise RuntimeError(f"the wrong hfsampler ran: {imported} (wanted {root})")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": peak_kb[-1] / 1024}  # fmt: skip


def export_peer(ref: str, into: Path, paths: tuple[str, ...] = ("hfsampler",)) -> Path | None:
    """The package (and other ``paths``) as it was at ``ref`` (None where git or the commit is
    not there)."""
    into.mkdir(parents=True, exist_ok=True)
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, *paths],
                                 check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return into


# Runs the peer's own synthesizer (its benchmarks/record.py, its package): ARGV path gpus seconds.
PEER_SYNTHESIZE = """import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from record import synthesize
synthesize(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), quantize=False)
"""


def peer_recording(peer: Path, path: Path, gpus: int, seconds: int) -> Path:
    """A recording of the same sim GPUs and seconds as this tree's, by the peer's own writer."""
    env = {**os.environ, "PYTHONPATH": str(peer)}
    subprocess.run([sys.executable, "-c", PEER_SYNTHESIZE, str(peer / "benchmarks"), str(path),
                    str(gpus), str(seconds)], env=env, cwd=path.parent, check=True)  # fmt: skip
    return path


def report_scaling(tmp: Path, gpus: int, gpu_hours: list[float], peer: Path | None,
                   peer_max: float, made: dict[float, Path]) -> list[dict[str, Any]]:  # fmt: skip
    """`hfsampler report` on recordings of each length (``made``: those already synthesized, by
    GPU-hours): this tree's on its own, and the peer's on one its own writer made."""
    rows: list[dict[str, Any]] = []
    for gh in gpu_hours:
        path = made.get(gh) or tmp / f"report-{gh:g}.hfs"
        seconds = int(gh * 3600 / gpus)
        if not path.exists():
            synthesize(path, gpus, seconds, quantize=False)
        sides = [("new", REPO, path)]
        if peer is not None and gh <= peer_max:
            made_by_peer = peer_recording(peer, tmp / f"report-{gh:g}-peer.hfs", gpus, seconds)
            sides.append(("old", peer, made_by_peer))
        for impl, root, recording in sides:
            size_mb = recording.stat().st_size / 1e6
            for fmt in ("json", "html"):
                out = tmp / f"report-{gh:g}-{impl}.{fmt}"
                m = measured(["report", str(recording), "--format", fmt, "-o", str(out)], root,
                             tmp)  # fmt: skip
                rows.append({"gpu_hours": gh, "file_mb": size_mb, "impl": impl,
                             "format": fmt, **m, "output_mb": out.stat().st_size / 1e6,
                             "gpu_hours_per_cpu_minute": gh / (m["cpu_s"] / 60)})  # fmt: skip
                out.unlink()
            recording.unlink()
    return rows


def print_scaling(rows: list[dict[str, Any]]) -> None:
    old = {(r["gpu_hours"], r["format"]): r for r in rows if r["impl"] == "old"}
    print(f"\n{'report':<14} {'GPU-h':>6} {'file MB':>8} {'wall s':>7} {'CPU s':>6} "
          f"{'GPU-h/CPU-min':>13} {'peak RSS MB':>11} {'out MB':>7} {'old file MB':>11} "
          f"{'old RSS MB':>10} "
          f"{'RSS new/old':>11} {'CPU new/old':>11}")  # fmt: skip
    for r in rows:
        if r["impl"] != "new":
            continue
        peer = old.get((r["gpu_hours"], r["format"]))
        ratio_rss = f"{r['peak_rss_mb'] / peer['peak_rss_mb']:.2f}" if peer else "-"
        ratio_cpu = f"{r['cpu_s'] / peer['cpu_s']:.2f}" if peer else "-"
        old_rss = f"{peer['peak_rss_mb']:.0f}" if peer else "-"
        old_mb = f"{peer['file_mb']:.1f}" if peer else "-"
        print(f"{r['format']:<14} {r['gpu_hours']:>6g} {r['file_mb']:>8.1f} {r['wall_s']:>7.1f} "
              f"{r['cpu_s']:>6.1f} {r['gpu_hours_per_cpu_minute']:>13.1f} "
              f"{r['peak_rss_mb']:>11.0f} {r['output_mb']:>7.1f} {old_mb:>11} {old_rss:>10} "
              f"{ratio_rss:>11} {ratio_cpu:>11}")  # fmt: skip
    print("(a shared 2-core machine: CPU seconds are steadier than wall; compare the ratios)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--cpu-seconds", type=int, default=15)
    ap.add_argument("--report-gpu-hours", default="0.5,2,8")
    ap.add_argument("--peer-ref", default="22a9a79", help="the report before it streamed")
    ap.add_argument("--peer-max-gpu-hours", type=float, default=2.0)
    ns = ap.parse_args()
    seconds = int(ns.hours * 3600)
    result: dict[str, object] = {"gpus": ns.gpus, "seconds": seconds}
    with tempfile.TemporaryDirectory() as tmp:
        quant = synthesize(Path(tmp, "q.hfs"), ns.gpus, min(seconds, 300), quantize=True)
        result["quantized_5min"] = quant
        full = Path(tmp, "run.hfs")
        result["sim_full_precision"] = synthesize(full, ns.gpus, seconds, quantize=False)
        hf = [sys.executable, "-m", "hfsampler"]
        peer = export_peer(ns.peer_ref, Path(tmp, "peer"), ("hfsampler", "benchmarks/record.py"))
        result["report_peer"] = ns.peer_ref if peer else None
        wanted = [float(x) for x in ns.report_gpu_hours.split(",") if x]
        scaling = report_scaling(Path(tmp), ns.gpus, wanted, peer, ns.peer_max_gpu_hours,
                                 {ns.gpus * seconds / 3600: full})  # fmt: skip
        result["report"] = scaling
        gpus = ",".join(str(i) for i in range(ns.gpus))
        dur = f"{ns.cpu_seconds}s"
        base = cpu_of([*hf, "run", "--source", "sim", "--gpus", str(ns.gpus), "--listen", "",
                       "--duration", dur])  # fmt: skip
        rec = cpu_of([*hf, "record", "--source", "sim", "--gpus", gpus, "--quiet", "--duration",
                      dur, "-o", str(Path(tmp, "live.hfs"))])  # fmt: skip
        result["cpu_run_s"], result["cpu_record_s"] = base, rec
        result["record_overhead_cpu_percent"] = 100 * (rec - base) / ns.cpu_seconds
    out_dir = REPO / "benchmarks" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "record.json").write_text(json.dumps(result, indent=2) + "\n")
    full_r = result["sim_full_precision"]
    assert isinstance(full_r, dict)
    print(f"{'measure':<48} value")
    print(
        f"{'bytes per GPU-hour, sim full precision (MB)':<48} "
        f"{full_r['bytes_per_gpu_hour'] / 1e6:.1f}"
    )
    print(
        f"{'bytes per GPU-hour, NVML resolution (MB)':<48} {quant['bytes_per_gpu_hour'] / 1e6:.1f}"
    )
    print(f"{f'{ns.gpus} GPUs x {ns.hours:g} h file (MB)':<48} {full_r['bytes'] / 1e6:.1f}")
    print(f"{'CPU run / record over the same time (s)':<48} {base:.1f} / {rec:.1f}")
    print(f"{'recording overhead (% of one core)':<48} {result['record_overhead_cpu_percent']:.1f}")
    print_scaling(scaling)


if __name__ == "__main__":
    main()

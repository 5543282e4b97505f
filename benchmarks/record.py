"""Recording cost: bytes per GPU-hour at 1 kHz, recorder CPU, report time for 1 h x 8 GPUs.

1. Synthesizes a recording offline from the sim source at virtual time (the same writer and
   window code as `hfsampler record`, without waiting an hour) and measures its size; once with the
   sim's full-precision noise (a worst case: random float bits do not compress), once with values
   rounded to NVML's own resolution (1 mW, 1 %, 1 MHz, 1 MiB), which is what real GPUs give.
2. Runs `hfsampler record --duration` and `hfsampler run --duration` (no export) on the same sim
   GPUs and compares their CPU time: the difference is what recording costs.
3. Times `hfsampler report` (HTML and JSON) on the synthesized 1 h x 8 GPU recording.

    python benchmarks/record.py [--gpus 8] [--hours 1] [--cpu-seconds 15]

Prints a table and writes benchmarks/out/record.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "tests"))

from sim_recordings import synthesize  # noqa: E402  (the tests' offline sim recordings)


def cpu_of(args: list[str]) -> float:
    """User + system CPU seconds of a command and every process it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--cpu-seconds", type=int, default=15)
    ns = ap.parse_args()
    seconds = int(ns.hours * 3600)
    result: dict[str, object] = {"gpus": ns.gpus, "seconds": seconds}
    with tempfile.TemporaryDirectory() as tmp:
        quant = synthesize(Path(tmp, "q.hfs"), ns.gpus, min(seconds, 300), quantize=True)
        result["quantized_5min"] = quant
        full = Path(tmp, "run.hfs")
        result["sim_full_precision"] = synthesize(full, ns.gpus, seconds, quantize=False)
        hf = [sys.executable, "-m", "hfsampler"]
        for fmt, out in (("json", Path(tmp, "s.json")), ("html", Path(tmp, "r.html"))):
            began = time.perf_counter()
            subprocess.run([*hf, "report", str(full), "--format", fmt, "-o", str(out)], check=True,
                           stderr=subprocess.DEVNULL)  # fmt: skip
            result[f"report_{fmt}_s"] = time.perf_counter() - began
            result[f"report_{fmt}_bytes"] = out.stat().st_size
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
    print(f"{'report html (s)':<48} {result['report_html_s']:.1f}")
    print(f"{'report json (s)':<48} {result['report_json_s']:.1f}")
    print(f"{'CPU run / record over the same time (s)':<48} {base:.1f} / {rec:.1f}")
    print(f"{'recording overhead (% of one core)':<48} {result['record_overhead_cpu_percent']:.1f}")


if __name__ == "__main__":
    main()

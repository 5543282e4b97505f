"""Steady push, side by side with vmagent: the CPU and memory of the process that pushes.

One ``hfsampler run --source sim`` (8 GPUs, 1 s windows) pushes to a VictoriaMetrics; a vmagent
scrapes the same hfsampler's ``/metrics`` every second and pushes what it scrapes to another:
the same series at the same rate, one pushed from the windows, one from the page. The sides'
costs are taken in alternating phases of ``--phase`` seconds, ``--rounds`` times each:

- ``alone``: vmagent stopped. hfsampler's parent (the process that reduces the windows, encodes
  and pushes them) and its sampler process, with nothing scraping.
- ``scraped``: vmagent running (measured after ``SETTLE_S``, its start left out). vmagent's
  CPU (scrape, parse, relabel, encode, queue, push), and hfsampler's parent again: what it costs
  more there is serving vmagent's scrapes.

CPU is ``/proc/PID/stat``'s utime + stime over the phase, as a percentage of one core; memory
is ``VmRSS`` at the phase's end. Per measure: the median and the spread (lowest-highest) over
the rounds, and hfsampler's parent alone over vmagent (the issue's ask: at most 1). The
receivers' stored series and samples per second say both sides carry the same.

    python benchmarks/steady.py [--gpus 8] [--phase 30] [--rounds 3] [--vmagent PATH]

vmagent: ``--vmagent``, else ``HFSAMPLER_VMAGENT_BIN``, else Debian sid's fetched by
``.ci/fetch-vmagent``, else bookworm's ``/usr/bin/vmagent`` (said in the output). Prints a
table and writes ``benchmarks/out/steady.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

import receivers as rx  # noqa: E402  (the integration tests' receiver harness)
from drain import find_vmagent, rss_mib, terminate  # noqa: E402  (one way for every benchmark)
from sampler import cpu_seconds  # noqa: E402

SETTLE_S = 5.0  # a started vmagent's first scrapes and its queue's setup, left out


def sampler_of(pid: int) -> int:
    """The sampler process of the hfsampler ``pid``: its child spawned by multiprocessing (not
    multiprocessing's resource tracker, another child)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return int(child)
    raise SystemExit(f"hfsampler {pid} has no sampler process")


def vmagent_to_run(given: str | None) -> tuple[str | None, str]:
    """drain.py's vmagent (given, or sid's fetched); else bookworm's, which a steady push can
    use (it needs none of the newer flags the drain does)."""
    found, name = find_vmagent(given)
    if found is not None:
        return found, name
    old = shutil.which("vmagent")
    if old:
        return old, f"bookworm's vmagent ({old}; {name})"
    return None, name


class Vmagent:
    """vmagent scraping ``target`` every second, pushing to ``write_url``."""

    def __init__(self, binary: str, root: Path, target: str, write_url: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        config = root / "scrape.yml"
        config.write_text(
            "scrape_configs:\n"
            "  - job_name: hfsampler\n"
            "    scrape_interval: 1s\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.port = rx.free_port()
        self.log = open(root / "vmagent.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [binary, f"-httpListenAddr=127.0.0.1:{self.port}", f"-promscrape.config={config}",
             f"-remoteWrite.url={write_url}", f"-remoteWrite.tmpDataPath={root / 'queue'}",
             "-loggerLevel=ERROR"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        rx.wait_http(f"http://127.0.0.1:{self.port}/health")

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


def stored(receiver: rx.Receiver, window_s: int) -> dict[str, float]:
    """The DCGM series a receiver holds, and their samples per second over the last window."""
    receiver.flush()
    series = receiver.query('count({__name__=~"DCGM_.+"})')
    rate = receiver.query(f'sum(count_over_time({{__name__=~"DCGM_.+"}}[{window_s}s]))')
    n = float(series[0]["value"][1]) if series else 0.0
    per_s = float(rate[0]["value"][1]) / window_s if rate else 0.0
    return {"series": n, "samples_per_s": per_s}


def phase(pids: dict[str, int], seconds: float) -> dict[str, dict[str, float]]:
    before = {name: cpu_seconds(f"/proc/{pid}/stat") for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)
    took = time.monotonic() - started
    return {
        name: {
            "cpu_pct": 100 * (cpu_seconds(f"/proc/{pid}/stat") - before[name]) / took,
            "rss_mb": rss_mib(pid),
        }
        for name, pid in pids.items()
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--phase", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vmagent", help="vmagent binary")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "steady.json"))
    args = parser.parse_args()
    vmagent_bin, vmagent_name = vmagent_to_run(args.vmagent)
    if vmagent_bin is None:
        print(f"steady.py: skipped: {vmagent_name}")
        return 0
    print(f"peer: {vmagent_name}")
    root = rx.temp_root("hfsampler-steady-")
    total_s = int(args.rounds * 2 * (args.phase + SETTLE_S) + 60)
    mine = rx.start_victoria_metrics(root / "vm-hfsampler")
    theirs = rx.start_victoria_metrics(root / "vm-vmagent")
    listen = f"127.0.0.1:{rx.free_port()}"
    run = rx.spawn_cli(
        rx.sim_run_args([mine.write_url], listen=listen, gpus=args.gpus, window="1s",
                        duration=f"{total_s}s"),
        root / "hfsampler.log",
    )  # fmt: skip
    rounds: list[dict[str, Any]] = []
    try:
        rx.wait_http(f"http://{listen}/metrics", timeout_s=60)
        time.sleep(SETTLE_S)
        own = {"parent": run.pid, "sampler": sampler_of(run.pid)}
        for k in range(args.rounds):
            alone = phase(own, args.phase)
            agent = Vmagent(vmagent_bin, root / f"vmagent-{k}", listen, theirs.write_url)
            try:
                time.sleep(SETTLE_S)
                scraped = phase({**own, "vmagent": agent.proc.pid}, args.phase)
            finally:
                agent.stop()
            rounds.append({"alone": alone, "scraped": scraped})
            print(f"round {k + 1}: parent {alone['parent']['cpu_pct']:.2f}% alone, "
                  f"{scraped['parent']['cpu_pct']:.2f}% scraped; vmagent "
                  f"{scraped['vmagent']['cpu_pct']:.2f}%")  # fmt: skip
        window_s = int(args.phase)
        carried = {"hfsampler": stored(mine, window_s), "vmagent": stored(theirs, window_s)}
    finally:
        rx.stop_cli(run)
        mine.stop()
        theirs.stop()

    def of(kind: str, name: str, key: str) -> dict[str, float]:
        return spread([r[kind][name][key] for r in rounds])

    table = {
        "hfsampler parent, alone (reduce, encode, push)": of("alone", "parent", "cpu_pct"),
        "hfsampler parent, scraped by vmagent": of("scraped", "parent", "cpu_pct"),
        "hfsampler sampler process": of("alone", "sampler", "cpu_pct"),
        "vmagent (scrape, parse, push)": of("scraped", "vmagent", "cpu_pct"),
    }
    memory = {
        "hfsampler parent": of("scraped", "parent", "rss_mb"),
        "hfsampler sampler": of("scraped", "sampler", "rss_mb"),
        "vmagent": of("scraped", "vmagent", "rss_mb"),
    }
    ratios = [r["alone"]["parent"]["cpu_pct"] / r["scraped"]["vmagent"]["cpu_pct"] for r in rounds]
    print(f"\nsteady push, {args.gpus} sim GPUs, 1 s windows; {args.rounds} rounds of "
          f"{args.phase:g} s phases, alternating (median, lowest-highest)")  # fmt: skip
    print(f"{'CPU, % of a core':<48} {'median':>7}  spread")
    for name, s in table.items():
        print(f"{name:<48} {s['median']:>7.2f}  {s['low']:.2f}-{s['high']:.2f}")
    r = spread(ratios)
    print(f"{'hfsampler parent alone / vmagent':<48} {r['median']:>6.2f}x  "
          f"{r['low']:.2f}-{r['high']:.2f}")  # fmt: skip
    print(f"\n{'RSS, MB':<48} {'median':>7}  spread")
    for name, s in memory.items():
        print(f"{name:<48} {s['median']:>7.1f}  {s['low']:.1f}-{s['high']:.1f}")
    print("\nstored (the last phase): " + "; ".join(
        f"{side} {c['series']:.0f} series, {c['samples_per_s']:.0f} samples/s"
        for side, c in carried.items()))  # fmt: skip
    result = {
        "benchmark": "steady",
        "peer": vmagent_name,
        "gpus": args.gpus,
        "phase_s": args.phase,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_average": list(os.getloadavg())},
        "cpu_pct": table,
        "parent_alone_over_vmagent": r,
        "rss_mb": memory,
        "stored": carried,
        "rounds": rounds,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

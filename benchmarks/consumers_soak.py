"""Soak: `run --source sim --consumers on` for minutes while consumers start and leave every few
seconds: the consumer series stay bounded, every consumer that left ends with a stale marker, and
the parent's memory stays flat.

One ``hfsampler run`` (the sim's made-up consumers: ``per_gpu`` processes per GPU, each living 4
to 7 s, a second's gap between them, a new job, pod, unit or command each time; its procfs tree
in a temporary directory) pushes to the tests' conformance receiver and serves /metrics. Its
queue spools to disk (``--queue-dir``): on this shared machine the receiver, in this script's
process, falls behind at times, and a memory queue would drop the oldest samples (stale markers
among them) where a spool keeps every one, so the accounting below is of what hfsampler sent. Every
``--every`` seconds: the parent's and the sampler's ``VmRSS`` and the consumer series on the
page. At the end, from what the receiver stored: every consumer series, how many ended with a
stale marker before shutdown (the consumer left), how many at shutdown, and any that did not;
the receiver's violations; the RSS's growth from the first sample after ``--warmup`` to the last,
and a least-squares slope in MiB per minute over the same span.

    python benchmarks/consumers_soak.py [--minutes 10] [--gpus 4] [--every 10] [--out FILE]
    python benchmarks/consumers_soak.py --consumers off --out PEER   (alongside: the peer)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from conformance import STALE_NAN_BITS, ConformanceReceiver  # noqa: E402

CONSUMER_PREFIX = "hfsampler_consumer_"


def rss_mib(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return math.nan
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int(d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def consumer_lines(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            page = resp.read().decode()
    except OSError:
        return -1
    return len(re.findall(rf"^{CONSUMER_PREFIX}\w+{{", page, re.M))


def is_stale(value: float) -> bool:
    return struct.unpack("<Q", struct.pack("<d", value))[0] == STALE_NAN_BITS


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return math.nan
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    return sum((t - mx) * (v - my) for t, v in points) / den * 60 if den else math.nan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--every", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument(
        "--consumers",
        choices=("on", "off"),
        default="on",
        help="off: the peer, the same run without consumers (run it alongside)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "consumers_soak.json"))
    args = ap.parse_args()
    duration_s = int(args.minutes * 60)
    port = free_port()
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, ConformanceReceiver() as rx:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--gpus",
               str(args.gpus), "--consumers", args.consumers, "--procfs", f"{tmp}/proc",
               "--duration", f"{duration_s}s", "--listen", f"127.0.0.1:{port}",
               "--remote-write", rx.url, "--queue-dir", f"{tmp}/queue",
               "--log-level", "warning"]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        sampler = None
        try:
            while proc.poll() is None:
                time.sleep(args.every)
                t = time.monotonic() - started
                if proc.poll() is not None:
                    break
                if sampler is None or math.isnan(rss_mib(sampler)):
                    # the sampler is the child that lives (a spawn's helper comes and goes)
                    kids = [k for k in children(proc.pid) if rss_mib(k) > 20]
                    sampler = kids[0] if kids else None
                row = {"t_s": round(t, 1), "parent_rss_mib": rss_mib(proc.pid),
                       "sampler_rss_mib": rss_mib(sampler) if sampler else math.nan,
                       "consumer_series_on_page": consumer_lines(port)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        ended_at_ms = int(time.time() * 1000)
        energy = rx.series_named("hfsampler_consumer_energy_joules_total")
        left, at_shutdown, open_ = 0, 0, 0
        unended: list[dict[str, Any]] = []
        last_ts = max((s[-1][0] for s in energy.values() if s), default=0)
        for labels, samples in energy.items():
            ts, value = samples[-1]
            if not is_stale(value):
                open_ += 1
                unended.append({"labels": dict(labels), "last": samples[-3:]})
            elif ts < last_ts:
                left += 1
            else:
                at_shutdown += 1
        consumers = {tuple(kv for kv in labels if kv[0] not in ("__name__",)) for labels in energy}
        report = rx.report()
    warm = [(r["t_s"], r["parent_rss_mib"]) for r in rows if r["t_s"] >= args.warmup]
    result: dict[str, Any] = {
        "command": " ".join(cmd),
        "exit": proc.returncode,
        "stderr_tail": err.decode(errors="replace")[-2000:],
        "minutes": args.minutes,
        "consumers": args.consumers,
        "gpus": args.gpus,
        "machine": platform.platform(),
        "ended_at_ms": ended_at_ms,
        "consumers_seen": len(consumers),
        "ended_when_they_left": left,
        "ended_at_shutdown": at_shutdown,
        "never_ended": open_,
        "never_ended_examples": unended[:5],
        "consumer_series_on_page_max": max((r["consumer_series_on_page"] for r in rows), default=0),
        "consumer_series_on_page_min": min((r["consumer_series_on_page"] for r in rows), default=0),
        "parent_rss_mib_first_after_warmup": warm[0][1] if warm else math.nan,
        "parent_rss_mib_last": warm[-1][1] if warm else math.nan,
        "parent_rss_slope_mib_per_min": slope_mib_per_min(warm),
        "violations": len(report.get("violations", [])),
        "samples": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'consumers seen':32} {result['consumers_seen']}")
    print(f"{'ended when they left':32} {left}")
    print(f"{'ended at shutdown':32} {at_shutdown}")
    print(f"{'never ended (must be 0)':32} {open_}")
    print(f"{'consumer series on /metrics':32} {result['consumer_series_on_page_min']} to "
          f"{result['consumer_series_on_page_max']}")  # fmt: skip
    print(f"{'parent RSS after warm-up, MiB':32} {result['parent_rss_mib_first_after_warmup']:.1f} "
          f"-> {result['parent_rss_mib_last']:.1f} "
          f"(slope {result['parent_rss_slope_mib_per_min']:+.3f} MiB/min)")  # fmt: skip
    print(f"{'receiver violations':32} {result['violations']}")
    return 0 if proc.returncode == 0 and open_ == 0 and not result["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())

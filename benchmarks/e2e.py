"""End-to-end latency: from a window's end to its value being queryable in Prometheus.

Starts a real Prometheus (the integration tests' harness, ``tests/integration/receivers.py``)
that both receives hfsampler's Remote-Write push and scrapes hfsampler's /metrics every second,
runs ``hfsampler run --source sim`` for ``--minutes``, and polls Prometheus every ``--poll-ms``
for the raw samples of one series on both paths. For each window (timestamped at its end, T):

- push latency: when the pushed sample stamped T was first seen by a query, minus T;
- pull latency (the peer: a 1 s scrape, as a dcgm-exporter-style setup would run): when a scraped
  sample carrying that window's value was first seen, minus T. A window that no scrape caught
  (two windows closed between scrapes) is counted as missed by the pull path.

Prometheus scrapes a target at a fixed offset within its interval, taken from a hash of the
target's labels: with one target, the pull path's latency is wherever that offset fell relative
to hfsampler's window ends (4.6-37x the push path's, between runs). So the same /metrics is
scraped by ``--scrape-targets`` jobs (``hfsampler-pull-0``, ``-1``, ...: a different hash, a
different offset each), and the pull path is reported per job, pooled over all of them, and as
the median and spread (lowest-highest) of the jobs' p50: what a scrape gets at a random offset.

Latencies are upper bounds with the poll interval as resolution. Prints a table, writes JSON.

    python benchmarks/e2e.py [--minutes 2] [--scrape-targets 6] [--out benchmarks/out/e2e.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import receivers as rx  # the integration tests' receiver harness

from hfsampler.fields import POWER_INSTANT
from hfsampler.sampling.window import MAX

METRIC = POWER_INSTANT.name + MAX.suffix  # the series a scrape misses most: the spikes
PULL_JOB = "hfsampler-pull"  # a prefix: one job per scrape offset, hfsampler-pull-K


@dataclass
class Seen:
    """First time (wall clock, s) each sample was visible, per path, keyed by sample timestamp."""

    push: dict[int, tuple[float, float]] = field(default_factory=dict)  # ts_ms -> (value, seen)
    pull: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # per job
    polls: int = 0
    poll_s: list[float] = field(default_factory=list)  # each poll's round trip


def poll(prom: rx.Prometheus, seen: Seen, lookback_s: int) -> None:
    sent = time.time()
    result = prom.query(f'{METRIC}{{gpu="0"}}[{lookback_s}s]', time_s=sent + 0.5)
    seen.poll_s.append(time.time() - sent)
    seen.polls += 1
    for item in result:
        job = item["metric"].get("job", "")
        path = seen.pull.setdefault(job, {}) if job.startswith(PULL_JOB) else seen.push
        for ts, value in item["values"]:
            ts_ms = round(float(ts) * 1000)
            if ts_ms not in path:
                path[ts_ms] = (float(value), sent)


def stats_ms(latencies_s: list[float], count_key: str = "windows") -> dict[str, float | int]:
    if not latencies_s:
        return {count_key: 0}
    arr = np.asarray(latencies_s) * 1000
    return {
        count_key: int(arr.size),
        "p50_ms": float(np.percentile(arr, 50)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_ms": float(arr.mean()),
        "min_ms": float(arr.min()),
        "max_ms": float(arr.max()),
    }


def latencies(
    seen: Seen, pulled: dict[int, tuple[float, float]], skip_first: int = 2
) -> tuple[list[float], list[float], int]:
    """Push latencies per window, and one pull job's (``pulled``: its samples), and how many
    windows that job missed."""
    push_windows = sorted(seen.push.items())[skip_first:]
    pull_samples = sorted(pulled.items())
    push_lat: list[float] = []
    pull_lat: list[float] = []
    missed = 0
    last_pull_ts = pull_samples[-1][0] if pull_samples else 0
    for ts_ms, (value, seen_at) in push_windows:
        push_lat.append(seen_at - ts_ms / 1000)
        if ts_ms > last_pull_ts:
            continue  # the run ended before a scrape could have caught it
        # The first scrape after the window's end that exposes the window's value.
        match = next(
            (
                p_seen
                for p_ts, (p_value, p_seen) in pull_samples
                if p_ts >= ts_ms and math.isclose(p_value, value, rel_tol=1e-9, abs_tol=1e-9)
            ),
            None,
        )
        if match is None:
            missed += 1
        else:
            pull_lat.append(match - ts_ms / 1000)
    return push_lat, pull_lat, missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long to run (default 2)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--window", default="1s", help="hfsampler's window (default 1s)")
    parser.add_argument("--poll-ms", type=float, default=20.0, help="query interval (default 20)")
    parser.add_argument(
        "--batch-send-deadline",
        metavar="DUR",
        help="the push queue's batch_send_deadline (default: hfsampler's, 0: each window at once)",
    )
    parser.add_argument(
        "--scrape-targets",
        type=int,
        default=6,
        help="scrape jobs on the same /metrics, each at its own offset (default 6)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/e2e.json"))
    args = parser.parse_args(argv)

    if rx.binary_path(rx.PROMETHEUS_BIN) is None:
        print("prometheus not found: apt-get install prometheus", file=sys.stderr)
        return 2

    root = rx.temp_root("hfsampler-bench-")
    listen_port = rx.free_port()
    scrapes = [
        {
            "job_name": f"{PULL_JOB}-{k}",
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "static_configs": [{"targets": [f"127.0.0.1:{listen_port}"]}],
        }
        for k in range(args.scrape_targets)
    ]
    duration_s = int(args.minutes * 60)
    prom = rx.start_prometheus(root / "prometheus", scrape_configs=scrapes)
    cli_log = root / "hfsampler.log"
    write_urls = [prom.write_url]
    extra: list[str] = []
    if args.batch_send_deadline:
        # The queue settings live in the config file, as in Prometheus's remote_write block.
        config = root / "hfsampler.yml"
        endpoint = {
            "url": prom.write_url,
            "queue_config": {"batch_send_deadline": args.batch_send_deadline},
        }
        config.write_text(json.dumps({"remote_write": [endpoint]}))  # JSON is YAML
        write_urls, extra = [], ["--config", str(config)]
    cli_args = rx.sim_run_args(
        write_urls,
        listen=f"127.0.0.1:{listen_port}",
        gpus=args.gpus,
        window=args.window,
        duration=f"{duration_s + 5}s",
        labels={"bench": "e2e"},
        extra=extra,
    )
    seen = Seen()
    cli: subprocess.Popen[bytes] | None = None
    code: int | None = None
    try:
        cli = rx.spawn_cli(cli_args, cli_log)
        started = time.time()
        end = started + duration_s
        print(f"running hfsampler for {duration_s} s, polling Prometheus every {args.poll_ms} ms")
        next_poll = time.monotonic()
        while time.time() < end:
            if cli.poll() is not None:
                break
            poll(prom, seen, lookback_s=30)
            next_poll += args.poll_ms / 1000
            time.sleep(max(0.0, next_poll - time.monotonic()))
    finally:
        if cli is not None:
            code = rx.stop_cli(cli)
        problems = prom.log_problems()
        prom.stop()
        cli_text = cli_log.read_text(errors="replace") if cli_log.exists() else ""
        shutil.rmtree(root, ignore_errors=True)

    if not seen.push:
        print(f"no pushed window was ever visible; hfsampler exited {code}:\n{cli_text[-3000:]}")
        return 1

    jobs = sorted(seen.pull, key=lambda j: int(j.rsplit("-", 1)[1]))
    per_job: dict[str, dict[str, float | int]] = {}
    pooled: list[float] = []
    push_lat: list[float] = []
    for job in jobs:
        push_lat, pull_lat, missed = latencies(seen, seen.pull[job])
        per_job[job] = {**stats_ms(pull_lat), "missed_windows": missed}
        pooled += pull_lat
    if not jobs:
        push_lat = latencies(seen, {})[0]
    push = stats_ms(push_lat)
    pull = stats_ms(pooled)
    pull["missed_windows"] = sum(int(r["missed_windows"]) for r in per_job.values())
    p50s = [float(r["p50_ms"]) for r in per_job.values() if "p50_ms" in r]
    over_targets = (
        {"targets": len(p50s), "p50_ms_median": float(np.median(p50s)),
         "p50_ms_min": min(p50s), "p50_ms_max": max(p50s)}
        if p50s else {"targets": 0}
    )  # fmt: skip
    ratio: dict[str, float] = {
        key: pull[key] / push[key]
        for key in ("p50_ms", "p99_ms")
        if key in pull and key in push and push[key] > 0
    }
    if p50s and push.get("p50_ms"):
        ratio["p50_median_over_targets"] = float(np.median(p50s)) / push["p50_ms"]
        ratio["p50_min_over_targets"] = min(p50s) / push["p50_ms"]
        ratio["p50_max_over_targets"] = max(p50s) / push["p50_ms"]
    poll_rt = stats_ms(seen.poll_s, count_key="polls")

    print()
    print(f"{'path':<34}{'windows':>8}{'missed':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    push_name = f"push (deadline {args.batch_send_deadline or 'default'})"
    rows = [(push_name, push)]
    rows += [(f"pull, 1 s scrape, {job}", per_job[job]) for job in jobs]
    rows.append((f"pull, {len(jobs)} scrape offsets pooled", pull))
    for name, row in rows:
        print(
            f"{name:<34}{row.get('windows', 0):>8}{row.get('missed_windows', 0):>8}"
            f"{row.get('p50_ms', float('nan')):>10.1f}{row.get('p99_ms', float('nan')):>10.1f}"
            f"{row.get('max_ms', float('nan')):>10.1f}"
        )
    if p50s:
        print(
            f"pull p50 over {len(p50s)} scrape offsets: median {np.median(p50s):.1f} ms "
            f"({min(p50s):.1f}-{max(p50s):.1f}); over push p50: "
            f"{ratio.get('p50_median_over_targets', float('nan')):.1f}x "
            f"({ratio.get('p50_min_over_targets', float('nan')):.1f}-"
            f"{ratio.get('p50_max_over_targets', float('nan')):.1f}x)"
        )
    for key in ("p50_ms", "p99_ms"):
        if key in ratio:
            print(f"pull (pooled) / push {key[:3]}: {ratio[key]:.1f}x")
    print(f"resolution: poll every {args.poll_ms} ms, query p50 {poll_rt.get('p50_ms', 0):.1f} ms")
    if problems:
        print(f"warning: Prometheus logged {len(problems)} problem lines, e.g. {problems[0]}")

    report: dict[str, Any] = {
        "benchmark": "e2e_window_to_queryable",
        "params": {
            "minutes": args.minutes,
            "gpus": args.gpus,
            "window": args.window,
            "poll_ms": args.poll_ms,
            "batch_send_deadline": args.batch_send_deadline or "default",
            "scrape_targets": args.scrape_targets,
            "metric": METRIC,
        },
        "env": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "prometheus": subprocess.run(
                [prom.binary, "--version"], capture_output=True, text=True, check=False
            ).stdout.splitlines()[:1],
        },
        "push": push,
        "pull": pull,
        "pull_per_target": per_job,
        "pull_p50_over_targets": over_targets,
        "pull_over_push": ratio,
        "poll_round_trip": poll_rt,
        "hfsampler_exit": code,
        "prometheus_log_problems": problems[:20],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

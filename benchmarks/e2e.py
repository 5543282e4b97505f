"""End-to-end latency: from a window's end to its value being queryable in Prometheus.

Starts a real Prometheus (the integration tests' harness, ``tests/integration/receivers.py``)
that both receives hfsampler's Remote-Write push and scrapes hfsampler's /metrics every second,
runs ``hfsampler run --source sim`` for ``--minutes``, and polls Prometheus every ``--poll-ms``
for the raw samples of one series on both paths. For each window (timestamped at its end, T):

- push latency: when the pushed sample stamped T was first seen by a query, minus T;
- pull latency (the peer: a 1 s scrape, as a dcgm-exporter-style setup would run): when a scraped
  sample carrying that window's value was first seen, minus T. A window that no scrape caught
  (two windows closed between scrapes) is counted as missed by the pull path.

Latencies are upper bounds with the poll interval as resolution. Prints a table, writes JSON.

    python benchmarks/e2e.py [--minutes 2] [--out benchmarks/out/e2e.json]
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
PULL_JOB = "hfsampler-pull"


@dataclass
class Seen:
    """First time (wall clock, s) each sample was visible, per path, keyed by sample timestamp."""

    push: dict[int, tuple[float, float]] = field(default_factory=dict)  # ts_ms -> (value, seen)
    pull: dict[int, tuple[float, float]] = field(default_factory=dict)
    polls: int = 0
    poll_s: list[float] = field(default_factory=list)  # each poll's round trip


def poll(prom: rx.Prometheus, seen: Seen, lookback_s: int) -> None:
    sent = time.time()
    result = prom.query(f'{METRIC}{{gpu="0"}}[{lookback_s}s]', time_s=sent + 0.5)
    seen.poll_s.append(time.time() - sent)
    seen.polls += 1
    for item in result:
        path = seen.pull if item["metric"].get("job") == PULL_JOB else seen.push
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


def latencies(seen: Seen, skip_first: int = 2) -> tuple[list[float], list[float], int]:
    """Push and pull latencies per window, and how many windows the pull path missed."""
    push_windows = sorted(seen.push.items())[skip_first:]
    pull_samples = sorted(seen.pull.items())
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
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/e2e.json"))
    args = parser.parse_args(argv)

    if rx.binary_path(rx.PROMETHEUS_BIN) is None:
        print("prometheus not found: apt-get install prometheus", file=sys.stderr)
        return 2

    root = rx.temp_root("hfsampler-bench-")
    listen_port = rx.free_port()
    scrape = {
        "job_name": PULL_JOB,
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "static_configs": [{"targets": [f"127.0.0.1:{listen_port}"]}],
    }
    duration_s = int(args.minutes * 60)
    prom = rx.start_prometheus(root / "prometheus", scrape_configs=[scrape])
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

    push_lat, pull_lat, missed = latencies(seen)
    push = stats_ms(push_lat)
    pull = stats_ms(pull_lat)
    pull["missed_windows"] = missed
    ratio = {
        key: pull[key] / push[key]
        for key in ("p50_ms", "p99_ms")
        if key in pull and key in push and push[key] > 0
    }
    poll_rt = stats_ms(seen.poll_s, count_key="polls")

    print()
    print(f"{'path':<28}{'windows':>8}{'missed':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    push_name = f"push (deadline {args.batch_send_deadline or 'default'})"
    for name, row in ((push_name, push), ("pull (1 s scrape of /metrics)", pull)):
        print(
            f"{name:<28}{row.get('windows', 0):>8}{row.get('missed_windows', 0):>8}"
            f"{row.get('p50_ms', float('nan')):>10.1f}{row.get('p99_ms', float('nan')):>10.1f}"
            f"{row.get('max_ms', float('nan')):>10.1f}"
        )
    for key, value in ratio.items():
        print(f"pull/push {key[:3]}: {value:.1f}x")
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

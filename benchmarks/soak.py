"""Soak: an edge node's delivery path through minutes of faults, every sample accounted for.

One `hfsampler run --source sim` spools into a small queue directory (a 2 MiB tmpfs when this
runs as root, else a plain directory) and pushes to a loopback receiver whose behaviour flips on
a fixed schedule: up, down (port closed), 503, 429 with odd ``Retry-After`` values (0, -5, 1e20,
999999, an HTTP-date, garbage), 413 above a few KiB, slow answers, connections reset without an
answer. On the same schedule the run gets SIGHUP reloads and ``kill -9`` restarts. The receiver
decodes every request; at the end the windows of one series per GPU are checked: each window the
service produced (while it ran) was delivered once, delivered again after a ``kill -9`` (the spool
is at-least-once), or missing, and the drops hfsampler counted by reason (scraped from /metrics
before each stop) are set beside the missing ones. Bounded in time; loopback only.

Then a full recording disk: `hfsampler record` on a 160 KiB tmpfs around a job that runs on
well past the disk's end (root only): the job's and record's exit statuses, tracebacks in the
output (must be 0), and what the recording says it lost, checked against the file (every sample
in it counted by the end chunk, none twice, the unrecorded time said with its reason).

    python benchmarks/soak.py --minutes 3 [--out benchmarks/out/soak.json] [--full-disk-only]

``--storm`` runs the SIGHUP storm instead: 50 SIGHUPs 50 ms apart alternating two files (an
external label, the endpoints' ``remote_timeout``, and an endpoint that comes and goes) against
Prometheus 2 and 3 and the strict conformance receiver, once with memory queues and once with a
``queue_dir``; per endpoint, every window of one series per GPU is delivered once, or missing,
and what hfsampler counted as dropped (by reason), what each receiver refused, and tracebacks
are set beside it.

    python benchmarks/soak.py --storm [--out benchmarks/out/soak_storm.json]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import snappy
from aiohttp import web

from hfsampler.remote_write.prompb import remote_pb2

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests" / "support")]
import receivers as rx  # noqa: E402 (the integration tests' harness: Prometheus on loopback)
from conformance import ConformanceReceiver  # noqa: E402 (the strict receiver)

SERIES = "DCGM_FI_DEV_POWER_USAGE_max"
GPUS = 8
ODD_RETRY_AFTER = ["0", "-5", "1e20", "999999", "Wed, 21 Oct 2015 07:28:00 GMT", "soon", "2"]
# (mode, seconds) repeated until the time is up; "kill" and "hup" act on hfsampler at once
SCHEDULE = [
    ("up", 10), ("down", 12), ("up", 8), ("503", 6), ("hup", 0), ("429", 8), ("up", 6),
    ("413", 8), ("slow", 8), ("kill", 0), ("reset", 6), ("up", 8), ("down", 20), ("hup", 0),
    ("up", 10),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class FlakyReceiver:
    """A Remote-Write 1.0 receiver on loopback whose answers follow ``mode``."""

    port: int
    mode: str = "up"
    max_body: int = 6 << 10
    stored: Counter[tuple[str, int]] = field(default_factory=Counter)  # (gpu, ts) of SERIES
    per_ts: Counter[int] = field(default_factory=Counter)  # samples of every series, per window
    answers: Counter[str] = field(default_factory=Counter)
    _runner: web.AppRunner | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = snappy.uncompress(await request.read())
        mode = self.mode
        self.answers[mode] += 1
        if mode == "503":
            return web.Response(status=503, text="overloaded")
        if mode == "429":
            retry_after = random.choice(ODD_RETRY_AFTER)
            return web.Response(status=429, headers={"Retry-After": retry_after})
        if mode == "413" and len(body) > self.max_body:
            return web.Response(status=413, text="too large")
        if mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)  # never reaches the sender
        if mode == "slow":
            await asyncio.sleep(2.0)
        req = remote_pb2.WriteRequest.FromString(body)
        for ts in req.timeseries:
            labels = {lb.name: lb.value for lb in ts.labels}
            for s in ts.samples:
                if s.value == s.value:
                    self.per_ts[s.timestamp] += 1
            if labels.get("__name__") == SERIES:
                for s in ts.samples:
                    if s.value == s.value:  # stale markers are not windows
                        self.stored[(labels["gpu"], s.timestamp)] += 1
        return web.Response(status=204)

    def serve(self) -> None:
        """Run the receiver's loop on this thread until ``stop_serving``."""
        self._loop = asyncio.new_event_loop()
        self._loop.run_forever()

    def call(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def open(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/api/v1/write", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@dataclass
class Run:
    """One hfsampler process: when it ran and what it said it dropped."""

    proc: subprocess.Popen[bytes]
    started: float
    ended: float = 0.0
    dropped: dict[str, float] = field(default_factory=dict)


def scrape_drops(port: int) -> dict[str, float]:
    """hfsampler_remote_write_samples_dropped_total by reason, from /metrics."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as resp:
            text = resp.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("hfsampler_remote_write_samples_dropped_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def write_config(path: Path, queue: Path, port: int, remote_timeout: str) -> None:
    # a disk bound the outages fill: 256 KiB holds about 20 s of GPUS sim GPUs' windows
    path.write_text(json.dumps({
        "queue_dir": str(queue),
        "remote_write": [{
            "url": f"http://127.0.0.1:{port}/api/v1/write", "name": "edge",
            "remote_timeout": remote_timeout,
            "queue_config": {"max_disk_bytes": "256KiB", "max_backoff": "2s",
                             "max_retry_after": "5s"},
        }],
    }))  # fmt: skip


def start(config: Path, listen: int, log: Path) -> Run:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--gpus", str(GPUS),
            "--config", str(config), "--listen", f"127.0.0.1:{listen}"]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=out, start_new_session=True)
    return Run(proc, time.time())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--full-disk-only", action="store_true",
                        help="only the full recording disk")  # fmt: skip
    parser.add_argument("--storm", action="store_true", help="the SIGHUP storm instead")
    args = parser.parse_args(argv)
    if args.storm:
        return storm(Path(args.out or "benchmarks/out/soak_storm.json"))
    args.out = args.out or "benchmarks/out/soak.json"
    if args.full_disk_only:
        disk = full_recording_disk()
        print_disk(disk)
        return write_report({"full_recording_disk": disk}, args.out, disk["ok"])
    work = Path(tempfile.mkdtemp(prefix="hfsampler-soak-"))
    queue = work / "queue"
    queue.mkdir()
    tmpfs = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(queue)], capture_output=True
        ).returncode
        == 0
    )
    receiver = FlakyReceiver(free_port())
    threading.Thread(target=receiver.serve, daemon=True).start()
    while receiver._loop is None:
        time.sleep(0.01)
    receiver.call(receiver.open())
    config = work / "hfsampler.yml"
    write_config(config, queue, receiver.port, "3s")
    reloads = 0
    listen = free_port()
    log = work / "hfsampler.log"
    runs = [start(config, listen, log)]
    end = time.monotonic() + args.minutes * 60
    timeline: list[tuple[float, str]] = []
    step = 0
    try:
        while time.monotonic() < end:
            mode, seconds = SCHEDULE[step % len(SCHEDULE)]
            step += 1
            timeline.append((time.time(), mode))
            if mode == "kill":
                runs[-1].dropped = scrape_drops(listen)
                runs[-1].proc.send_signal(signal.SIGKILL)
                runs[-1].proc.wait()
                runs[-1].ended = time.time()
                runs.append(start(config, listen, log))
                continue
            if mode == "hup":
                # a real change: the endpoint is replaced (its spool handed to the new writer)
                reloads += 1
                write_config(config, queue, receiver.port, f"{3 + reloads % 2}s")
                runs[-1].proc.send_signal(signal.SIGHUP)
                continue
            was_down = receiver.mode == "down"
            if mode == "down" and not was_down:
                receiver.call(receiver.close())
            elif mode != "down" and was_down:
                receiver.call(receiver.open())
            receiver.mode = mode
            time.sleep(min(seconds, max(0.0, end - time.monotonic())))
        if receiver.mode == "down":
            receiver.call(receiver.open())
        receiver.mode = "up"
        time.sleep(15)  # let the spool drain
        runs[-1].dropped = scrape_drops(listen)
        runs[-1].proc.send_signal(signal.SIGINT)
        runs[-1].proc.wait(60)
        runs[-1].ended = time.time()
        time.sleep(1)
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
        receiver.call(receiver.close())
        if tmpfs:
            subprocess.run(["umount", str(queue)], check=False)
    report = account(receiver, runs, timeline, tmpfs, log)
    print_report(report)
    report["full_recording_disk"] = disk = full_recording_disk()
    print_disk(disk)
    ok = report["missing_uncounted"] <= max(1.0, 0.01 * report["missing"]) and disk["ok"]
    return write_report(report, args.out, ok)


def write_report(report: dict[str, Any], path: str, ok: bool) -> int:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0 if ok else 1


# -- a full recording disk -----------------------------------------------------------------------


def full_recording_disk() -> dict[str, Any]:
    """`record` on a 160 KiB tmpfs around jobs that outlive it: one that succeeds (record must
    exit 74), one that fails with 3 (record must exit 3)."""
    from hfsampler.profiling.record import EXIT_INCOMPLETE

    if os.geteuid() != 0:
        return {"skipped": "needs root to mount a small tmpfs", "ok": True}
    cases = []
    for job_status, want in ((0, EXIT_INCOMPLETE), (3, 3)):
        cases.append({**_record_on_full_disk(job_status), "want_record_exit": want})
    ok = all(c["record_exit"] == c["want_record_exit"] and c["tracebacks"] == 0
             and c["job_finished"] and c["samples_uncounted"] == 0
             and c["samples_duplicated"] == 0 and c["stopped_reason"] for c in cases)  # fmt: skip
    return {"cases": cases, "ok": ok}


def _record_on_full_disk(job_status: int) -> dict[str, Any]:
    import numpy as np

    from hfsampler.profiling.recording import Recording

    disk = Path(tempfile.mkdtemp(prefix="hfsampler-soak-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "run.hfs"
        job = ("import time; time.sleep(20); print('job finished', flush=True); "
               f"raise SystemExit({job_status})")  # fmt: skip
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--gpus", "0,1,2,3",
             "--quiet", "-o", str(out), "--", sys.executable, "-c", job],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
            timeout=180,
        )  # fmt: skip
        took_s = time.monotonic() - started
        rec = Recording(out)
        end = rec.end or {}
        in_file, duplicated = 0, 0
        for chunk in rec.raw_chunks():
            in_file += len(chunk.ts_us)
        for g, plan in enumerate(rec.groups):  # each cell's driver timestamps strictly rise
            for d in range(len(rec.devices)):
                for f in range(len(plan.fields)):
                    ts = [c.cell(d, f)[0] for c in rec.raw_chunks(g)]
                    joined = np.concatenate(ts) if ts else np.empty(0, np.int64)
                    duplicated += int(np.sum(np.diff(joined) <= 0))
        stop_ns = end.get("end_ns")
        job_end_ns = end.get("job_end_ns", stop_ns)
        stopped_after_s = (
            None if stop_ns is None else round((stop_ns - rec.header["start_ns"]) / 1e9, 1)
        )
        return {
            "job_exit": job_status,
            "record_exit": done.returncode,
            "job_finished": "job finished" in done.stdout,
            "took_s": round(took_s, 1),
            "tracebacks": done.stderr.count("Traceback"),
            "stopped_reason": rec.stopped_early,
            "stopped_after_s": stopped_after_s,
            "not_recorded_s": None if stop_ns is None else round((job_end_ns - stop_ns) / 1e9, 1),
            "samples_in_file": in_file,
            "samples_end_chunk_says": end.get("samples"),
            "samples_uncounted": abs(in_file - int(end.get("samples", -1))),
            "samples_duplicated": duplicated,
            "damaged_parts": rec.damaged_parts,
            "stderr_lines": done.stderr.count("\n"),
        }
    finally:
        subprocess.run(["umount", str(disk)], check=False)
        with contextlib.suppress(OSError):
            disk.rmdir()


def print_disk(r: dict[str, Any]) -> None:
    if "skipped" in r:
        print(f"full recording disk: skipped ({r['skipped']})")
        return
    for c in r["cases"]:
        print(f"full recording disk, job exits {c['job_exit']}: record exits {c['record_exit']} "
              f"(want {c['want_record_exit']}), job finished {c['job_finished']}, "
              f"tracebacks {c['tracebacks']}, stopped after {c['stopped_after_s']} s "
              f"({c['stopped_reason']}), not recorded {c['not_recorded_s']} s, samples "
              f"{c['samples_in_file']} in file / {c['samples_end_chunk_says']} counted, "
              f"{c['samples_duplicated']} duplicated")  # fmt: skip


def account(
    receiver: FlakyReceiver,
    runs: list[Run],
    timeline: list[tuple[float, str]],
    tmpfs: bool,
    log: Path,
) -> dict[str, Any]:
    """Each produced window of SERIES per GPU: delivered once, again, or missing; and whether
    what hfsampler counted as dropped covers what is missing."""
    produced: set[tuple[str, int]] = set()
    for i, run in enumerate(runs):
        # whole 1 s windows that ended while the process ran, after its first; before a kill -9
        # the last second's records may not be on disk yet (the spool's documented loss)
        first = int(run.started) + 2
        last = int(run.ended) - (2 if i < len(runs) - 1 else 1)
        for t in range(first, last + 1):
            for g in range(GPUS):
                produced.add((str(g), t * 1000))
    stored = receiver.stored
    once = sum(1 for k in produced if stored.get(k) == 1)
    again = sum(1 for k in produced if stored.get(k, 0) > 1)
    missing = sorted(k for k in produced if k not in stored)
    dropped: Counter[str] = Counter()
    for run in runs:
        dropped.update(run.dropped)
    # What the missing GPU-windows held, sample for sample: a window's size is that of the
    # nearest window delivered before it (self-metric series are added as new statuses appear,
    # so windows grow over a run and one size for all would undercount the early ones).
    sizes = sorted(receiver.per_ts.items())
    stamps = [t for t, _ in sizes]
    held = 0.0
    for _, t in missing:
        i = max(0, bisect.bisect_right(stamps, t) - 1)
        held += sizes[i][1] / GPUS if sizes else 0.0
    per_gpu_window = held / len(missing) if missing else 0.0
    counted = sum(dropped.values())
    counted_windows = counted / per_gpu_window if per_gpu_window else 0.0
    explained = min(len(missing), counted_windows)
    text = log.read_text(errors="replace")
    return {
        "minutes": round((runs[-1].ended - runs[0].started) / 60, 2),
        "queue_on_tmpfs_2MiB": tmpfs,
        "restarts_kill9": len(runs) - 1,
        "windows_produced": len(produced),
        "delivered_once": once,
        "delivered_again_after_kill9": again,
        "missing": len(missing),
        "missing_first": missing[:5],
        "dropped_counted_by_reason": dict(dropped),
        # more than missing: drops of windows outside "produced" (a run's first two seconds)
        "dropped_as_gpu_windows": round(counted_windows, 1),
        # missing GPU windows that no drop counter accounts for (0 means nothing lost silently)
        # window sizes are estimated from their neighbours, so under one window is noise
        "missing_uncounted": round(max(0.0, len(missing) - explained), 1),
        "answers": dict(receiver.answers),
        "log_lines": text.count("\n"),
        "tracebacks_in_log": text.count("Traceback"),
        "schedule": [m for _, m in timeline],
        "reloads_applied": text.count("configuration reloaded"),
    }


def print_report(r: dict[str, Any]) -> None:
    rows = [
        ("minutes", r["minutes"]),
        ("queue on a 2 MiB tmpfs", r["queue_on_tmpfs_2MiB"]),
        ("kill -9 restarts", r["restarts_kill9"]),
        ("windows produced (1 series x GPUs)", r["windows_produced"]),
        ("delivered once", r["delivered_once"]),
        ("delivered again (after kill -9)", r["delivered_again_after_kill9"]),
        ("missing", r["missing"]),
        ("dropped samples counted, by reason", r["dropped_counted_by_reason"]),
        ("  = GPU windows", r["dropped_as_gpu_windows"]),
        ("missing and not counted", r["missing_uncounted"]),
        ("receiver answers by mode", r["answers"]),
        ("log lines / tracebacks", f"{r['log_lines']} / {r['tracebacks_in_log']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


# -- the SIGHUP storm ----------------------------------------------------------------------------

STORM_SIGHUPS = 50
STORM_GAP_S = 0.05
STORM_GPUS = 4


def storm_file(k: int, urls: dict[str, str], queue: Path | None) -> dict[str, Any]:
    """Step ``k``'s file: even steps dc=a and remote_timeout 5s; odd ones dc=b, 7s and `extra`."""
    timeout = "5s" if k % 2 == 0 else "7s"
    endpoints = [{"url": u, "name": n, "remote_timeout": timeout}
                 for n, u in urls.items() if n != "extra" or k % 2]  # fmt: skip
    config: dict[str, Any] = {"external_labels": {"dc": "ab"[k % 2]}, "remote_write": endpoints}
    if queue is not None:
        config["queue_dir"] = str(queue)
    return config


def storm_once(work: Path, queue: Path | None, proms: dict[str, rx.Prometheus]) -> dict[str, Any]:
    """One storm; per endpoint: windows delivered once, twice, missing; drops; refusals."""
    with ConformanceReceiver() as conf, ConformanceReceiver() as extra:
        urls = {"conf": conf.url, **{n: p.write_url for n, p in proms.items()}, "extra": extra.url}
        path, listen, log = work / "storm.yml", free_port(), work / "storm.log"

        def write(k: int) -> None:  # at once, as a config manager does: no half-read file
            (work / "storm.tmp").write_text(json.dumps(storm_file(k, urls, queue)))
            (work / "storm.tmp").replace(path)

        write(0)
        proc = rx.spawn_cli(["run", "--source", "sim", "--gpus", str(STORM_GPUS), "--config",
                             str(path), "--listen", f"127.0.0.1:{listen}"], log)  # fmt: skip
        started = time.time()
        try:
            conf.wait(lambda r: bool(r.series_named(SERIES)), 60)
            for k in range(1, STORM_SIGHUPS + 1):
                write(k)
                proc.send_signal(signal.SIGHUP)
                time.sleep(STORM_GAP_S)
            time.sleep(8)  # the last file runs: a few windows under it
            counted = scrape_rw(listen)
        finally:
            code = rx.stop_cli(proc, 60)
        ended = time.time()
    text = log.read_text(errors="replace")
    receivers: dict[str, dict[str, Any]] = {}
    for name, rcv in (("conf", conf), ("extra", extra)):
        found = rcv.series_named(SERIES)
        stamps = Counter((dict(k)["gpu"], t) for k, v in found.items() for t, x in v if x == x)
        seen = rcv.report()
        receivers[name] = {"stored": seen["samples"] - seen["stale_markers"],
                           "stale_markers": seen["stale_markers"],
                           "refused": sum(v.samples for v in rcv.violations),
                           "violations": seen["violations"], "windows": stamps}  # fmt: skip
    for name, prom in proms.items():
        stored = prom.raw_samples('{dc=~"a|b"}', started - 1, ended + 1)
        windows = Counter((dict(k)["gpu"], t) for k, v in stored.items()
                          if dict(k)["__name__"] == SERIES for t, _ in v)  # fmt: skip
        receivers[name] = {"stored": sum(map(len, stored.values())),
                           "refused": len(prom.log_problems()), "windows": windows}  # fmt: skip
    out: dict[str, Any] = {"exit": code, "tracebacks": text.count("Traceback"),
                           "reloads_applied": text.count("configuration reloaded")}  # fmt: skip
    for name, r in receivers.items():
        windows = r.pop("windows")
        first, last = (
            (min(t for _, t in windows), max(t for _, t in windows)) if windows else (0, 0)
        )
        # every window of the endpoint's span, per GPU (`extra`, which comes and goes: only
        # the windows it got are checked, for being sent twice)
        span = range(first, last + 1, 1000) if name != "extra" else sorted({t for _, t in windows})
        missing = sum((str(g), t) not in windows for g in range(STORM_GPUS) for t in span)
        dropped = counted["dropped"].get(name, {})
        out[name] = {**r, "sent": counted["sent"].get(name, 0.0), "dropped": dropped,
                     "windows": len(windows), "twice": sum(n > 1 for n in windows.values()),
                     "missing": missing,
                     "missing_uncounted": 0 if sum(dropped.values()) else missing}  # fmt: skip
    return out


def scrape_rw(port: int) -> dict[str, dict[str, Any]]:
    """Samples delivered and dropped (by reason) per endpoint, from hfsampler's /metrics."""
    sent: dict[str, float] = {}
    dropped: dict[str, dict[str, float]] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        name = head.split('remote_name="', 1)[-1].split('"', 1)[0]
        if line.startswith("hfsampler_remote_write_samples_total{"):
            sent[name] = sent.get(name, 0.0) + float(value)
        elif line.startswith("hfsampler_remote_write_samples_dropped_total{"):
            reason = head.split('reason="', 1)[1].split('"', 1)[0]
            by = dropped.setdefault(name, {})
            by[reason] = by.get(reason, 0.0) + float(value)
    return {"sent": sent, "dropped": dropped}


def storm(out: Path) -> int:
    work = Path(tempfile.mkdtemp(prefix="hfsampler-storm-"))
    builds = [b for b in rx.PROMETHEUS_BUILDS.values() if rx.binary_path(b.binary)]
    report: dict[str, Any] = {"sighups": STORM_SIGHUPS, "gap_s": STORM_GAP_S, "runs": {}}
    for mode in ("memory", "queue_dir"):
        proms = {b.name: rx.start_prometheus(work / mode / b.name, binary=b.binary, name=b.name)
                 for b in builds}  # fmt: skip
        try:
            queue = work / mode / "queue" if mode == "queue_dir" else None
            report["runs"][mode] = storm_once(work / mode, queue, proms)
        finally:
            for p in proms.values():
                p.stop()
    bad = 0
    for mode, run in report["runs"].items():
        print(f"{mode}: exit {run['exit']}, {run['reloads_applied']} reloads applied, "
              f"{run['tracebacks']} tracebacks")  # fmt: skip
        print(f"  {'endpoint':<13}{'sent':>8}{'stored':>8}{'stale':>6}{'refused':>8}{'windows':>8}"
              f"{'twice':>6}{'missing':>8}{'uncounted':>10}  dropped by reason")  # fmt: skip
        for name in ("conf", *(b.name for b in builds), "extra"):
            r = run[name]
            stale = r.get("stale_markers", "-")  # Prometheus does not return them
            print(f"  {name:<13}{r['sent']:>8.0f}{r['stored']:>8}{stale:>6}{r['refused']:>8}"
                  f"{r['windows']:>8}{r['twice']:>6}{r['missing']:>8}{r['missing_uncounted']:>10}"
                  f"  {r['dropped']}")  # fmt: skip
            bad += r["twice"] + r["missing_uncounted"] + r["refused"]
        bad += run["tracebacks"] + (run["exit"] != 0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

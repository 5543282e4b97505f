"""Backlog drain after an outage, side by side with vmagent: CPU, wall time, first success.

Both sides hold the same backlog, ``--backlogs`` seconds of 1 s windows of the series a default
``sim`` run exports for ``--gpus`` GPUs (dcgm-exporter's labels, the same timestamps and values
on both), built while their receiver is down; then a Prometheus (Debian's 2.42, one per side,
fresh each run) starts on the port they push to, and the drain is timed until it has appended
every sample (its ``prometheus_tsdb_head_samples_appended_total``, read every 50 ms;
VictoriaMetrics's row counters move once a second, too coarse for drains of a second or two):

- hfsampler: a ``RemoteWriter`` with a ``queue_dir`` in a process of its own (this script with
  ``--hfsampler-side``, on uvloop as the service runs), fed the windows as the window loop
  pushes them; its spool holds them.
- vmagent: Debian sid's (``.ci/fetch-vmagent``), with ``-remoteWrite.tmpDataPath``, fed the same
  windows as Remote-Write 1.0 requests on its own ``/api/v1/write`` (one per window): the same
  samples on both sides, so stored counts compare exactly, where a scrape of ``/metrics`` would
  stamp its own times. ``-remoteWrite.forcePromProto``: snappy 1.0 as hfsampler sends, even to
  a receiver that would take VictoriaMetrics's own zstd protocol. ``-remoteWrite.queues=1``:
  one request at a time, in order, as hfsampler's one shard (with its default 4, Prometheus
  refuses the blocks that arrive out of order and vmagent drops them).

Both retry at most every second (hfsampler ``max_backoff: 1s``; vmagent
``-remoteWrite.retryMaxInterval=1s``), the rest at their defaults. Per run and side:

- CPU seconds of the draining process (its threads' run time, ``/proc/PID/task/*/schedstat``),
  from the receiver's first answer to the last sample stored;
- wall time over the same span, and first success (the receiver's first stored row);
- the backlog's bytes per sample in the sender's queue: hfsampler's spool files; vmagent's
  ``vmagent_remotewrite_pending_data_bytes``, in memory and in files (it keeps the newest blocks
  in memory);
- the samples the receiver stored (its query API) against those pushed, and whether the sum of
  their values is the pushed one (the same samples, not only as many).

Sides alternate run by run (hfsampler first in odd runs); the table gives the median and the
spread (lowest-highest) over ``--runs``, and hfsampler / vmagent. Writes
``benchmarks/out/drain.json``.

    python benchmarks/drain.py [--gpus 8] [--backlogs 60,300] [--runs 5] [--vmagent PATH]
                               [--max-samples-per-send N]

Requests: hfsampler's at its defaults, ``max_samples_per_send`` Prometheus's 2000 and a drain's
``max_samples_per_drain_send`` 10000, as vmagent's ``-remoteWrite.maxRowsPerBlock``;
``--max-samples-per-send N`` gives hfsampler's ``max_samples_per_send`` (and so, unless N is
2000, the drain's request size too), to tell the cost per request from the cost per sample.

Without a vmagent (no ``--vmagent``, ``HFSAMPLER_VMAGENT_BIN`` or fetchable one) it says so in
one line and exits 0; ``--vmagent /usr/bin/vmagent`` runs bookworm's 1.79 (which has no
``-remoteWrite.retryMaxInterval``: its retries back off to a minute, so its first success is
not comparable), named as such in the output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import receivers as rx  # the integration tests' receiver harness
import uvloop

from hfsampler.config.settings import Config
from hfsampler.export.metrics import gpu_labels, host_labels
from hfsampler.remote_write.config import QueueConfig, parse_remote_write
from hfsampler.remote_write.encoder import Encoder
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.sampling.window import exported_names
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Series, SeriesRegistry, Snapshot
from hfsampler.sources.base import DeviceInfo

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
POLL_S = 0.05  # how often the receiver's sample counter is read while draining
DRAIN_LIMIT_S = 300.0


def series_for(gpus: int) -> list[Series]:
    """The series of a default run: every exported name per GPU, dcgm-exporter's labels."""
    reg = SeriesRegistry()
    fields = [f for f in Config().selected_fields() if f.nvml_readable]  # an NVML node's
    names = [n for f in fields for n in exported_names(f)]
    host = host_labels(socket.gethostname(), instance="")
    out = []
    for g in range(gpus):
        uuid = f"GPU-{g:08x}-5e1f-4c2b-9d7a-{g:012x}"
        device = DeviceInfo(g, uuid, "NVIDIA H100 80GB HBM3", f"00000000:{g + 0x18:02X}:00.0",
                            "550.54.15", g)  # fmt: skip
        labels = {**gpu_labels(device, host), "cluster": "bench"}
        out.extend(reg.series(n, labels) for n in names)
    return out


def windows(series: list[Series], count: int, t0_ms: int) -> list[Snapshot]:
    """``count`` 1 s windows from ``t0_ms``: the same values for both sides."""
    return [
        Snapshot(t0_ms + 1000 * w, series, [float((w * 7 + i) % 1000) for i in range(len(series))])
        for w in range(count)
    ]


def cpu_s(pid: int) -> float:
    """CPU seconds of a process so far: its threads' run time in ns (``schedstat``), as
    ``/proc/PID/stat``'s utime + stime count in clock ticks (10 ms: too coarse for vmagent's
    drains). Threads that ended take theirs with them: both sides keep theirs while draining."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # ended meanwhile
            total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e9


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def samples_appended(receiver: rx.Receiver) -> int:
    """Samples the receiver appended so far: Prometheus's own counter, exact at every read
    (VictoriaMetrics's row counters move once a second: too coarse for a drain of a second)."""
    _, text = rx.http_get_text(receiver.base_url + "/metrics", timeout_s=5.0)
    for line in text.splitlines():
        if line.startswith("prometheus_tsdb_head_samples_appended_total"):
            return int(float(line.split()[-1]))
    return 0


def stored(receiver: rx.Receiver, t_end_s: float, span_s: int) -> tuple[int, float]:
    """Samples the receiver stored over the backlog, and their sum (the same samples?); name by
    name, since ``count_over_time`` drops the name and the series of two names would collide."""
    names = receiver.api("/api/v1/label/__name__/values")["data"]
    count, total = 0, 0.0
    for name in names:
        for fn in ("count_over_time", "sum_over_time"):
            got = receiver.query(f"sum({fn}({name}[{span_s}s]))", t_end_s)
            value = float(got[0]["value"][1]) if got else 0.0
            if fn == "count_over_time":
                count += int(value)
            else:
                total += value
    return count, total


# -- the hfsampler side: a process of its own ------------------------------------------------------


async def hfsampler_side(
    port: int, queue_dir: Path, gpus: int, count: int, t0_ms: int, per_send: int | None
) -> None:
    """Spool ``count`` windows for a receiver on ``port`` that is down, say ``spooled <bytes>``
    on stdout, then keep delivering until stdin closes. ``per_send``: max_samples_per_send
    (None: the default, and so the default drain request size)."""
    queue: dict[str, object] = {"max_backoff": "1s"}  # as vmagent's -remoteWrite.retryMaxInterval
    if per_send is not None:
        queue["max_samples_per_send"] = per_send
    (ep,) = parse_remote_write(
        [{"url": f"http://127.0.0.1:{port}/api/v1/write", "name": "bench", "queue_config": queue}]
    )
    logging.basicConfig(level=logging.ERROR)  # not the retries while the receiver is down
    writer = RemoteWriter(ep, SelfMetrics(), queue_dir)
    await writer.start()
    for w, snapshot in enumerate(windows(series_for(gpus), count, t0_ms)):
        writer.push(snapshot)
        if w % 10 == 0:
            await asyncio.sleep(0)  # let the spool's writer task run, as the window loop does
    disk, steady = -1, 0
    while steady < 10:  # the spool's thread has written the last records: a second unchanged
        await asyncio.sleep(0.1)
        now = writer.disk_bytes()
        steady = steady + 1 if now == disk and now > 0 else 0
        disk = now
    print(f"spooled {disk}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await writer.close(5)


# -- one run of one side ---------------------------------------------------------------------------


class Side:
    """A sender with a backlog for a receiver on ``port`` that is not yet up."""

    name = ""
    pid = 0
    queue_bytes = 0  # the backlog's bytes in the sender's queue, memory and disk
    file_bytes = 0  # of those, in files

    def stop(self) -> None: ...


class HfsamplerSide(Side):
    """``tree``: a checkout whose hfsampler the process imports instead of this one's."""

    def __init__(
        self,
        root: Path,
        port: int,
        gpus: int,
        count: int,
        t0_ms: int,
        per_send: int | None,
        tree: Path | None = None,
    ) -> None:
        self.name = "hfsampler" if tree is None else "baseline"
        cmd = [sys.executable, __file__, "--hfsampler-side", str(port), str(root / "queue")]
        cmd += ["--gpus", str(gpus), "--count", str(count), "--t0-ms", str(t0_ms)]
        if per_send is not None:
            cmd += ["--max-samples-per-send", str(per_send)]
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("spooled "):
            self.stop()
            raise SystemExit(f"hfsampler side: expected 'spooled N', got {line!r}")
        self.queue_bytes = self.file_bytes = int(line.split()[1])  # all on disk
        self.pid = self.proc.pid

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class VmagentSide(Side):
    name = "vmagent"

    def __init__(
        self, binary: str, root: Path, port: int, snapshots: list[Snapshot], new: bool
    ) -> None:
        self.data = root / "vmagent-queue"
        self.http_port = rx.free_port()
        cmd = [
            binary,
            f"-httpListenAddr=127.0.0.1:{self.http_port}",
            f"-remoteWrite.url=http://127.0.0.1:{port}/api/v1/write",
            f"-remoteWrite.tmpDataPath={self.data}",
            "-remoteWrite.queues=1",  # blocks in order, as hfsampler's one shard sends them
            "-loggerLevel=ERROR",
        ]
        if new:  # 1.79 has neither flag, and sends nothing but Prometheus's protocol
            cmd += ["-remoteWrite.forcePromProto", "-remoteWrite.retryMaxInterval=1s"]
        self.log = open(root / "vmagent.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        base = f"http://127.0.0.1:{self.http_port}"
        rx.wait_http(base + "/health")
        encoder = Encoder()
        for snapshot in snapshots:
            status, text = rx.push(base + "/api/v1/write", encoder.encode([snapshot]))
            if status // 100 != 2:
                self.stop()
                raise SystemExit(f"vmagent refused a window: HTTP {status}: {text[:200]}")
        # Its blocks go to the queue each -remoteWrite.flushInterval (1 s): wait for them. It
        # keeps the newest blocks in memory, the rest in its files: its queue's bytes are both.
        pending, steady = -1, 0
        while steady < 3:
            time.sleep(0.3)
            now = self._pending_bytes(base)
            steady = steady + 1 if now == pending and now > 0 else 0
            pending = now
        self.queue_bytes = pending
        self.file_bytes = dir_bytes(self.data)

    @staticmethod
    def _pending_bytes(base: str) -> int:
        """Bytes of blocks waiting to be sent, in memory and on disk."""
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(
            int(float(line.split()[-1]))
            for line in text.splitlines()
            if line.startswith("vmagent_remotewrite_pending_data_bytes")
        )

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as a service manager stops vmagent, then SIGKILL after 15 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def drain(side: Side, receiver_root: Path, port: int, samples: int) -> dict[str, float]:
    """Start the receiver; time the side's drain until the receiver appended every sample."""
    cpu0 = cpu_s(side.pid)
    receiver = rx.start_prometheus(receiver_root, port=port)
    try:
        if receiver.port != port:
            raise SystemExit(f"port {port} was taken meanwhile; run again")
        ready = time.perf_counter()
        cpu_ready = cpu_s(side.pid)
        first = None
        while True:
            rows = samples_appended(receiver)
            now = time.perf_counter()
            if first is None and rows > 0:
                first = now
            if rows >= samples:
                break
            if now - ready > DRAIN_LIMIT_S:
                raise SystemExit(f"{side.name}: {rows} of {samples} samples in {DRAIN_LIMIT_S} s")
            time.sleep(POLL_S)
        done = now
        cpu_done = cpu_s(side.pid)
        rss = rss_mib(side.pid)
        time.sleep(0.5)  # anything beyond the samples pushed (duplicates) arrives meanwhile
        rows = samples_appended(receiver)
        side.stop()
        return {
            "cpu_s": round(cpu_done - cpu_ready, 3),
            "cpu_s_while_receiver_started": round(cpu_ready - cpu0, 3),
            "wall_s": round(done - ready, 3),
            "first_success_s": round((first or done) - ready, 3),
            "wall_s_from_first_success": round(done - (first or done), 3),
            "samples_appended": rows,
            "rss_mib_at_end": round(rss, 1),
            "_receiver": receiver,  # type: ignore[dict-item]
        }
    except BaseException:
        receiver.stop()
        raise


def one_run(
    side_name: str,
    vmagent: str,
    new_vmagent: bool,
    gpus: int,
    backlog_s: int,
    per_send: int | None,
    baseline: Path | None,
    root: Path,
) -> dict[str, Any]:
    series = series_for(gpus)
    t0_ms = (int(time.time()) - backlog_s - 5) * 1000
    samples = len(series) * backlog_s
    port = rx.free_port()
    side: Side
    if side_name == "hfsampler":
        side = HfsamplerSide(root, port, gpus, backlog_s, t0_ms, per_send)
    elif side_name == "baseline":
        side = HfsamplerSide(root, port, gpus, backlog_s, t0_ms, per_send, baseline)
    else:
        side = VmagentSide(vmagent, root, port, windows(series, backlog_s, t0_ms), new_vmagent)
    try:
        result = drain(side, root / "receiver", port, samples)
    finally:
        side.stop()
    receiver: rx.Receiver = result.pop("_receiver")
    try:
        count, total = stored(receiver, t0_ms / 1000 + backlog_s, backlog_s + 1)
    finally:
        receiver.stop()
    expected_sum = sum(sum(s.values) for s in windows(series, backlog_s, t0_ms))
    return {
        "side": side_name,
        "backlog_s": backlog_s,
        "series": len(series),
        "samples": samples,
        **result,
        "queue_bytes": side.queue_bytes,
        "queue_file_bytes": side.file_bytes,
        "queue_bytes_per_sample": round(side.queue_bytes / samples, 2),
        "stored_samples": count,
        "stored_sum_matches": abs(total - expected_sum) <= 1e-9 * max(expected_sum, 1.0),
    }


# -- the table ----------------------------------------------------------------------------------

MEASURES: list[tuple[str, str, Callable[[float], str]]] = [
    ("cpu_s", "CPU s", lambda v: f"{v:.2f}"),
    ("wall_s", "wall s", lambda v: f"{v:.2f}"),
    ("first_success_s", "first success s", lambda v: f"{v:.2f}"),
    ("wall_s_from_first_success", "then to the end s", lambda v: f"{v:.2f}"),
    ("queue_bytes_per_sample", "queue B/sample", lambda v: f"{v:.1f}"),
    ("rss_mib_at_end", "RSS MiB", lambda v: f"{v:.0f}"),
]


def summary(runs: list[dict[str, Any]], sides: list[str]) -> list[dict[str, Any]]:
    out = []
    for backlog in sorted({r["backlog_s"] for r in runs}):
        row: dict[str, Any] = {"backlog_s": backlog}
        for side in sides:
            mine = [r for r in runs if r["backlog_s"] == backlog and r["side"] == side]
            row[side] = {
                key: {
                    "median": statistics.median(r[key] for r in mine),
                    "min": min(r[key] for r in mine),
                    "max": max(r[key] for r in mine),
                }
                for key, _, _ in MEASURES
            }
            row[side]["samples"] = mine[0]["samples"]
            row[side]["stored_samples"] = sorted({r["stored_samples"] for r in mine})
            row[side]["all_sums_match"] = all(r["stored_sum_matches"] for r in mine)
        out.append(row)
    return out


def print_table(
    rows: list[dict[str, Any]], sides: list[str], peer: str, per_send: int | None
) -> None:
    print(f"\nmedian (lowest-highest) over the runs; peer: {peer}")
    print(f"requests: hfsampler {requests(per_send)}; vmagent blocks of 10000 rows")
    ratios = [s for s in sides if s != "vmagent"]
    head = f"{'backlog':>8}  {'measure':<17}" + "".join(f" {s:>22}" for s in sides)
    head += "".join(f" {s[:2] + '/vmagent':>11}" for s in ratios)
    print(head)
    print("-" * len(head))
    for row in rows:
        for key, label, fmt in MEASURES:
            line = f"{row['backlog_s']:>7}s  {label:<17}"
            for side in sides:
                m = row[side][key]
                cell = f"{fmt(m['median'])} ({fmt(m['min'])}-{fmt(m['max'])})"
                line += f" {cell:>22}"
            vm = row["vmagent"][key]["median"]
            for side in ratios:
                ratio = f"{row[side][key]['median'] / vm:.2f}x" if vm else "-"
                line += f" {ratio:>11}"
            print(line)
        for side in sides:
            r = row[side]
            print(
                f"{'':>8}  {side + ' stored':<17} {r['stored_samples']} of {r['samples']} "
                f"samples, values' sum {'matches' if r['all_sums_match'] else 'DIFFERS'}"
            )


def requests(per_send: int | None) -> str:
    """How large the hfsampler side's drain requests are."""
    queue = QueueConfig() if per_send is None else QueueConfig(max_samples_per_send=per_send)
    given = "default" if per_send is None else "given"
    return (
        f"max_samples_per_send {queue.max_samples_per_send} ({given}), a drain's "
        f"{queue.drain_samples} (baseline: max_samples_per_send, crossed by one record)"
    )


def find_vmagent(given: str | None) -> tuple[str | None, str]:
    """The vmagent to run and how to name it; (None, why) when there is none."""
    given = given or os.environ.get("HFSAMPLER_VMAGENT_BIN")
    if given:
        found = shutil.which(given)
        return (found, given) if found else (None, f"{given} is not an executable")
    fetch = subprocess.run(
        [str(REPO / ".ci" / "fetch-vmagent")], capture_output=True, text=True, check=False
    )
    path = fetch.stdout.strip()
    if fetch.returncode == 0 and path:
        return path, f"vmagent from Debian sid's victoria-metrics ({path})"
    why = (fetch.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f".ci/fetch-vmagent failed ({why})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--backlogs", default="60,300", help="outage lengths in seconds")
    parser.add_argument("--runs", type=int, default=5, help="runs per side and backlog")
    parser.add_argument("--vmagent", help="vmagent binary (default: .ci/fetch-vmagent's)")
    parser.add_argument(
        "--max-samples-per-send",
        type=int,
        help="hfsampler's max_samples_per_send (default: left out, so a drain's requests are "
        "max_samples_per_drain_send's default; vmagent's blocks: 10000 rows)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout whose hfsampler drains as a third side (git archive REV | tar -x -C DIR)",
    )
    parser.add_argument("--out", type=Path, default=OUT / "drain.json")
    # the hfsampler side's own process: PORT QUEUE_DIR
    parser.add_argument(
        "--hfsampler-side", nargs=2, metavar=("PORT", "DIR"), help=argparse.SUPPRESS
    )
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--t0-ms", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hfsampler_side:
        port, queue_dir = args.hfsampler_side
        side = hfsampler_side(
            int(port), Path(queue_dir), args.gpus, args.count, args.t0_ms, args.max_samples_per_send
        )
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as the service runs
            runner.run(side)
        return
    vmagent, peer = find_vmagent(args.vmagent)
    if vmagent is None:
        print(f"drain: skipped, no vmagent to compare with: {peer}")
        return
    flags = subprocess.run([vmagent, "-help"], capture_output=True, text=True, check=False)
    help_text = flags.stdout + flags.stderr
    new = "-remoteWrite.retryMaxInterval" in help_text
    if not new:
        peer += (
            " (an old vmagent without -remoteWrite.retryMaxInterval: first success not comparable)"
        )
    backlogs = [int(b) for b in args.backlogs.split(",")]
    per_send = args.max_samples_per_send
    sides = ["hfsampler", "vmagent"] + (["baseline"] if args.baseline else [])
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):
        order = sides[i % len(sides) :] + sides[: i % len(sides)]  # each side first in turn
        for backlog in backlogs:
            for side in order:
                with tempfile.TemporaryDirectory(prefix="hfsampler-drain-") as tmp:
                    run = one_run(
                        side, vmagent, new, args.gpus, backlog, per_send, args.baseline, Path(tmp)
                    )
                runs.append(run)
                print(
                    f"run {i + 1}/{args.runs} {backlog:>4} s {side:<9} cpu {run['cpu_s']:.2f} s, "
                    f"wall {run['wall_s']:.2f} s, first {run['first_success_s']:.2f} s, "
                    f"stored {run['stored_samples']}/{run['samples']}",
                    flush=True,
                )
    rows = summary(runs, sides)
    print_table(rows, sides, peer, per_send)
    load = os.getloadavg()
    result = {
        "peer": peer,
        "gpus": args.gpus,
        "hfsampler_max_samples_per_send": per_send,
        "baseline": str(args.baseline) if args.baseline else None,
        "runs_per_side": args.runs,
        "load_average_at_end": [round(x, 2) for x in load],
        "summary": rows,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

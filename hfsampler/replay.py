"""`hfsampler replay`: push a recording to a Remote-Write receiver after the fact.

The window series go through the same ``MetricModel`` and ``RemoteWriter`` (encoder, queue,
sender, retries) as a live ``hfsampler run``, with the recording's own timestamps, its devices'
labels, and its job labels (``--label`` at record time, Slurm and Kubernetes identifiers) as
external labels. ``--raw`` pushes every distinct millisecond sample instead, as ``NAME_raw``
series. A replay gives up after ``--timeout`` (default 2 minutes, pushing and flushing together)
with a summary of what was not sent, exit 1; Ctrl-C flushes for at most 5 s more, then exits
130. The queue is drained as it fills rather than let overflow: a replay has no live data to
favour over old.

Receivers differ on old samples: Prometheus refuses samples older than its head block (about the
last 1-3 hours) unless ``storage.tsdb.out_of_order_time_window`` is set; VictoriaMetrics accepts
backfill within its retention.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np

from hfsampler.config import parse_label
from hfsampler.durations import parse_duration
from hfsampler.fields import Kind
from hfsampler.metrics import MetricModel, gpu_labels, host_labels
from hfsampler.recording import Recording
from hfsampler.remote_write import RemoteWriter, endpoint_from_url
from hfsampler.remote_write.sender import DROPPED, SAMPLES
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import SeriesRegistry, Snapshot

RAW_SUFFIX = "_raw"
# How long a replay may take, pushing and flushing together, before it gives up (--timeout).
TIMEOUT_S = 120.0
# After Ctrl-C: how long what is queued may still be sent.
INTERRUPT_FLUSH_S = 5.0


def replay_labels(rec: Recording, extra: dict[str, str]) -> dict[str, str]:
    """External labels of a replay: the recording's labels and job identifiers, then ``extra``."""
    return {**rec.header.get("labels", {}), **rec.header.get("job", {}), **extra}


async def _backpressure(writer: RemoteWriter, stop: asyncio.Event, deadline: float) -> None:
    """Wait while the queue is over half full, so nothing is dropped for lack of room; not past
    the deadline, nor once stopped."""
    limit = writer.config.queue.capacity // 2
    loop = asyncio.get_running_loop()
    while writer.queued() > limit and not stop.is_set() and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay did: samples accepted and dropped (refused, or not sent in time), and
    whether it stopped early (``gave_up`` at the deadline, ``interrupted`` by Ctrl-C)."""

    sent: int
    dropped: int
    pushed: int  # samples of the recording handed to the writer
    gave_up: bool = False
    interrupted: bool = False
    stopped_at_ms: int | None = None  # the recording's time where pushing stopped early

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 1 if self.gave_up or self.dropped else 0

    def summary(self, path: str, timeout_s: float) -> str:
        text = f"replayed {self.sent} samples from {path}"
        if self.dropped:
            text += f"; {self.dropped} refused or not sent (see the log)"
        if self.stopped_at_ms is not None:
            why = "interrupted" if self.interrupted else f"gave up after {timeout_s:g} s"
            text += (
                f"; {why}: the recording from {self.stopped_at_ms} ms (epoch) on was not replayed"
            )
        elif self.interrupted:
            text += "; interrupted"
        elif self.gave_up:
            text += f"; gave up after {timeout_s:g} s"
        return text


def window_snapshots(rec: Recording, labels: dict[str, str]) -> list[Snapshot]:
    """One snapshot per window end, every group's statistics in it, as `hfsampler run` builds."""
    model = MetricModel(
        rec.devices,
        {g.name: g.fields for g in rec.groups},
        SelfMetrics(),
        labels,
        hostname=rec.header.get("host"),
        stale_after_windows=1 << 30,  # a replay ends series by ending, not with markers
    )
    by_end: dict[int, dict[str, Any]] = {}
    for gi, group in enumerate(rec.groups):
        w = rec.windows(gi)
        for k in range(len(w.t1_ns)):
            by_end.setdefault(int(w.t1_ns[k]), {})[group.name] = w.stats(k, group.fields)
    # a MIG slot empty when the recording began has no labels of its own: its rows stay out
    # (the header keeps the layout at the start; an instance created later is not replayed)
    up = np.array([d.is_gpu or d.mig is not None for d in rec.devices], dtype=np.bool_)
    return [model.snapshot(by_end[t1], up, t1) for t1 in sorted(by_end)]


def raw_snapshots(rec: Recording, labels: dict[str, str]) -> Any:
    """Per millisecond with data, a snapshot of every raw sample taken in it (the last wins)."""
    registry = SeriesRegistry()
    host = host_labels(rec.header.get("host") or "localhost")
    base = [{**gpu_labels(d, host), **labels} for d in rec.devices]
    held = np.array([d.is_gpu or d.mig is not None for d in rec.devices], dtype=np.bool_)
    for chunk in rec.raw_chunks():
        fields = rec.groups[chunk.group].fields
        series = []
        for c in range(len(chunk.gpu)):
            f = fields[chunk.field[c]]
            registry.family(f.name + RAW_SUFFIX, f"{f.help} Every distinct sample.",
                            "counter" if f.kind is Kind.COUNTER else "gauge", f.unit)  # fmt: skip
            own = dict(f.labels)  # a rail's or zone's own label
            series.append(registry.series(f.name + RAW_SUFFIX, {**base[chunk.gpu[c]], **own}))
        counts = np.diff(chunk.offsets)
        cell = np.repeat(np.arange(len(counts)), counts)
        ms = chunk.ts_us // 1000
        order = np.lexsort((cell, ms))  # by ms, then cell; a cell's samples stay in time order
        ms, cell, values = ms[order], cell[order], chunk.values[order]
        keep = held[chunk.gpu[cell]]  # an empty MIG slot's cells stay out, as in windows
        ms, cell, values = ms[keep], cell[keep], values[keep]
        # two samples of one series in one millisecond: Remote-Write keeps one, keep the last
        last = np.ones(len(ms), dtype=np.bool_)
        last[:-1] = (ms[1:] != ms[:-1]) | (cell[1:] != cell[:-1])
        ms, cell, values = ms[last], cell[last], values[last]
        bounds = np.nonzero(np.diff(ms))[0] + 1
        for idx in np.split(np.arange(len(ms)), bounds):
            if len(idx):
                yield Snapshot(int(ms[idx[0]]), [series[c] for c in cell[idx]],
                               values[idx].tolist(), registry.families)  # fmt: skip


async def replay(
    rec: Recording,
    url: str,
    raw: bool,
    extra: dict[str, str],
    timeout_s: float = TIMEOUT_S,
    stop: asyncio.Event | None = None,
) -> ReplayResult:
    """Push the recording within ``timeout_s``; ``stop`` (set by Ctrl-C) ends it early, after
    flushing for at most ``INTERRUPT_FLUSH_S``."""
    metrics = SelfMetrics()
    writer = RemoteWriter(endpoint_from_url(url), metrics)
    labels = replay_labels(rec, extra)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stop = stop if stop is not None else asyncio.Event()
    pushed = 0
    stopped_at: int | None = None
    await writer.start()
    try:
        snapshots = raw_snapshots(rec, labels) if raw else window_snapshots(rec, labels)
        for snap in snapshots:
            if stop.is_set() or loop.time() >= deadline:
                stopped_at = snap.timestamp_ms
                break
            writer.push(snap)
            pushed += len(snap)
            await _backpressure(writer, stop, deadline)
    finally:
        left = INTERRUPT_FLUSH_S if stop.is_set() else max(0.0, deadline - loop.time())
        await writer.close(left, stop, INTERRUPT_FLUSH_S)
    gave_up = (
        not stop.is_set()
        and loop.time() >= deadline
        and (stopped_at is not None or metrics.total(SAMPLES) < pushed)
    )
    return ReplayResult(
        int(metrics.total(SAMPLES)),
        int(metrics.total(DROPPED)),
        pushed,
        gave_up=gave_up,
        interrupted=stop.is_set(),
        stopped_at_ms=stopped_at,
    )


def register(sub: Any) -> dict[str, Any]:
    p = sub.add_parser("replay", help="push a recording to a Remote-Write receiver")
    p.add_argument("recording", metavar="RUN.hfs")
    p.add_argument("--remote-write", required=True, metavar="URL", help="receiver's write URL")
    p.add_argument("--raw", action="store_true", help="every raw sample (NAME_raw series)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="extra label")
    p.add_argument(
        "--timeout",
        default=f"{TIMEOUT_S:g}s",
        metavar="DUR",
        help=f"give up after this long, with a summary of what was not sent (default "
        f"{TIMEOUT_S:g}s)",
    )
    return {"replay": cmd_replay}


def cmd_replay(args: argparse.Namespace) -> int:
    from hfsampler.cli import run_async

    rec = Recording(args.recording)
    extra = dict(parse_label(t) for t in args.label)
    timeout_s = parse_duration(args.timeout, "--timeout")

    async def main() -> int:
        stop = asyncio.Event()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        result = await replay(rec, args.remote_write, args.raw, extra, timeout_s, stop)
        print(result.summary(args.recording, timeout_s))
        return result.exit_code

    return run_async(main)

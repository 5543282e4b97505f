"""`hfsampler replay`: push a recording to a Remote-Write receiver after the fact.

The window series go through the same ``MetricModel`` and ``RemoteWriter`` (encoder, queue,
sender, retries) as a live ``hfsampler run``, with the recording's own timestamps, its devices'
labels, and its job labels (``--label`` at record time, Slurm and Kubernetes identifiers) as
external labels. ``--raw`` pushes every distinct millisecond sample instead, as ``NAME_raw``
series. The queue is drained as it fills rather than let overflow: a replay has no live data to
favour over old.

Receivers differ on old samples: Prometheus refuses samples older than its head block (about the
last 1-3 hours) unless ``storage.tsdb.out_of_order_time_window`` is set; VictoriaMetrics accepts
backfill within its retention.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np

from hfsampler.config import parse_label
from hfsampler.fields import Kind
from hfsampler.metrics import MetricModel, gpu_labels, host_labels
from hfsampler.recording import Recording
from hfsampler.remote_write import RemoteWriter, endpoint_from_url
from hfsampler.remote_write.sender import DROPPED, SAMPLES
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import SeriesRegistry, Snapshot

RAW_SUFFIX = "_raw"
FLUSH_DEADLINE_S = 120.0


def replay_labels(rec: Recording, extra: dict[str, str]) -> dict[str, str]:
    """External labels of a replay: the recording's labels and job identifiers, then ``extra``."""
    return {**rec.header.get("labels", {}), **rec.header.get("job", {}), **extra}


async def _backpressure(writer: RemoteWriter) -> None:
    """Wait while the queue is over half full, so nothing is dropped for lack of room."""
    limit = writer.config.queue.capacity // 2
    while writer.queued() > limit:  # noqa: ASYNC110 (the writer offers no event to wait on)
        await asyncio.sleep(0.005)


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
    up = np.ones(len(rec.devices), dtype=np.bool_)
    return [model.snapshot(by_end[t1], up, t1) for t1 in sorted(by_end)]


def raw_snapshots(rec: Recording, labels: dict[str, str]) -> Any:
    """Per millisecond with data, a snapshot of every raw sample taken in it (the last wins)."""
    registry = SeriesRegistry()
    host = host_labels(rec.header.get("host") or "localhost")
    base = [{**gpu_labels(d, host), **labels} for d in rec.devices]
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
        # two samples of one series in one millisecond: Remote-Write keeps one, keep the last
        last = np.ones(len(ms), dtype=np.bool_)
        last[:-1] = (ms[1:] != ms[:-1]) | (cell[1:] != cell[:-1])
        ms, cell, values = ms[last], cell[last], values[last]
        bounds = np.nonzero(np.diff(ms))[0] + 1
        for idx in np.split(np.arange(len(ms)), bounds):
            if len(idx):
                yield Snapshot(int(ms[idx[0]]), [series[c] for c in cell[idx]],
                               values[idx].tolist(), registry.families)  # fmt: skip


async def replay(rec: Recording, url: str, raw: bool, extra: dict[str, str]) -> tuple[int, int]:
    """Push the recording; returns (samples accepted, samples dropped)."""
    metrics = SelfMetrics()
    writer = RemoteWriter(endpoint_from_url(url), metrics)
    labels = replay_labels(rec, extra)
    await writer.start()
    try:
        snapshots = raw_snapshots(rec, labels) if raw else window_snapshots(rec, labels)
        for snap in snapshots:
            writer.push(snap)
            await _backpressure(writer)
    finally:
        await writer.close(FLUSH_DEADLINE_S)
    return int(metrics.total(SAMPLES)), int(metrics.total(DROPPED))


def register(sub: Any) -> dict[str, Any]:
    p = sub.add_parser("replay", help="push a recording to a Remote-Write receiver")
    p.add_argument("recording", metavar="RUN.hfs")
    p.add_argument("--remote-write", required=True, metavar="URL", help="receiver's write URL")
    p.add_argument("--raw", action="store_true", help="every raw sample (NAME_raw series)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="extra label")
    return {"replay": cmd_replay}


def cmd_replay(args: argparse.Namespace) -> int:
    from hfsampler.cli import run_async

    rec = Recording(args.recording)
    extra = dict(parse_label(t) for t in args.label)

    async def main() -> int:
        sent, dropped = await replay(rec, args.remote_write, args.raw, extra)
        print(f"replayed {sent} samples from {args.recording}"
              + (f"; {dropped} refused or dropped (see the log)" if dropped else ""))  # fmt: skip
        return 1 if dropped else 0

    return run_async(main)

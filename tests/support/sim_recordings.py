"""Sim recordings made offline at virtual time: the writer and window code of `hfsampler record`,
without waiting for the wall clock, with markers where a test or benchmark places them.

Tests check reports of these against the sim's ground truth (``SimSource.value_at``);
``benchmarks/record.py`` makes long ones to time the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hfsampler.fields import DEFAULT_GROUP_INTERVALS_S, Kind, select
from hfsampler.profiling import record
from hfsampler.profiling.recording_format import ConsumerWindow, Marker
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.sampling.groups import GroupPlan, plan_groups
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.window import WindowClock, reduce
from hfsampler.sources.sim.source import SimSource


def start_for(seconds: int) -> int:
    """A whole-second start that ends a recording of ``seconds`` about now."""
    return (time.time_ns() - seconds * 10**9) // 10**9 * 10**9


def store_window(writer: RecordingWriter, gi: int, plan: GroupPlan, rows: RingRows, t0: int,
                 t1: int, keep: Sequence[int]) -> None:  # fmt: skip
    """One group's window reduced and stored as ``record`` stores it (tests patch this to change
    the rows a window holds before its statistics are taken)."""
    record.store_window(writer, gi, rows, reduce(rows, plan.fields, t0, t1), keep)


def synthesize(
    path: Path,
    gpus: int,
    seconds: int,
    quantize: bool,
    seed: int = 0,
    start_ns: int | None = None,
    markers: Sequence[Marker] = (),
    end: bool = True,
    consumers: Callable[[int, int], ConsumerWindow | None] | None = None,
) -> dict[str, float]:
    """A recording of ``seconds`` of ``gpus`` sim GPUs sampled at 1 kHz / 10 Hz, written offline.

    ``markers`` are stored in the window their time falls in (as the recorder stores what arrived
    during a window); ``consumers(t0_ns, t1_ns)`` gives each window's consumers, if any;
    ``end=False`` leaves the file as a killed recorder would (no end chunk).
    """
    sim = SimSource(gpus=gpus, seed=seed)
    inventory = sim.open(select(None))  # the default selection, as record's
    plans = plan_groups(inventory.fields, DEFAULT_GROUP_INTERVALS_S)
    start = start_for(seconds) if start_ns is None else start_ns
    pending = sorted(markers, key=lambda m: m.t_ns)
    header = {"start_ns": start, "command": ["synthetic"], "command_line": "synthetic",
              "host": "bench", "source": "sim", "labels": {}, "job": {}}  # fmt: skip
    writer = RecordingWriter(path, header, inventory.devices, plans)
    keep = list(range(gpus))
    last = [np.full((gpus, len(p.fields)), -1, np.int64) for p in plans]
    g_ids = np.arange(gpus)[None, :]
    began = time.perf_counter()
    clock = WindowClock(1.0, start_ns=start)  # offline: its windows, never its wall clock
    for _ in range(seconds):
        t0, t1 = clock.t0_ns, clock.t1_ns
        clock.advance()
        for gi, plan in enumerate(plans):
            step = int(plan.interval_s * 1e9)
            ticks = np.arange(t0, t1, step, dtype=np.int64)
            n, f = len(ticks), len(plan.fields)
            values = np.empty((n, gpus, f))
            driver = np.empty((n, gpus, f), np.int64)
            if any(x.kind is Kind.COUNTER for x in plan.fields):
                for r, t in enumerate(ticks):
                    sim.read(plan.fields, values[r], driver[r], int(t))
            else:
                for j, field in enumerate(plan.fields):
                    refresh = sim.refresh_ns(field.name)
                    at = ticks - ticks % refresh
                    values[:, :, j] = sim.value_at(field.name, at[:, None], g_ids)
                    driver[:, :, j] = (at // 1000)[:, None]
            if quantize:
                for j, field in enumerate(plan.fields):
                    if field.kind is not Kind.COUNTER:  # NVML's integer units, then the scale
                        unit = 1e-3 if field.unit == "W" else 1.0
                        values[:, :, j] = np.round(values[:, :, j] / unit) * unit
            prev = np.concatenate([last[gi][None], driver[:-1]])
            values[driver == prev] = np.nan  # repeats, as the sampler marks them
            last[gi] = driver[-1].copy()
            rows = RingRows(ticks, np.zeros(n, np.int64), values, driver)
            store_window(writer, gi, plan, rows, t0, t1, keep)
        found = consumers(t0, t1) if consumers is not None else None
        if found is not None:
            writer.add_consumers(found)
        writer.add_markers([m for m in pending if m.t_ns < t1])
        pending = [m for m in pending if m.t_ns >= t1]
    writer.add_markers(pending)
    writer.close({"end_ns": start + seconds * 10**9, "exit_code": 0} if end else None)
    elapsed = time.perf_counter() - began
    size = path.stat().st_size
    return {"bytes": size, "bytes_per_gpu_hour": size / gpus / (seconds / 3600),
            "write_s": elapsed, "samples": writer.samples_written}  # fmt: skip

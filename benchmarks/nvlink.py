"""Benchmark: what per-link NVLink costs, against the same run without it (the peer).

(a) One read of the slow group by the nvml source on the fake NVML (8 GPUs of 18 links each): with
the per-link fields (6 per link, 108 more cells a GPU, in the same batched field-value call) and
without. The fake driver is Python, so a read's time is mostly the fake's: the fake's own time
for the same entries (the C entry point called on prepared buffers, nothing of hfsampler's) is
measured beside it, and hfsampler's share is the difference. (b) The link-state recheck done once
a second: one ``nvmlDeviceGetNvLinkState`` per GPU and link, again the fake's cost. (c) What a
window sends for 8 sim GPUs: series and snappy-compressed Remote-Write bytes, with and without.

No real GPU here: on one, the driver's time per entry replaces the fake's (``gpu_check`` measures
that). Prints a table, writes JSON; the machine is shared and noisy, so take the medians as such.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's package; the fake NVML

import pytest  # noqa: E402
from fake_nvml import FakeLib, FakeNvml, install, nvlink_gpu  # noqa: E402

from hfsampler import fields as F  # noqa: E402
from hfsampler.export.metrics import MetricModel  # noqa: E402
from hfsampler.remote_write.encoder import Encoder, QueuedSample, compress  # noqa: E402
from hfsampler.sampling.window import STATS, WindowStats  # noqa: E402
from hfsampler.selfmetrics import SelfMetrics  # noqa: E402
from hfsampler.sources.nvml import calls, nvlink  # noqa: E402
from hfsampler.sources.nvml.source import NvmlSource  # noqa: E402
from hfsampler.sources.sim.source import SimSource  # noqa: E402

GPUS = 8
LINKS = 18
READS = 300
REPEATS = 3  # best of: the machine is shared, the slowest runs are other people's work
BATCH = 2000  # Prometheus's max_samples_per_send

SLOW = tuple(f for f in F.CATALOGUE if f.group == F.SLOW and f.nvml_readable)
WITHOUT = tuple(f for f in SLOW if f.per != "link")


class _TimedLib:
    """The fake library, each C entry point timed: what a read spends inside the "driver"."""

    def __init__(self, lib: FakeLib) -> None:
        self._lib = lib
        self.spent_ns = 0

    def __getattr__(self, name: str) -> _TimedFunction:
        return _TimedFunction(getattr(self._lib, name), self)


class _TimedFunction:
    def __init__(self, fn: Callable[..., Any], lib: _TimedLib) -> None:
        self._fn, self._lib = fn, lib
        self.restype: Any = None  # pynvml sets these on some entry points
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return self._fn(*args)
        finally:
            self._lib.spent_ns += time.perf_counter_ns() - t0


_PATCH = pytest.MonkeyPatch()  # the fake goes under pynvml as in the tests, undone at the end


def _install(fake: FakeNvml) -> _TimedLib:
    install(_PATCH, fake)
    lib = _TimedLib(FakeLib(fake))
    _PATCH.setattr("pynvml.nvmlLib", lib)  # pynvml imported by nvml_calls, the one importer
    return lib


def _percentiles_us(fn: Callable[[int], float], n: int) -> tuple[float, float]:
    """(p50, p99) in microseconds of what ``fn`` returns (ns), best of ``REPEATS`` runs by p50."""
    runs = []
    for _ in range(REPEATS):
        took = [fn(i) / 1e3 for i in range(n)]
        runs.append((statistics.median(took), float(np.percentile(took, 99))))
    return min(runs)


def bench_reads() -> list[dict[str, Any]]:
    clock = [1_000_000_000]
    fake = FakeNvml(gpus=[nvlink_gpu(i, LINKS) for i in range(GPUS)], clock_us=lambda: clock[0])
    lib = _install(fake)
    rows = []
    for case, wanted in (("slow group, per-link NVLink", SLOW), ("slow group, without", WITHOUT)):
        source = NvmlSource()
        fields = source.open(wanted).fields
        read = _reader(source, fields, clock)
        read(0)
        inside: list[int] = []  # per read: ns inside the fake's entry points

        def timed(i: int, read: Callable[[int], None] = read, inside: list[int] = inside) -> float:
            before, t0 = lib.spent_ns, time.perf_counter_ns()
            read(i)
            took = time.perf_counter_ns() - t0
            inside.append(lib.spent_ns - before)
            return float(took)

        def own(i: int, timed: Callable[[int], float] = timed, inside: list[int] = inside) -> float:
            return timed(i) - inside[-1]  # hfsampler's part of the same read

        p50, p99 = _percentiles_us(timed, READS)
        own50, own99 = _percentiles_us(own, READS)
        entries = sum(1 for f in fields if nvlink.entry(f)[0] is not None)
        rows.append({"case": case, "cells_per_gpu": len(fields), "entries_per_gpu": entries,
                     "read_p50_us": p50, "read_p99_us": p99,
                     "hfsampler_p50_us": own50, "hfsampler_p99_us": own99})  # fmt: skip
        source.close()
    return rows


def _reader(
    source: NvmlSource, fields: Sequence[F.Field], clock: list[int]
) -> Callable[[int], None]:
    values = np.zeros((GPUS, len(fields)))
    ts = np.zeros((GPUS, len(fields)), dtype=np.int64)

    def read(i: int) -> None:
        clock[0] += 100_000  # the slow group's 100 ms, on the fake driver's clock
        source.read(fields, values, ts, clock[0] * 1000)

    return read


def bench_recheck() -> dict[str, Any]:
    fake = FakeNvml(gpus=[nvlink_gpu(i, LINKS) for i in range(GPUS)])
    _install(fake)
    calls.init()
    try:
        handles = [calls.device_handle(g) for g in range(GPUS)]

        def recheck(i: int) -> float:
            t0 = time.perf_counter_ns()
            for h in handles:
                for k in range(LINKS):
                    calls.nvlink_active(h, k)
            return float(time.perf_counter_ns() - t0)

        p50, p99 = _percentiles_us(recheck, 100)
    finally:
        calls.shutdown()
    return {"case": "link-state recheck (once a second)", "calls": GPUS * LINKS,
            "p50_us": p50, "p99_us": p99}  # fmt: skip


def bench_window() -> list[dict[str, Any]]:
    rows = []
    for case, wanted in (("default fields", F.CATALOGUE), ("without per-link", None)):
        chosen = [f for f in F.CATALOGUE if f.nvml_readable and (wanted or f.per != "link")]
        sim = SimSource(GPUS)
        inv = sim.open(F.expand_xid(chosen))
        groups: dict[str, tuple[F.Field, ...]] = {}
        for f in inv.fields:
            groups.setdefault(f.group, ())
            groups[f.group] += (f,)
        model = MetricModel(inv.devices, groups, SelfMetrics(), hostname="dgx-node07")
        stats = {}
        for name, fields in groups.items():
            values = np.zeros((GPUS, len(fields)))
            sim.read(fields, values, np.zeros((GPUS, len(fields)), np.int64), 1_800_000_000 * 10**9)
            count = np.where(np.isnan(values), 0, 10).astype(np.int64)
            stats[name] = WindowStats(0, 10**9, fields, {s.name: values for s in STATS}, count)
        snap = model.snapshot(stats, np.ones(GPUS, dtype=np.bool_), 1_800_000_001 * 10**9)
        samples = [QueuedSample(s, v, snap.timestamp_ms) for s, v in snap.items()]
        enc = Encoder()
        size = sum(len(compress(enc.encode_samples(samples[i : i + BATCH])))
                   for i in range(0, len(samples), BATCH))  # fmt: skip
        rows.append({"case": case, "series_per_window": len(samples), "snappy_bytes": size})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/nvlink.json", help="JSON result path")
    args = parser.parse_args(argv)
    try:
        reads, recheck, window = bench_reads(), bench_recheck(), bench_window()
    finally:
        _PATCH.undo()
    print(f"(a) one slow-group read, {GPUS} fake GPUs x {LINKS} links ({READS} reads, medians)")
    print(f"{'case':30} {'cells/GPU':>9} {'read p50':>9} {'p99':>8} {'own p50':>8} {'p99':>8}")
    for r in reads:
        print(f"{r['case']:30} {r['cells_per_gpu']:>9} {r['read_p50_us']:>7.0f}us "
              f"{r['read_p99_us']:>6.0f}us {r['hfsampler_p50_us']:>6.0f}us "
              f"{r['hfsampler_p99_us']:>6.0f}us")  # fmt: skip
    ratio = reads[0]["hfsampler_p50_us"] / reads[1]["hfsampler_p50_us"]
    print("own: hfsampler's part of a read, less the time inside the fake driver's entry points;")
    print(f"with per-link vs without: {ratio:.2f}x. The rest of a read is the fake's own Python.")
    print(f"\n(b) {recheck['case']}: {recheck['calls']} calls, p50 {recheck['p50_us']:.0f} us, "
          f"p99 {recheck['p99_us']:.0f} us (the fake's pynvml calls)")  # fmt: skip
    print(f"\n(c) one window, {GPUS} sim GPUs x {LINKS} links")
    for r in window:
        print(f"{r['case']:30} {r['series_per_window']:>6} series {r['snappy_bytes']:>8} B snappy")
    more = window[0]["series_per_window"] / window[1]["series_per_window"]
    print(f"per-link: {more:.2f}x the series, "
          f"{window[0]['snappy_bytes'] / window[1]['snappy_bytes']:.2f}x the bytes")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"python": sys.version.split()[0], "machine": platform.machine(),
                               "gpus": GPUS, "links": LINKS, "reads": reads,
                               "recheck": recheck, "window": window}, indent=2))  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

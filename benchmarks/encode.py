"""Benchmark: Remote-Write encode + snappy, 1.0 and 2.0, samples/s and bytes/sample, alternating.

Two series sets: (a) dcgm-exporter's labels on 8 GPUs x every NVML device field of the catalogue
(34 today; per-link NVLink fields left out: ``benchmarks/nvlink.py`` measures those) x a gauge's
statistics (4: mean, min, max, p99) = 1,088 series; (b) 10,000 series of three labels. Each
window (one sample per series) is cut into requests of at most ``BATCH`` samples
(``max_samples_per_send``), each written and snappy-compressed, as a writer sends a window; the
label cache is warm, as it is from a running writer's second window on.

Sides, all from the same windows (``QueuedSample`` lists built outside the timed region):
- ``new 1.0``: ``Encoder.block`` then ``RequestEncoderV1.encode``, ``compress`` (what
  ``intake`` and ``delivery`` do per request);
- ``new 2.0``: ``Encoder.block`` then ``Sizer`` (delivery's size check, as 1.0),
  ``RequestEncoderV2.encode``, ``compress``;
- with ``--baseline DIR`` (a checkout of the commit before, e.g. ``git worktree add /tmp/rw-base
  d7da83e``): ``old 1.0``, its ``Encoder.encode_samples`` and ``compress``, and ``old 2.0``, its
  1.0 bytes turned into 2.0 by its ``RequestEncoderV2`` (blocks were 1.0; 2.0 was made at send
  time), then ``compress``; its modules are imported from DIR into this process.

Fairness: every side runs in one process on the same windows; in each of ``--rounds`` rounds
every side runs for ``--slice`` seconds, in an order rotated from round to round; a side's rate
is the median of its rounds, its spread the lowest and highest. Before timing, the sides' bytes
are compared: new and old 1.0 must be equal, new and old 2.0 equal, so both measure the same
work. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from hfsampler.export.metrics import gpu_labels, host_labels
from hfsampler.fields import CATALOGUE, Kind
from hfsampler.remote_write.blocks import Sizer
from hfsampler.remote_write.encoder import (
    Encoder,
    QueuedSample,
    RequestEncoderV1,
    compress,
    write_request,
)
from hfsampler.remote_write.encoder_v2 import RequestEncoderV2
from hfsampler.sampling.window import suffixes
from hfsampler.series import Family, Series, SeriesRegistry
from hfsampler.sources.base import DeviceInfo

BATCH = 2000  # Prometheus's default max_samples_per_send
N_WINDOWS = 8
STATS = suffixes(Kind.GAUGE)  # a gauge's series, for every field alike
FIELDS = [f.name for f in CATALOGUE if (f.nvml_field or f.nvml_call) and f.per is None]


def dcgm_series(reg: SeriesRegistry) -> list[Series]:
    out = []
    host = host_labels("dgx-h100-rack12-node07", instance="")
    for gpu in range(8):
        uuid = f"GPU-{random.Random(gpu).getrandbits(128):032x}"
        pci = f"00000000:{0x18 + 0x10 * gpu:02X}:00.0"
        device = DeviceInfo(gpu, uuid, "NVIDIA H100 80GB HBM3", pci, "550.54.15", gpu)
        labels = gpu_labels(device, host)
        for fld in FIELDS:
            for suffix in STATS:
                out.append(reg.series(fld + suffix, labels))
    return out


def many_series(reg: SeriesRegistry, n: int) -> list[Series]:
    per_gpu = n // 8
    out = []
    for gpu in range(8):
        for i in range(per_gpu):
            labels = {"gpu": str(gpu), "Hostname": f"node{i % 50:03d}", "job": "hfsampler"}
            out.append(reg.series(f"hfsampler_bench_metric_{i // 50}", labels))
    return out


def windows(series: list[Series], count: int, seed: int = 1) -> list[list[float]]:
    rng = random.Random(seed)
    base = [rng.uniform(0, 700) for _ in series]
    # Real GPU series hold many integers (temperatures, clocks, utilisation) beside floats.
    return [
        [round(b + rng.gauss(0, 5), 3) if i % 3 else float(int(b)) for i, b in enumerate(base)]
        for _ in range(count)
    ]


def families_of(series: list[Series]) -> dict[str, Family]:
    """Each series name's family as the metric model registers it: the catalogue's metadata."""
    by_field = {f.name: f for f in CATALOGUE}
    out = {}
    for s in series:
        base = s.name
        for suffix in STATS[1:]:
            base = base.removesuffix(suffix)
        f = by_field.get(base)
        if f is not None:
            out[s.name] = Family(s.name, f.help, f.prometheus_type, f.unit)
    return out


def load_baseline(root: Path) -> tuple[ModuleType, ModuleType]:
    """The baseline's ``encoder`` and ``encoder_v2`` modules, imported from ``root`` into this
    process beside today's: ``hfsampler.remote_write`` looks in the baseline's folder while they
    (and the siblings they import, bound at import time) load, then everything is put back."""
    package = importlib.import_module("hfsampler.remote_write")
    names = ("encoder", "encoder_v2", "wire")
    saved_path = list(package.__path__)
    saved = {n: sys.modules.pop(f"hfsampler.remote_write.{n}", None) for n in names}
    saved_attrs = {n: getattr(package, n, None) for n in names}
    package.__path__[:] = [str(root / "hfsampler" / "remote_write")]
    try:
        old = importlib.import_module("hfsampler.remote_write.encoder")
        old_v2 = importlib.import_module("hfsampler.remote_write.encoder_v2")
    finally:
        package.__path__[:] = saved_path
        for n in names:
            sys.modules.pop(f"hfsampler.remote_write.{n}", None)
            if saved[n] is not None:
                sys.modules[f"hfsampler.remote_write.{n}"] = saved[n]  # type: ignore[assignment]
            if saved_attrs[n] is not None:
                setattr(package, n, saved_attrs[n])
            elif hasattr(package, n):
                delattr(package, n)
    if not str(old.__file__).startswith(str(root)):
        raise SystemExit(f"--baseline: loaded {old.__file__}, not from {root}")
    return old, old_v2


Side = Callable[[int], tuple[int, list[tuple[int, int]]]]  # window -> (samples, (raw, comp)...)


def sides(
    series: list[Series], baseline: tuple[ModuleType, ModuleType] | None
) -> tuple[dict[str, Side], list[list[list[QueuedSample]]]]:
    """Each side's work for one window (its requests written and compressed)."""
    vals = windows(series, N_WINDOWS)
    stamps = [1_764_000_000_000 + 1000 * w for w in range(N_WINDOWS)]
    chunks = []
    for w in range(N_WINDOWS):
        window = [QueuedSample(s, v, stamps[w]) for s, v in zip(series, vals[w], strict=True)]
        chunks.append([window[i : i + BATCH] for i in range(0, len(window), BATCH)])
    families = families_of(series)
    enc = Encoder()
    v1 = RequestEncoderV1()
    v2 = RequestEncoderV2(lambda: families)
    sizes = Sizer()

    def new_v1(w: int) -> tuple[int, list[tuple[int, int]]]:
        out = []
        for chunk in chunks[w]:
            raw = v1.encode(enc.block(chunk))
            out.append((len(raw), len(compress(raw))))
        return len(series), out

    def new_v2(w: int) -> tuple[int, list[tuple[int, int]]]:
        out = []
        for chunk in chunks[w]:
            block = enc.block(chunk)
            sizes(block)  # delivery measures a 2.0 request as 1.0 against its size limit
            raw = v2.encode(block)[0]
            out.append((len(raw), len(compress(raw))))
        return len(series), out

    out: dict[str, Side] = {"new 1.0": new_v1, "new 2.0": new_v2}
    if baseline is not None:
        old, old_v2_module = baseline
        old_enc = old.Encoder()
        old_v2 = old_v2_module.RequestEncoderV2(lambda: families)

        def old_v1(w: int) -> tuple[int, list[tuple[int, int]]]:
            res = []
            for chunk in chunks[w]:
                raw = old_enc.encode_samples(chunk)
                res.append((len(raw), len(old.compress(raw))))
            return len(series), res

        def old_v2_side(w: int) -> tuple[int, list[tuple[int, int]]]:
            res = []
            for chunk in chunks[w]:
                raw = old_v2.encode(old_enc.encode_samples(chunk))[0]
                res.append((len(raw), len(old.compress(raw))))
            return len(series), res

        out["old 1.0"] = old_v1
        out["old 2.0"] = old_v2_side
        _cross_check(chunks[:2], families, old, old_v2_module)
    return out, chunks


def _cross_check(
    windows: list[list[list[QueuedSample]]], families: dict[str, Family], old: Any, old_v2: Any
) -> None:
    """New and old write the same bytes for the same windows (the second from the templates
    the first left): both sides do the same work."""
    enc, v1, v2 = Encoder(), RequestEncoderV1(), RequestEncoderV2(lambda: families)
    old_enc, old_v2_enc = old.Encoder(), old_v2.RequestEncoderV2(lambda: families)
    for chunks in windows:
        for chunk in chunks:
            block = enc.block(chunk)
            want = old_enc.encode_samples(chunk)
            if not write_request(block) == v1.encode(block) == want:
                raise SystemExit("cross-check failed: new and old 1.0 bytes differ")
            if v2.encode(block)[0] != old_v2_enc.encode(want)[0]:
                raise SystemExit("cross-check failed: new and old 2.0 bytes differ")


def measure(
    name: str, series: list[Series], baseline: Any, rounds: int, slice_s: float
) -> list[dict[str, Any]]:
    work, _ = sides(series, baseline)
    names = list(work)
    rates: dict[str, list[float]] = {n: [] for n in names}
    sizes = {n: work[n](0)[1] for n in names}  # also warms each side's caches
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            fn = work[n]
            samples = 0
            w = 0
            start = time.perf_counter()
            while (elapsed := time.perf_counter() - start) < slice_s or w < 1:
                samples += fn(w % N_WINDOWS)[0]
                w += 1
            rates[n].append(samples / elapsed)
    rows = []
    for n in names:
        raw = sum(a for a, _ in sizes[n])
        comp = sum(b for _, b in sizes[n])
        rows.append(
            {
                "case": name,
                "series": len(series),
                "side": n,
                "samples_per_s": statistics.median(rates[n]),
                "spread": [min(rates[n]), max(rates[n])],
                "rounds": rounds,
                "raw_bytes_per_sample": raw / len(series),
                "compressed_bytes_per_sample": comp / len(series),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/encode.json", help="JSON result path")
    parser.add_argument("--baseline", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (median)")
    parser.add_argument("--slice", type=float, default=0.3, help="seconds per side per round")
    args = parser.parse_args(argv)
    baseline = load_baseline(args.baseline.resolve()) if args.baseline else None
    reg = SeriesRegistry()
    dcgm = dcgm_series(reg)
    cases = [
        (f"dcgm 8 GPUs x {len(FIELDS)} fields x {len(STATS)} stats", dcgm),
        ("10k series", many_series(reg, 10_000)),
    ]
    rows = [r for name, s in cases for r in measure(name, s, baseline, args.rounds, args.slice)]
    header = (
        f"{'case':34} {'series':>6} {'side':8} {'samples/s':>11} {'spread':>19} "
        f"{'raw B/s.':>8} {'snappy B/s.':>11} {'vs new 1.0':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ref = next(x for x in rows if x["case"] == r["case"] and x["side"] == "new 1.0")
        lo, hi = r["spread"]
        print(
            f"{r['case']:34} {r['series']:>6} {r['side']:8} {r['samples_per_s']:>11,.0f} "
            f"{lo:>9,.0f}-{hi:<9,.0f} {r['raw_bytes_per_sample']:>8.1f} "
            f"{r['compressed_bytes_per_sample']:>11.2f} "
            f"{r['samples_per_s'] / ref['samples_per_s']:>9.2f}x"
        )
    print(
        f"\nmedian of {args.rounds} alternating rounds of {args.slice} s per side; requests of at"
        f" most {BATCH} samples, snappy block format, one process"
        + (f"; old = {args.baseline}" if baseline else "; no --baseline: new sides only")
    )
    if baseline:
        print("cross-check passed: new and old write the same 1.0 bytes and the same 2.0 bytes")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "batch_samples": BATCH,
                "baseline": str(args.baseline) if baseline else None,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

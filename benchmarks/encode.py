"""Benchmark: Remote-Write 1.0 and 2.0 encode + snappy against a Python peer, alternating sides.

Two series sets, each named in the table by what it holds and how many series that makes:
(a) dcgm-exporter's labels on 8 GPUs x every NVML device field of the catalogue (``FIELDS``;
per-link NVLink fields left out: ``benchmarks/nvlink.py`` measures those) x a gauge's 4
statistics (mean, min, max, p99): 32 series per catalogue field, 1,504 with today's 47 (the
"1k" set); (b) exactly 10,000 series: 8 GPUs x 1,250 names, with ``gpu``, ``Hostname`` and
``job`` labels (the "10k" set). Each window (one sample per series) is cut into requests of at
most ``BATCH`` samples (``max_samples_per_send``), each written and snappy-compressed, as a writer
sends a window; label caches are warm, as they are from a running writer's second window on.

Sides, all from the same windows (built outside the timed region, in each side's own input form):
- ``hfsampler 1.0``: what ``intake`` and ``delivery`` do per request: each series' cached
  ``Labels`` (``Encoder.labels``) into a block (``Block.of``), ``RequestEncoderV1.encode`` and
  ``compress``;
- ``hfsampler 2.0``: the same block, ``Sizer`` (delivery's size check, as 1.0),
  ``RequestEncoderV2.encode`` and ``compress``;
- ``peer 1.0``: PyPI's ``prometheus-remote-writer`` (``RemoteWriter.send``: protobuf message
  objects on the upb runtime, batches of ``BATCH`` series, snappy) with its HTTP post left out;
- ``peer 2.0``: that package ships no 2.0 encoder, so this is its ``send`` path written for 2.0
  the same way (message objects from hfsampler's generated ``writev2_pb2`` on the same runtime, a
  symbol table per request, each series' metadata): what a straightforward Python 2.0 writer costs;
- ``hfsampler 1.0+hist`` and ``hfsampler 2.0+hist`` (the 1k set only; ``hist_sides``): the same
  window with, per GPU, a native histogram of instant power beside it (issue 26), each one's
  message body made per window as at push; the table after the main one gives bytes per window
  per GPU and CPU per window with and without, from the same alternating rounds;
- with ``--baseline DIR`` (another commit's ``hfsampler/``, e.g. ``git archive COMMIT hfsampler |
  tar -x -C DIR``): ``old 1.0`` and ``old 2.0``, the same work by its encoding modules, imported
  from DIR into this process; a commit from before blocks (``d7da83e``) as its service did it:
  ``Encoder.encode_samples``, and 2.0 turned from those 1.0 bytes at send time.

The peer (``rw_peer``, beside this script) is imported from the environment or ``--peer-path``
(default ``~/.cache/hfsampler-bench/remote-writer``; ``rw_peer.PEER_INSTALL`` installs it there);
without it the peer sides are left out and the output's first and last lines say so.

Fairness: every side runs in one process on the same windows. In each of ``--rounds`` rounds
every side takes one turn, in an order rotated from round to round; a turn is as many whole
windows as take about ``--turn`` seconds (counted once before timing; a peer's window takes
longer, so its turn is one window), starting at the same window for every side in a round. A
side's rate is the median of its turns, its spread the lowest and highest; a ratio between two
sides is the median (and lowest) of the ratios of their turns in the same round, so load that
comes and goes on the shared machine falls on both sides of it.

Before timing, every side's requests of the first two windows are decompressed and read back
with the protobuf library: each must hold the same series, samples and (for 2.0) metadata as
hfsampler's, and hfsampler's 2.0 requests are checked for the spec's MUSTs (``symbols[0]`` empty,
each string once, label references in byte order of name); old and new bytes must be equal.
Prints a table and writes JSON.
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

from hist_sides import (
    SUFFIX,
    hist_sides,
    histogram_series,
    histogram_windows,
    print_window_table,
    without_histograms,
)
from rw_peer import PEER_PATH, Side, load_peer, peer_sides  # beside this script

from hfsampler.export.metrics import gpu_labels, host_labels
from hfsampler.fields import CATALOGUE, Kind
from hfsampler.remote_write import blocks, encoder, encoder_v2
from hfsampler.remote_write.encoder import QueuedSample
from hfsampler.remote_write.prompb import writev2_pb2
from hfsampler.sampling.window import suffixes
from hfsampler.series import Family, Series, SeriesRegistry
from hfsampler.sources.base import DeviceInfo

BATCH = 2000  # Prometheus's default max_samples_per_send
N_WINDOWS = 8
GPUS = 8
STATS = suffixes(Kind.GAUGE)  # a gauge's series, for every field alike
CURRENT = {"blocks": blocks, "encoder": encoder, "encoder_v2": encoder_v2}  # this tree's
FIELDS = [f.name for f in CATALOGUE if (f.nvml_field or f.nvml_call) and f.per is None]
# Pairs whose per-round ratio the table gives: (side, the side it is measured against).
RATIOS = (
    ("hfsampler 1.0", "peer 1.0"),
    ("hfsampler 2.0", "peer 2.0"),
    ("hfsampler 2.0", "hfsampler 1.0"),
    ("hfsampler 1.0", "old 1.0"),
    ("hfsampler 2.0", "old 2.0"),
    (f"hfsampler 1.0{SUFFIX}", "hfsampler 1.0"),
    (f"hfsampler 2.0{SUFFIX}", "hfsampler 2.0"),
)


def dcgm_series(reg: SeriesRegistry) -> list[Series]:
    out = []
    host = host_labels("dgx-h100-rack12-node07", instance="")
    for gpu in range(GPUS):
        uuid = f"GPU-{random.Random(gpu).getrandbits(128):032x}"
        pci = f"00000000:{0x18 + 0x10 * gpu:02X}:00.0"
        device = DeviceInfo(gpu, uuid, "NVIDIA H100 80GB HBM3", pci, "550.54.15", gpu)
        labels = gpu_labels(device, host)
        for fld in FIELDS:
            for suffix in STATS:
                out.append(reg.series(fld + suffix, labels))
    return out


def many_series(reg: SeriesRegistry, n: int) -> list[Series]:
    """``n`` series (a multiple of ``GPUS``): per GPU, ``n // GPUS`` of them, 50 hosts a name."""
    per_gpu = n // GPUS
    out = []
    for gpu in range(GPUS):
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


def load_baseline(root: Path) -> dict[str, ModuleType]:
    """The baseline's encoding modules (``encoder``, ``encoder_v2`` and the siblings they import,
    where it has them), imported from ``root`` into this process beside today's: while they load,
    ``hfsampler.remote_write`` looks in the baseline's folder; then everything is put back."""
    package = importlib.import_module("hfsampler.remote_write")
    names = ("protowrite", "wire", "arrays", "blocks", "encoder", "encoder_v2")
    folder = root / "hfsampler" / "remote_write"
    saved_path = list(package.__path__)
    saved = {n: sys.modules.pop(f"hfsampler.remote_write.{n}", None) for n in names}
    saved_attrs = {n: getattr(package, n, None) for n in names}
    package.__path__[:] = [str(folder)]
    old: dict[str, ModuleType] = {}
    try:
        for n in names:
            if (folder / f"{n}.py").exists():
                old[n] = importlib.import_module(f"hfsampler.remote_write.{n}")
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
    if not str(old["encoder"].__file__).startswith(str(root)):
        raise SystemExit(f"--baseline: loaded {old['encoder'].__file__}, not from {root}")
    return old


Chunks = list[list[tuple[list[Series], list[float]]]]  # per window, each request's series, values


def block_sides(prefix: str, mods: dict[str, ModuleType], chunks: Chunks, stamps: list[int],
                families: dict[str, Family]) -> dict[str, Side]:  # fmt: skip
    """``PREFIX 1.0`` and ``PREFIX 2.0`` from the encoding modules ``mods``: a window's requests
    as the service makes them. ``intake`` looks up each series' cached ``Labels`` and makes a
    block per request (``Block.of``); ``delivery`` writes it as 1.0 (``RequestEncoderV1``) or
    measures it as 1.0 (``Sizer``) and writes it as 2.0, then compresses it."""
    enc = mods["encoder"].Encoder()
    block_of = mods["blocks"].Block.of
    sizes = mods["blocks"].Sizer()
    compress_ = mods["encoder"].compress
    v1 = mods["encoder"].RequestEncoderV1()
    v2 = mods["encoder_v2"].RequestEncoderV2(lambda: families)

    def blocks(w: int) -> list[Any]:
        ts = stamps[w]
        return [block_of(list(map(enc.labels, s)), ts, v) for s, v in chunks[w]]

    def side_v1(w: int) -> list[bytes]:
        return [compress_(v1.encode(block)) for block in blocks(w)]

    def side_v2(w: int) -> list[bytes]:
        out = []
        for block in blocks(w):
            sizes(block)  # delivery measures a 2.0 request as 1.0 against its size limit
            out.append(compress_(v2.encode(block)[0]))
        return out

    return {f"{prefix} 1.0": side_v1, f"{prefix} 2.0": side_v2}


def old_sides(old: dict[str, ModuleType], chunks: Chunks, stamps: list[int],
              families: dict[str, Family]) -> dict[str, Side]:  # fmt: skip
    """``old 1.0`` and ``old 2.0``: the baseline's work for a window, as its service did it."""
    if "blocks" in old:
        return block_sides("old", old, chunks, stamps, families)
    # before blocks: requests written from queued samples, 2.0 made from the 1.0 bytes
    samples = [
        [[QueuedSample(*sv, stamps[w]) for sv in zip(*chunk, strict=True)] for chunk in window]
        for w, window in enumerate(chunks)
    ]
    enc = old["encoder"].Encoder()
    v2 = old["encoder_v2"].RequestEncoderV2(lambda: families)
    compress_ = old["encoder"].compress
    return {
        "old 1.0": lambda w: [compress_(enc.encode_samples(c)) for c in samples[w]],
        "old 2.0": lambda w: [compress_(v2.encode(enc.encode_samples(c))[0]) for c in samples[w]],
    }


def sides(
    series: list[Series],
    baseline: dict[str, ModuleType] | None,
    peer: ModuleType | None,
    hists: list[Series] | None = None,
) -> dict[str, Side]:
    """Each side's work for one window: its requests written and compressed."""
    vals = windows(series, N_WINDOWS)
    stamps = [1_764_000_000_000 + 1000 * w for w in range(N_WINDOWS)]
    chunks = [
        [(series[i : i + BATCH], vals[w][i : i + BATCH]) for i in range(0, len(series), BATCH)]
        for w in range(N_WINDOWS)
    ]
    families = families_of(series)
    out = block_sides("hfsampler", CURRENT, chunks, stamps, families)
    if hists:
        snapshots = histogram_windows(GPUS, N_WINDOWS)
        out |= hist_sides(chunks, stamps, families, hists, snapshots)
    if peer is not None:
        out |= peer_sides(peer, series, vals, stamps, families, BATCH)
    if baseline is not None:
        out |= old_sides(baseline, chunks, stamps, families)
    return out


def read_v1(raw: bytes, peer: ModuleType | None) -> list[object]:
    """A 1.0 request as what a receiver stores: each series' labels and samples. Read with the
    peer's generated module when it is loaded: the protobuf runtime's default pool refuses a
    second ``prometheus.WriteRequest`` (hfsampler's ``prompb.remote_pb2``, the same message)."""
    if peer is None:
        from hfsampler.remote_write.prompb import remote_pb2

        req = remote_pb2.WriteRequest.FromString(raw)
    else:
        req = peer.WriteRequest.FromString(raw)
    return [
        (
            [(label.name, label.value) for label in ts.labels],
            [(s.value, s.timestamp) for s in ts.samples],
        )
        for ts in req.timeseries
    ]


def read_v2(raw: bytes, *, strict: bool) -> list[object]:
    """A 2.0 request as what a receiver stores: each series' labels, samples and metadata;
    ``strict``: also hold it to the spec's MUSTs for the symbol table and label order."""
    req = writev2_pb2.Request.FromString(raw)
    sym = list(req.symbols)
    if strict and (not sym or sym[0] != "" or len(set(sym)) != len(sym)):
        raise SystemExit("cross-check failed: symbols[0] is not empty, or a string comes twice")
    out: list[object] = []
    for ts in req.timeseries:
        refs = list(ts.labels_refs)
        labels = [(sym[refs[i]], sym[refs[i + 1]]) for i in range(0, len(refs), 2)]
        names = [n.encode() for n, _ in labels]
        if strict and names != sorted(names):
            raise SystemExit("cross-check failed: 2.0 label references not in byte order of name")
        samples = [(s.value, s.timestamp, s.start_timestamp) for s in ts.samples]
        meta = (ts.metadata.type, sym[ts.metadata.help_ref], sym[ts.metadata.unit_ref])
        out.append((labels, samples, meta))
    return out


def cross_check(
    work: dict[str, Side], decompress: Callable[[bytes], bytes], peer: ModuleType | None
) -> dict[str, int]:
    """Every side's requests for the first two windows (the second from what the first left
    cached) hold what hfsampler's do; old and new bytes are equal. Returns each side's raw
    (uncompressed) bytes for window 0."""
    raw_bytes = {}
    for w in range(2):
        got = {n: [decompress(r) for r in fn(w)] for n, fn in work.items()}
        raw_bytes = raw_bytes or {n: sum(map(len, reqs)) for n, reqs in got.items()}
        want = {
            "1.0": [read_v1(r, peer) for r in got["hfsampler 1.0"]],
            "2.0": [read_v2(r, strict=True) for r in got["hfsampler 2.0"]],
        }
        for name, reqs in got.items():
            version = name.split()[-1].removesuffix(SUFFIX)
            read = [
                read_v1(r, peer) if version == "1.0" else read_v2(r, strict=False) for r in reqs
            ]
            if name.endswith(SUFFIX):
                stripped = [without_histograms(r) for r in read]
                read = [r for r, _ in stripped]
                if sum(n for _, n in stripped) != GPUS:
                    raise SystemExit(f"cross-check failed: {name} lacks a GPU's histogram")
            if read != want[version]:
                raise SystemExit(f"cross-check failed: {name} holds other series or samples")
            if name.startswith("old") and reqs != got[f"hfsampler {version}"]:
                raise SystemExit(f"cross-check failed: {name} and hfsampler {version} bytes differ")
    return raw_bytes


def measure(
    name: str,
    work: dict[str, Side],
    samples: int,
    rounds: int,
    turn_s: float,
    raw: dict[str, int],
    extra: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Each side's rate over ``rounds`` rounds of one turn each (rotated order), its bytes
    per sample, and the per-round ratios of ``RATIOS``. A turn is as many whole windows as take
    about ``turn_s`` (counted once, before timing; at least one). ``extra``: samples a side's
    window has beyond ``samples`` (its histograms)."""
    extra = extra or {}
    names = list(work)
    rates: dict[str, list[float]] = {n: [] for n in names}
    compressed: dict[str, int] = {}
    reps: dict[str, int] = {}
    for n in names:  # also warms each side's caches
        start = time.perf_counter()
        compressed[n] = sum(map(len, work[n](0)))
        reps[n] = max(1, round(turn_s / (time.perf_counter() - start)))
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            fn, count = work[n], reps[n]
            start = time.perf_counter()
            for w in range(r, r + count):  # the same windows for every side in a round
                fn(w % N_WINDOWS)
            rates[n].append((samples + extra.get(n, 0)) * count / (time.perf_counter() - start))
    rows = []
    for n in names:
        row: dict[str, Any] = {
            "case": name,
            "series": samples + extra.get(n, 0),
            "side": n,
            "samples_per_s": statistics.median(rates[n]),
            "spread": [min(rates[n]), max(rates[n])],
            "rates": rates[n],
            "rounds": rounds,
            "windows_per_turn": reps[n],
            "raw_bytes_per_sample": raw[n] / (samples + extra.get(n, 0)),
            "compressed_bytes_per_sample": compressed[n] / (samples + extra.get(n, 0)),
            "ratios": {},
        }
        for side, other in RATIOS:
            if side == n and other in rates:
                per_round = [a / b for a, b in zip(rates[n], rates[other], strict=True)]
                row["ratios"][other] = {
                    "median": statistics.median(per_round),
                    "lowest": min(per_round),
                    "highest": max(per_round),
                }
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'side':13} {'samples/s':>11} {'spread':>21} {'raw B/s.':>8} {'snappy B/s.':>11}"
        "  per-round ratio: median (lowest)"
    )
    case = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            print(f"\n{case}\n{header}\n{'-' * len(header)}")
        lo, hi = r["spread"]
        ratios = ", ".join(
            f"{v['median']:.2f}x ({v['lowest']:.2f}x) vs {other}"
            for other, v in r["ratios"].items()
        )
        print(
            f"{r['side']:13} {r['samples_per_s']:>11,.0f} {lo:>10,.0f}-{hi:<10,.0f}"
            f" {r['raw_bytes_per_sample']:>8.1f} {r['compressed_bytes_per_sample']:>11.2f}"
            f"  {ratios}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/encode.json", help="JSON result path")
    parser.add_argument("--baseline", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument(
        "--peer-path",
        type=Path,
        default=PEER_PATH,
        help=f"where prometheus-remote-writer is installed (default {PEER_PATH})",
    )
    parser.add_argument("--no-peer", action="store_true", help="leave the peer sides out")
    parser.add_argument("--rounds", type=int, default=31, help="alternating rounds (median)")
    parser.add_argument("--turn", type=float, default=0.02, help="about how long a turn takes, s")
    args = parser.parse_args(argv)
    baseline = load_baseline(args.baseline.resolve()) if args.baseline else None
    peer, peer_line = (None, "peer sides left out (--no-peer)")
    if not args.no_peer:
        peer, peer_line = load_peer(args.peer_path)
    print(peer_line, flush=True)
    import snappy  # the project's own dependency: what every side compresses with

    reg = SeriesRegistry()
    cases = [
        (f"{GPUS} GPUs x {len(FIELDS)} fields x {len(STATS)} stats", dcgm_series(reg)),
        (f"{GPUS} GPUs x 1,250 names (3 labels)", many_series(reg, 10_000)),
    ]
    rows = []
    for i, (name, series) in enumerate(cases):
        label = f"{len(series):,} series: {name}"
        hists = histogram_series(reg, series) if i == 0 else None
        work = sides(series, baseline, peer, hists)
        raw_bytes = cross_check(work, snappy.decompress, peer)
        extra = {n: GPUS for n in work if n.endswith(SUFFIX)}
        rows += measure(label, work, len(series), args.rounds, args.turn, raw_bytes, extra)
    print_table(rows)
    print_window_table(rows, GPUS)
    print(
        f"\nmedian of {args.rounds} alternating rounds, one turn of whole windows (about"
        f" {args.turn} s, at least one window) per side each; requests of at"
        f" most {BATCH} samples, snappy block format, one process"
        + (f"; old = {args.baseline}" if baseline else "")
    )
    print(
        "cross-check passed: every side's requests hold hfsampler's series, samples and 2.0"
        " metadata; hfsampler's 2.0 meets the spec's symbol and label-order MUSTs"
        + ("; old and new bytes equal" if baseline else "")
    )
    print(peer_line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "batch_samples": BATCH,
                "baseline": str(args.baseline) if baseline else None,
                "peer": peer_line,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

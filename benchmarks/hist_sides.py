"""encode.py's native-histogram sides: the dcgm set's window with, per GPU, a cumulative native
histogram of instant power (``DCGM_FI_DEV_POWER_USAGE_histogram``, schema 3: about 5%), written
as intake and delivery write it: each histogram's message body (``histwrite.histogram_body``, made
at push), the block with the float series (``Block.of(..., hist=...)``), 1.0 or 2.0, snappy.

The histograms are steady-state ones: ``WARM_WINDOWS`` windows of ``SAMPLES_PER_WINDOW`` power
samples each (a seeded mix of idle, busy and spikes, as a training job draws) are counted before
the timed windows, so their buckets span what a running GPU's do; each timed window adds one more
(outside the timed region: counting is the sampling half's work, not the encoder's).
``print_window_table`` gives their bytes per window per GPU and CPU per window beside the same
protocol's without histograms.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from hfsampler.histograms import HistogramAccumulator, NativeHistogram, add_window
from hfsampler.remote_write import blocks, encoder, encoder_v2
from hfsampler.remote_write.histwrite import histogram_body
from hfsampler.series import Family, Series, SeriesRegistry

SUFFIX = "+hist"
HISTOGRAM = "DCGM_FI_DEV_POWER_USAGE_histogram"
FAMILY = Family(HISTOGRAM, "Power draw (in W), every sample of the window.", "histogram")
SAMPLES_PER_WINDOW = 1000  # a 1 s window at 1 kHz
WARM_WINDOWS = 600  # ten minutes of a running job
SCHEMA = 3

Side = Callable[[int], list[bytes]]


def histogram_windows(gpus: int, windows: int, seed: int = 26) -> list[list[NativeHistogram]]:
    """Per timed window, each GPU's cumulative histogram after it."""
    rng = np.random.default_rng(seed)
    accs = [HistogramAccumulator(SCHEMA) for _ in range(gpus)]

    def window() -> np.ndarray[Any, np.dtype[np.float64]]:
        shape = (SAMPLES_PER_WINDOW, gpus)
        busy = rng.random(shape) < 0.7
        watts = np.where(busy, rng.normal(520, 40, shape), rng.normal(90, 8, shape))
        spikes = rng.random(shape) < 0.002
        return np.round(np.where(spikes, rng.uniform(650, 700, shape), watts).clip(1), 3)

    for _ in range(WARM_WINDOWS):
        add_window(accs, window())
    out = []
    for _ in range(windows):
        add_window(accs, window())
        out.append([acc.snapshot() for acc in accs])
    return out


def histogram_series(reg: SeriesRegistry, series: list[Series]) -> list[Series]:
    """One histogram series per GPU, with the labels of that GPU's power series."""
    power = [s for s in series if s.name == "DCGM_FI_DEV_POWER_USAGE"]
    return [reg.series(HISTOGRAM, dict(s.labels)) for s in power]


def hist_sides(
    chunks: list[list[tuple[list[Series], list[float]]]],
    stamps: list[int],
    families: dict[str, Family],
    hists: list[Series],
    snapshots: list[list[NativeHistogram]],
) -> dict[str, Side]:
    """``hfsampler 1.0+hist`` and ``hfsampler 2.0+hist``: encode.py's ``block_sides`` with the
    histogram series in the window's last request, their bodies made per window as at push."""
    enc = encoder.Encoder()
    sizes = blocks.Sizer()
    v1 = encoder.RequestEncoderV1()
    all_families = {**families, HISTOGRAM: FAMILY}
    v2 = encoder_v2.RequestEncoderV2(lambda: all_families)

    def window_blocks(w: int) -> list[blocks.Block]:
        ts = stamps[w]
        out = []
        last = len(chunks[w]) - 1
        for i, (series, values) in enumerate(chunks[w]):
            labels = list(map(enc.labels, series))
            if i != last:
                out.append(blocks.Block.of(labels, ts, values))
                continue
            bodies = [b""] * len(series) + [histogram_body(h) for h in snapshots[w]]
            labels += map(enc.labels, hists)
            vals = [*values, *(float(h.count) for h in snapshots[w])]
            out.append(blocks.Block.of(labels, ts, vals, hist=bodies))
        return out

    def side_v1(w: int) -> list[bytes]:
        return [encoder.compress(v1.encode(block)) for block in window_blocks(w)]

    def side_v2(w: int) -> list[bytes]:
        out = []
        for block in window_blocks(w):
            sizes(block)
            out.append(encoder.compress(v2.encode(block)[0]))
        return out

    return {f"hfsampler 1.0{SUFFIX}": side_v1, f"hfsampler 2.0{SUFFIX}": side_v2}


def without_histograms(read: list[Any]) -> tuple[list[Any], int]:
    """A request read back (encode.py's ``read_v1``/``read_v2`` entries) without its series
    that carry no float sample (the histogram ones), and how many those were."""
    kept = [entry for entry in read if entry[1]]
    return kept, len(read) - len(kept)


def print_window_table(rows: list[dict[str, Any]], gpus: int) -> None:
    """Per window and GPU, the bytes of the sides with a power histogram and without (the 1k
    set), and the CPU per window: the median turn's, and the per-round ratio."""
    cases = [r["case"] for r in rows if r["side"].endswith(SUFFIX)]
    by_side = {r["side"]: r for r in rows if cases and r["case"] == cases[0]}
    pairs = [(f"hfsampler {v}", f"hfsampler {v}{SUFFIX}") for v in ("1.0", "2.0")]
    if not all(a in by_side and b in by_side for a, b in pairs):
        return
    header = (
        f"{'side':18} {'raw B/window/GPU':>16} {'snappy B/window/GPU':>19} {'CPU/window':>11}"
        "  per-round CPU ratio: median (lowest-highest)"
    )
    print(f"\n{by_side[pairs[0][0]]['case']}, with a power histogram per GPU\n{header}")
    print("-" * len(header))
    for plain, hist in pairs:
        for side in (plain, hist):
            r = by_side[side]
            n = r["series"]
            per_window_s = [n / rate for rate in r["rates"]]
            ratio = ""
            if side == hist:
                base = by_side[plain]
                base_s = [base["series"] / rate for rate in base["rates"]]
                per_round = [a / b for a, b in zip(per_window_s, base_s, strict=True)]
                ratio = (
                    f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-"
                    f"{max(per_round):.2f}) vs {plain}"
                )
            print(
                f"{side:18} {r['raw_bytes_per_sample'] * n / gpus:>16,.0f}"
                f" {r['compressed_bytes_per_sample'] * n / gpus:>19,.0f}"
                f" {statistics.median(per_window_s) * 1e6:>9,.0f}us  {ratio}"
            )

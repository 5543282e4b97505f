"""Snapshots with native histograms, made as the sampling half makes them (issue 26's interface):
per GPU a float series ``DCGM_FI_DEV_POWER_USAGE`` (the window's mean) and a histogram series
``DCGM_FI_DEV_POWER_USAGE_histogram`` (every sample so far, cumulative), from known samples, so a
test can compare what a receiver answers with the exact quantiles of those samples."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from hfsampler.histograms import HistogramAccumulator
from hfsampler.series import Family, Series, SeriesRegistry, Snapshot

POWER = "DCGM_FI_DEV_POWER_USAGE"
HISTOGRAM = f"{POWER}_histogram"
FAMILIES = {
    POWER: Family(POWER, "Power draw (in W).", "gauge"),
    HISTOGRAM: Family(HISTOGRAM, "Power draw (in W), every sample of the window.", "histogram"),
}


class PowerWindows:
    """Windows of ``samples_per_window`` known power samples per GPU (a seeded mix of idle,
    busy and spikes), the histograms cumulative from the first window (reset hint YES)."""

    def __init__(
        self,
        gpus: int = 2,
        samples_per_window: int = 1000,
        seed: int = 26,
        schema: int = 3,
        extra_labels: dict[str, str] | None = None,
    ) -> None:
        self.registry = SeriesRegistry()
        labels = [{"gpu": str(g), "UUID": f"GPU-{g}", **(extra_labels or {})} for g in range(gpus)]
        self.floats: list[Series] = [self.registry.series(POWER, lb) for lb in labels]
        self.hist_series: list[Series] = [self.registry.series(HISTOGRAM, lb) for lb in labels]
        self.accumulators = [HistogramAccumulator(schema) for _ in range(gpus)]
        self.samples_per_window = samples_per_window
        self.every: list[list[npt.NDArray[np.float64]]] = [[] for _ in range(gpus)]
        self._rng = np.random.default_rng(seed)

    def _power(self) -> npt.NDArray[np.float64]:
        n = self.samples_per_window
        busy = self._rng.random(n) < 0.7
        watts = np.where(busy, self._rng.normal(520, 40, n), self._rng.normal(90, 8, n))
        spikes = self._rng.random(n) < 0.002
        return np.round(np.where(spikes, self._rng.uniform(650, 700, n), watts).clip(1), 3)

    def window(self, timestamp_ms: int) -> Snapshot:
        """The next window's snapshot at ``timestamp_ms``."""
        values = []
        histograms = []
        for g, acc in enumerate(self.accumulators):
            power = self._power()
            self.every[g].append(power)
            acc.add(power)
            values.append(float(power.mean()))
            histograms.append((self.hist_series[g], acc.snapshot()))
        return Snapshot(timestamp_ms, self.floats, values, FAMILIES, histograms)

    def windows(self, first_ms: int, count: int, step_ms: int = 1000) -> Iterator[Snapshot]:
        for i in range(count):
            yield self.window(first_ms + i * step_ms)

    def all_samples(self, from_window: int = 0) -> npt.NDArray[np.float64]:
        """Every sample of every GPU so far, from window ``from_window`` (0: the first) on."""
        return np.concatenate([p for per_gpu in self.every for p in per_gpu[from_window:]])

"""Fake GPUs whose power is known every millisecond, and the exact energy of any span.

Each GPU's instant power is a table of one value per millisecond from ``start_ns`` on (a
baseline that moves every millisecond, plus any ``spike`` a test adds), served by the fake NVML
with a 1 ms refresh: the driver holds each value for its millisecond, so the truth of a span is
the sum of the values times their overlap with it. The energy counter is the same power
integrated, refreshed every ``counter_period_us`` (about 100 ms on real GPUs, as Zeus's
counter-difference method sees it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pynvml
from fake_nvml import FakeNvml, FakeReading, standard_gpu

FloatArray = npt.NDArray[np.float64]
MS_NS = 1_000_000
SW_POWER_CAP = 0x4


@dataclass
class KnownPower:
    """``gpus`` GPUs over ``seconds`` from ``start_ns`` (a whole millisecond)."""

    start_ns: int
    seconds: float
    gpus: int = 2
    counter_period_us: int = 100_000
    seed: int = 0
    power_w: FloatArray = field(init=False)  # [gpu, ms]
    throttled: npt.NDArray[np.bool_] = field(init=False)  # [gpu, ms]: SW power cap

    def __post_init__(self) -> None:
        assert self.start_ns % MS_NS == 0
        n = int(self.seconds * 1000)
        rng = np.random.default_rng(self.seed)
        ms = np.arange(n)
        self.power_w = np.stack([
            250.0 + 30.0 * g + 20.0 * np.sin(ms / (37.0 + g)) + rng.uniform(-5, 5, n)
            for g in range(self.gpus)
        ])  # fmt: skip
        self.throttled = np.zeros((self.gpus, n), np.bool_)

    def ms(self, t_ns: int) -> int:
        return (t_ns - self.start_ns) // MS_NS

    def spike(self, gpu: int, at_ns: int, length_ms: int, peak_w: float) -> None:
        k = self.ms(at_ns)
        self.power_w[gpu, k : k + length_ms] = peak_w

    def throttle(self, gpu: int, at_ns: int, length_ms: int) -> None:
        k = self.ms(at_ns)
        self.throttled[gpu, k : k + length_ms] = True

    def truth_j(self, gpu: int, t0_ns: int, t1_ns: int) -> float:
        """The exact energy of ``[t0_ns, t1_ns)``: each millisecond's power times its overlap."""
        edges = self.start_ns + np.arange(self.power_w.shape[1] + 1) * MS_NS
        overlap = np.clip(np.minimum(edges[1:], t1_ns) - np.maximum(edges[:-1], t0_ns), 0, None)
        return float((self.power_w[gpu] * overlap).sum() / 1e9)

    # -- what the fake driver answers, by driver timestamp (µs) --------------------------------

    def _at(self, ts_us: int) -> int:
        return min(max(0, (ts_us * 1000 - self.start_ns) // MS_NS), self.power_w.shape[1] - 1)

    def power_mw(self, gpu: int, ts_us: int) -> float:
        if ts_us * 1000 < self.start_ns:
            return float(self.power_w[gpu, 0] * 1e3)
        return float(round(self.power_w[gpu, self._at(ts_us)] * 1e3))

    def energy_mj(self, gpu: int, ts_us: int) -> float:
        """The counter: power integrated up to ``ts_us``, in whole mJ as NVML gives it."""
        k = max(0, (ts_us * 1000 - self.start_ns) // MS_NS)
        return float(np.floor(1e9 + self.power_w[gpu, :k].sum()))  # W * 1 ms = mJ

    def reasons(self, gpu: int, ts_us: int) -> float:
        return float(SW_POWER_CAP) if self.throttled[gpu, self._at(ts_us)] else 0.0

    def fake(self) -> FakeNvml:
        """Standard fake GPUs with this power, counter and throttling; memory as standard."""
        gpus = []
        for g in range(self.gpus):
            gpu = standard_gpu(g)
            u, ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            gpu.fields[pynvml.NVML_FI_DEV_POWER_INSTANT] = FakeReading(
                lambda ts, g=g: self.power_mw(g, ts), 1000, u
            )
            gpu.fields[pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION] = FakeReading(
                lambda ts, g=g: self.energy_mj(g, ts), self.counter_period_us, ull
            )
            gpu.readings["total_energy"] = FakeReading(
                lambda ts, g=g: self.energy_mj(g, ts), self.counter_period_us
            )
            gpu.readings["clocks_event_reasons"] = FakeReading(
                lambda ts, g=g: self.reasons(g, ts), 1000
            )
            gpus.append(gpu)
        return FakeNvml(gpus=gpus)

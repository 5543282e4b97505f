"""A window's numbers: what a span ``[t0, t1)`` of ring rows says per GPU; the ``Measurement``.

The sources report each value with the driver's timestamp of its refresh, and the value holds
until the next refresh: NVML's instant power is a reading the driver replaces every period, and
the sim and the fake NVML are exactly such step functions. So every statistic here integrates a
held signal over the window, with no interpolation: a row's value holds from its driver
timestamp to the next row's (a repeat, read again before the driver refreshed, holds for zero),
the last one to the window's end, and the value held at the window's start is the one of the last
row read before it. Energy is then the exact integral of the power the driver reported; a
trapezoid would need the sample after the window's end, which ``end_window`` cannot wait for.

Every reduction is vectorised over the window's rows and GPUs at once: an ``end_window`` costs
tens of microseconds for the windows a training step has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hfsampler.fields import CLOCK_EVENT_REASONS
from hfsampler.sampling.ring import RingRows

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# A driver timestamp further than this from the row's read time is not on the host's wall clock
# (or is 0: no value): the read time stands in for it.
_CLOCK_SLACK_NS = 1_000_000_000
_BITS = np.array(list(CLOCK_EVENT_REASONS), np.int64)
_REASONS = tuple(CLOCK_EVENT_REASONS.values())
_COLUMNS = np.arange(64)
P99 = 0.99


@dataclass(frozen=True, slots=True)
class Measurement:
    """What a window cost, per GPU (keyed by the index the job uses: ``cuda:N``).

    ``time`` in s; energy in J; power in W; ``gpu_throttled_time`` in s per throttle reason
    (NVML's clock event reasons, e.g. ``sw_power_cap``, only those that happened);
    ``gpu_memory_high_water_mib`` the most framebuffer memory used. ``gpu_energy_counter`` is the
    driver's energy counter's difference over the window, a cross-check where the window is long
    against the counter's resolution (None where it is not, or the GPU has no counter).
    ``exact`` is False when the window was longer than the rings hold: the numbers then come from
    its running statistics (``monitor.running``: the p99 to a watt, no counter), and a warning
    said so.
    """

    time: float
    gpu_energy: Mapping[int, float]
    gpu_mean_power: Mapping[int, float]
    gpu_peak_power: Mapping[int, float]
    gpu_p99_power: Mapping[int, float]
    gpu_throttled_time: Mapping[int, Mapping[str, float]]
    gpu_memory_high_water_mib: Mapping[int, float]
    gpu_energy_counter: Mapping[int, float | None]
    exact: bool = True

    @property
    def total_energy(self) -> float:
        """Every GPU's energy together, in J."""
        return float(sum(self.gpu_energy.values()))


@dataclass(frozen=True, slots=True)
class Span:
    """One span's reductions per GPU (arrays ``[gpu]``): what a ``Measurement`` is made of."""

    energy_j: FloatArray
    covered_s: FloatArray  # how long a power value was known; the others mean nothing where 0
    peak_w: FloatArray  # -inf: no value
    p99_w: FloatArray
    memory_mib: FloatArray  # -inf: no value, or no memory field
    bits_ns: FloatArray | None  # [reason, gpu]: how long each throttle reason held; None: none
    # [gpu, watt]: how long the power was at each whole watt; kept by running statistics only
    histogram_ns: FloatArray | None = None

    def merge(self, later: Span) -> Span:
        """This span and the one right after it, as one: sums and maxima are exact; the p99
        comes from the two histograms, to ``HISTOGRAM_W``."""
        covered = self.covered_s + later.covered_s
        energy = self.energy_j + later.energy_j
        bits = self.bits_ns if later.bits_ns is None else later.bits_ns
        if self.bits_ns is not None and later.bits_ns is not None:
            bits = self.bits_ns + later.bits_ns
        histogram = None
        p99 = np.full_like(energy, np.nan)
        if self.histogram_ns is not None and later.histogram_ns is not None:
            histogram = self.histogram_ns + later.histogram_ns
            p99 = histogram_quantile(histogram, P99)
        return Span(energy, covered, np.maximum(self.peak_w, later.peak_w), p99,
                    np.maximum(self.memory_mib, later.memory_mib), bits, histogram)  # fmt: skip


HISTOGRAM_W = 1.0  # the running statistics' power histogram: whole watts
HISTOGRAM_BINS = 4096


def histogram_quantile(histogram_ns: FloatArray, q: float) -> FloatArray:
    """Per GPU, the middle of the watt the power stayed at or under for the fraction ``q`` of
    the time (NaN: no time)."""
    cum = np.cumsum(histogram_ns, axis=1)
    total = cum[:, -1]
    at = (cum < q * total[:, None]).sum(axis=1)
    out: FloatArray = np.where(total > 0, (at + 0.5) * HISTOGRAM_W, np.nan)
    return out


def held_ns(read_ns: IntArray, driver_us: IntArray, t0_ns: int, t1_ns: int) -> FloatArray:
    """``[row, gpu, field]``: how long each row's value held inside ``[t0_ns, t1_ns)``; the
    first row is the last read before ``t0_ns``, whose value holds at ``t0_ns``."""
    ts = driver_us * 1000
    host = read_ns[:, None, None]
    ts = np.where(np.abs(ts - host) < _CLOCK_SLACK_NS, ts, host)
    np.minimum(np.maximum(ts, t0_ns, out=ts), t1_ns, out=ts)
    np.maximum.accumulate(ts, axis=0, out=ts)  # a clock stepped back never holds negative time
    held = np.empty(ts.shape, np.float64)
    np.subtract(ts[1:], ts[:-1], out=held[:-1])
    np.subtract(t1_ns, ts[-1], out=held[-1])
    return held


def reduce_span(
    rows: RingRows,
    t0_ns: int,
    t1_ns: int,
    power: int,
    memory: int | None,
    events: int | None,
    histogram: bool = False,
) -> Span:
    """The span's reductions from ring rows ``[row, gpu, field]`` (``rows.values`` is changed:
    NaN becomes 0); ``power``, ``memory``, ``events``: their fields' positions; ``histogram``:
    keep the power's histogram too (``Span.merge`` needs it)."""
    values = rows.values
    if not len(values):  # nothing sampled yet: the sampler has only just started
        none, zero = np.full(values.shape[1], -np.inf), np.zeros(values.shape[1])
        empty = np.zeros((values.shape[1], HISTOGRAM_BINS)) if histogram else None
        return Span(zero, zero, none, none, none, None, empty)
    held = held_ns(rows.time_ns, rows.driver_ts_us, t0_ns, t1_ns)
    missing = np.isnan(values)
    if missing.any():  # a GPU or field without a value: it holds for no time
        held[missing] = 0.0
        values[missing] = 0.0
    v, h = values[:, :, power], held[:, :, power]
    covered = h.sum(axis=0)
    energy = (v * h).sum(axis=0) / 1e9
    top = np.where(held > 0, values, -np.inf).max(axis=0)  # [gpu, field]; -inf: none
    # the time-weighted p99: the power the GPU stayed at or under 99 % of the time
    n, gpus = v.shape
    column = _COLUMNS[:gpus] if gpus <= len(_COLUMNS) else np.arange(gpus)
    flat = np.argsort(v, axis=0) * gpus + column  # [rank, gpu] -> index into v.ravel()
    cum = h.ravel()[flat].cumsum(axis=0)
    at = np.minimum((cum < P99 * covered).sum(axis=0), n - 1)
    p99 = v.ravel()[flat[at, column]]
    bits = None
    if events is not None and values[:, :, events].any():
        on = (values[:, :, events].astype(np.int64)[:, :, None] & _BITS) != 0  # [row, gpu, bit]
        bits = (on * held[:, :, events, None]).sum(axis=0).T
    memory_mib = top[:, memory] if memory is not None else np.full(gpus, -np.inf)
    hist: FloatArray | None = None
    if histogram:
        watt = np.clip(v / HISTOGRAM_W, 0, HISTOGRAM_BINS - 1).astype(np.intp)
        at = (watt + column * HISTOGRAM_BINS).ravel()
        counts = np.bincount(at, weights=h.ravel(), minlength=gpus * HISTOGRAM_BINS)
        hist = counts.astype(np.float64).reshape(gpus, HISTOGRAM_BINS)
    return Span(energy, covered / 1e9, top[:, power], p99, memory_mib, bits, hist)


def throttled(bits_ns: FloatArray | None, gpu: int) -> dict[str, float]:
    """One GPU's throttled seconds by reason, the reasons that happened only."""
    if bits_ns is None:
        return {}
    return {_REASONS[k]: float(bits_ns[k, gpu]) / 1e9 for k in np.flatnonzero(bits_ns[:, gpu])}


def counter_difference(
    read_ns: IntArray, driver_us: IntArray, value: FloatArray, t1_ns: int
) -> tuple[FloatArray, FloatArray]:
    """Per GPU, the counter's rise (its unit) from the value that held at the window's start to
    the last before ``t1_ns``, and the ns between those two values' driver timestamps (NaN
    where it did not move); the first row is the last one read before the window."""
    n, gpus = value.shape
    last = int(np.searchsorted(read_ns, t1_ns, side="right")) - 1
    if n < 2 or last < 1:
        nan = np.full(gpus, np.nan)
        return nan, nan
    rise = value[last] - value[0]
    span = (driver_us[last] - driver_us[0]) * 1e3
    return rise, np.where(span > 0, span, np.nan)

"""A window's numbers: what a span ``[t0, t1)`` of ring rows says per GPU; the ``Measurement``.

The sources report each value with the driver's timestamp of its refresh, and the value holds
until the next refresh: NVML's instant power is a reading the driver replaces every period, and
the sim and the fake NVML are exactly such step functions. So every statistic here integrates a
held signal over the window, with no interpolation: a row's value holds from its driver
timestamp to the next row's (a repeat, read again before the driver refreshed, holds for zero),
the last one to the window's end, and the value held at the window's start is the one of the last
row read before it. Energy is then the exact integral of the power the driver reported; a
trapezoid would need the sample after the window's end, which ``end_window`` cannot wait for.

Every reduction is vectorised over the window's rows, GPUs and fields at once, in one pass, on
rows copied cell by cell (``RingCells``: each cell's rows contiguous, as numpy runs fast along
them and slowly across a ring's few cells): how long each value held (its start clipped to the
window, a running maximum, the differences), then three reductions of every cell at once (the
time held, the integral, the highest value held). A missing value (NaN) shows in its cell's
integral, so the usual case, none, spends no pass looking for one. For the windows a training
step has, the number of numpy calls (about twenty, and a sort and a dozen more for the p99 and
the throttled time) is what a reduction costs, not the rows: the Monitor's reducer process pays
it. The energy counter's cross-check needs two rows, and takes them as Python numbers
(``counter_energy_j``). An ``Answer`` is a span's numbers as plain Python numbers; the job's
``Measurement`` is made of one (``Measurement.of``), or of one still to come
(``Measurement.later``, which waits for it on its first read).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hfsampler.fields import CLOCK_EVENT_REASONS
from hfsampler.sampling.ring import RingCells

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# A driver timestamp further than this from the row's read time is not on the host's wall clock
# (or is 0: no value): the read time stands in for it.
_CLOCK_SLACK_NS = 1_000_000_000
_BITS = np.array(list(CLOCK_EVENT_REASONS), np.int64)
_REASONS = tuple(CLOCK_EVENT_REASONS.values())
_GPU_INDICES = np.arange(64)
P99 = 0.99


# A Measurement's per-GPU mappings, in this order
NUMBERS = ("gpu_energy", "gpu_mean_power", "gpu_peak_power", "gpu_p99_power",
           "gpu_throttled_time", "gpu_memory_high_water_mib", "gpu_energy_counter")  # fmt: skip


class Measurement:
    """What a window cost, per GPU (keyed by the index the job uses: ``cuda:N``).

    ``time`` in s; energy in J; power in W; ``gpu_throttled_time`` in s per throttle reason
    (NVML's clock event reasons, e.g. ``sw_power_cap``, only those that happened);
    ``gpu_memory_high_water_mib`` the most framebuffer memory used. ``gpu_energy_counter`` is the
    driver's energy counter's difference over the window, a cross-check where the window is long
    against the counter's resolution (None where it is not, or the GPU has no counter).
    ``exact`` is False when the window was longer than the rings hold: the numbers then come from
    its running statistics (``monitor.running``: the p99 to a watt, no counter), and a warning
    said so. Read-only. Its numbers may wait, on their first read, for the Monitor's reducer
    process to answer (about a millisecond after ``end_window``; ``==``, ``repr`` and pickling
    read them too): one object and nothing else is made for a window until then.
    """

    __slots__ = ("_numbers", "_wait", "exact", "time")

    time: float
    exact: bool
    _numbers: tuple[Mapping[int, Any], ...] | None
    _wait: tuple[Callable[[], Answer], Sequence[int]] | None

    def __init__(
        self,
        time: float,
        gpu_energy: Mapping[int, float],
        gpu_mean_power: Mapping[int, float],
        gpu_peak_power: Mapping[int, float],
        gpu_p99_power: Mapping[int, float],
        gpu_throttled_time: Mapping[int, Mapping[str, float]],
        gpu_memory_high_water_mib: Mapping[int, float],
        gpu_energy_counter: Mapping[int, float | None],
        exact: bool = True,
    ) -> None:
        numbers = (gpu_energy, gpu_mean_power, gpu_peak_power, gpu_p99_power,
                   gpu_throttled_time, gpu_memory_high_water_mib, gpu_energy_counter)  # fmt: skip
        _set(self, time, exact, numbers, None)

    @classmethod
    def later(cls, wait: Callable[[], Answer], time_s: float, gpus: Sequence[int]) -> Measurement:
        """One whose numbers are ``wait()``'s answer for the GPUs ``gpus`` (the job's indices,
        in the answer's order), waited for on their first read."""
        made = cls.__new__(cls)
        _set(made, time_s, True, None, (wait, gpus))  # asked only where the rings hold it
        return made

    @classmethod
    def of(cls, answer: Answer, time_s: float, gpus: Sequence[int]) -> Measurement:
        made = cls.__new__(cls)
        _set(made, time_s, answer.exact, tuple(_numbers(answer, gpus)), None)
        return made

    def _got(self) -> tuple[Mapping[int, Any], ...]:
        numbers = self._numbers
        if numbers is None:
            waiting = self._wait  # two threads at once both wait, for the same answer
            if waiting is not None:
                wait, gpus = waiting
                numbers = tuple(_numbers(wait(), gpus))
                object.__setattr__(self, "_numbers", numbers)
                object.__setattr__(self, "_wait", None)
            else:  # another thread has just made them
                numbers = self._numbers
        assert numbers is not None
        return numbers

    @property
    def gpu_energy(self) -> Mapping[int, float]:
        return self._got()[0]

    @property
    def gpu_mean_power(self) -> Mapping[int, float]:
        return self._got()[1]

    @property
    def gpu_peak_power(self) -> Mapping[int, float]:
        return self._got()[2]

    @property
    def gpu_p99_power(self) -> Mapping[int, float]:
        return self._got()[3]

    @property
    def gpu_throttled_time(self) -> Mapping[int, Mapping[str, float]]:
        return self._got()[4]

    @property
    def gpu_memory_high_water_mib(self) -> Mapping[int, float]:
        return self._got()[5]

    @property
    def gpu_energy_counter(self) -> Mapping[int, float | None]:
        return self._got()[6]

    @property
    def total_energy(self) -> float:
        """Every GPU's energy together, in J."""
        return float(sum(self.gpu_energy.values()))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Measurement is read-only (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a Measurement is read-only (cannot delete {name!r})")

    def _fields(self) -> tuple[object, ...]:
        return (self.time, *self._got(), self.exact)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Measurement):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # as a dataclass with mappings: unhashable

    def __repr__(self) -> str:
        numbers = ", ".join(f"{n}={m!r}" for n, m in zip(NUMBERS, self._got(), strict=True))
        return f"Measurement(time={self.time!r}, {numbers}, exact={self.exact!r})"

    def __reduce__(self) -> tuple[type[Measurement], tuple[object, ...]]:
        """Pickled (and copied) with its numbers, waited for then."""
        return Measurement, (self.time, *(dict(m) for m in self._got()), self.exact)


def _set(
    m: Measurement,
    time_s: float,
    exact: bool,
    numbers: tuple[Mapping[int, Any], ...] | None,
    wait: tuple[Callable[[], Answer], Sequence[int]] | None,
) -> None:
    object.__setattr__(m, "time", time_s)
    object.__setattr__(m, "exact", exact)
    object.__setattr__(m, "_numbers", numbers)
    object.__setattr__(m, "_wait", wait)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a window's quantities are among the cells it reads (``Ring.cell_index``'s order,
    field by field): the power's cells first, one per GPU, then the others' where sampled."""

    gpus: int
    memory: slice | None  # None: not read with the power
    events: slice | None

    @classmethod
    def of(cls, gpus: int, memory: int | None, events: int | None) -> Layout:
        """``memory``, ``events``: the fields' positions among those read (the power's is 0)."""
        at = [None if f is None else slice(f * gpus, (f + 1) * gpus) for f in (memory, events)]
        return cls(gpus, *at)


@dataclass(frozen=True, slots=True)
class Held:
    """A span's rows as read: each cell's value (0 where none) and how long it held in the
    span. What the p99 and the throttled time are computed from, when asked."""

    values: FloatArray  # [cell, row]
    held_ns: IntArray  # [cell, row]
    layout: Layout

    def p99_w(self) -> FloatArray:
        """Per GPU, the time-weighted p99: the power it stayed at or under 99 % of the time."""
        values, held, gpus = self.values, self.held_ns, self.layout.gpus
        gpu = _GPU_INDICES[:gpus] if gpus <= len(_GPU_INDICES) else np.arange(gpus)
        # the power's cells of ``values`` and ``held`` (flat), in ascending power, per GPU
        flat = values[:gpus].argsort(axis=1) + (gpu * values.shape[1])[:, None]
        covered = held[:gpus].sum(axis=1)
        at = (held.take(flat).cumsum(axis=1) < P99 * covered[:, None]).sum(axis=1)  # covered
        p99: FloatArray = values.take(flat[gpu, at])
        return p99

    def bits_ns(self) -> IntArray | None:
        """``[reason, gpu]``: how long each throttle reason held; None: none did, or no field."""
        events = self.layout.events
        if events is None or not self.values[events].any():
            return None
        # [gpu, bit, row]
        on = (self.values[events, None, :].astype(np.int64) & _BITS[:, None]) != 0
        bits: IntArray = (on * self.held_ns[events, None, :]).sum(axis=2).T
        return bits


@dataclass(frozen=True, slots=True)
class Span:
    """One span's reductions per GPU (arrays ``[gpu]``): what a ``Measurement`` is made of. The
    p99 and the throttled time are either kept (``p99_w``, ``bits_ns``) or computed from
    ``held`` when asked (``p99``, ``bits``)."""

    energy_j: FloatArray
    covered_s: FloatArray  # how long a power value was known; the others mean nothing where 0
    peak_w: FloatArray  # -inf: no value
    memory_mib: FloatArray  # -inf: no value, or no memory field
    held: Held | None = None
    p99_w: FloatArray | None = None
    bits_ns: IntArray | None = None  # [reason, gpu]: how long each throttle reason held
    # [gpu, watt]: how long the power was at each whole watt; kept by running statistics only
    histogram_ns: FloatArray | None = None

    def p99(self) -> FloatArray:
        if self.held is not None:
            return self.held.p99_w()
        return self.p99_w if self.p99_w is not None else np.full_like(self.energy_j, np.nan)

    def bits(self) -> IntArray | None:
        return self.held.bits_ns() if self.held is not None else self.bits_ns

    def merge(self, later: Span) -> Span:
        """This span and the one right after it, as one: sums and maxima are exact; the p99
        comes from the two histograms, to ``HISTOGRAM_W``."""
        covered = self.covered_s + later.covered_s
        energy = self.energy_j + later.energy_j
        mine, theirs = self.bits(), later.bits()
        bits = mine if theirs is None else theirs if mine is None else mine + theirs
        histogram = None
        p99 = np.full_like(energy, np.nan)
        if self.histogram_ns is not None and later.histogram_ns is not None:
            histogram = self.histogram_ns + later.histogram_ns
            p99 = histogram_quantile(histogram, P99)
        return Span(energy, covered, np.maximum(self.peak_w, later.peak_w),
                    np.maximum(self.memory_mib, later.memory_mib), None, p99, bits,
                    histogram)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Answer:
    """A span's numbers per GPU, in the Monitor's order of its GPUs, as plain Python numbers (so
    that they travel between processes as they are)."""

    energy_j: list[float]
    covered_s: list[float]  # how long a power value was known; the others mean nothing where 0
    peak_w: list[float]  # -inf: no value
    p99_w: list[float]
    memory_mib: list[float]  # -inf: no value, or no memory field
    throttled_s: list[dict[str, float]]
    counter_j: list[float | None]  # the energy counter's cross-check; None where it cannot
    exact: bool = True  # False: from running statistics (a window longer than the rings hold)

    @classmethod
    def of(cls, span: Span, counter: list[float | None], exact: bool = True) -> Answer:
        bits = span.bits()
        gpus = len(span.energy_j)
        return cls(
            span.energy_j.tolist(), span.covered_s.tolist(), span.peak_w.tolist(),
            span.p99().tolist(), span.memory_mib.tolist(),
            [throttled(bits, g) for g in range(gpus)], counter, exact,
        )  # fmt: skip


def _numbers(answer: Answer, gpus: Sequence[int]) -> list[dict[int, Any]]:
    """``NUMBERS``' mappings of an answer; NaN for a GPU with no power value in the span."""
    nan = math.nan
    known = [s > 0 for s in answer.covered_s]
    rows = list(zip(gpus, known, answer.energy_j, answer.covered_s, answer.peak_w, answer.p99_w,
                    strict=True))  # fmt: skip
    return [
        {i: e if k else nan for i, k, e, _, _, _ in rows},
        {i: e / s if k else nan for i, k, e, s, _, _ in rows},
        {i: p if k else nan for i, k, _, _, p, _ in rows},
        {i: q if k else nan for i, k, _, _, _, q in rows},
        dict(zip(gpus, answer.throttled_s, strict=True)),
        {i: m if m > -math.inf else nan for i, m in zip(gpus, answer.memory_mib, strict=True)},
        dict(zip(gpus, answer.counter_j, strict=True)),
    ]


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


def held_ns(read_ns: IntArray, driver_us: IntArray, t0_ns: int, t1_ns: int) -> IntArray:
    """``[cell, row]``: how long each row's value held inside ``[t0_ns, t1_ns)``; the first row
    is the last read before ``t0_ns``, whose value holds at ``t0_ns``."""
    n = len(read_ns)
    edges = np.empty((driver_us.shape[0], n + 1), np.int64)  # each value's start, then t1_ns
    ts = edges[:, :n]
    np.multiply(driver_us, 1000, out=ts)
    host = read_ns  # broadcast over the cells
    off = np.subtract(ts, host)
    np.absolute(off, out=off)
    # one reduction to learn that every timestamp is on the host's clock, the usual case
    if np.maximum.reduce(off, axis=None, initial=0) >= _CLOCK_SLACK_NS:
        np.copyto(ts, host, where=off >= _CLOCK_SLACK_NS)
    edges[:, n] = t1_ns
    # a clock stepped back holds no time: each start is the latest so far; and none is before
    # t0_ns, which the first one's being so makes true of all (a running maximum)
    np.maximum(edges[:, 0], t0_ns, out=edges[:, 0])
    np.maximum.accumulate(edges, axis=1, out=edges)
    np.minimum(edges, t1_ns, out=edges)
    held: IntArray = np.subtract(edges[:, 1:], edges[:, :-1])
    return held


def _sums(values: FloatArray, held: IntArray) -> FloatArray:
    """``[3, cell]``: the ns each cell's values held, their integral (value times ns), and the
    highest that held at all (-inf: none); a NaN value makes its cell's integral NaN."""
    out = np.empty((3, len(values)))
    np.add.reduce(held, axis=1, out=out[0])
    np.add.reduce(np.multiply(values, held), axis=1, out=out[1])
    np.maximum.reduce(values, axis=1, out=out[2], where=held > 0, initial=-np.inf)
    return out


def reduce_span(
    rows: RingCells, t0_ns: int, t1_ns: int, layout: Layout, histogram: bool = False
) -> Span:
    """The span's reductions from ring rows (``[cell, row]``) laid out as ``layout`` says
    (``rows.values`` is changed: NaN becomes 0); ``histogram``: keep the power's histogram too
    (``Span.merge`` needs it). All GPUs and quantities in one pass of about twenty numpy calls
    (the held time's, then three reductions of every cell at once), the p99 and the throttled
    time left to ``Held`` until asked: the calls, not the rows, are what a short window costs."""
    values = rows.values
    n, gpus = len(rows), layout.gpus
    if not n:  # nothing sampled yet: the sampler has only just started
        none, zero = np.full(gpus, -np.inf), np.zeros(gpus)
        empty = np.zeros((gpus, HISTOGRAM_BINS)) if histogram else None
        return Span(zero, zero, none, none, None, none, None, empty)
    held = held_ns(rows.time_ns, rows.driver_ts_us, t0_ns, t1_ns)
    sums = _sums(values, held)
    # a GPU or field without a value (NaN) holds for no time: a NaN value, held or not, makes
    # its cell's integral NaN, so the integrals' sum says whether any is (the usual case: none)
    if math.isnan(np.add.reduce(sums[1])):
        missing = np.isnan(values)
        held[missing] = 0
        values[missing] = 0.0
        sums = _sums(values, held)
    sums[:2] /= 1e9  # s, J
    top = sums[2]  # -inf: none
    memory_mib = top[layout.memory] if layout.memory is not None else np.full(gpus, -np.inf)
    kept = Held(values, held, layout)
    if not histogram:
        return Span(sums[1, :gpus], sums[0, :gpus], top[:gpus], memory_mib, kept)
    v, h = values[:gpus], held[:gpus]
    gpu = _GPU_INDICES[:gpus] if gpus <= len(_GPU_INDICES) else np.arange(gpus)
    watt = np.clip(v / HISTOGRAM_W, 0, HISTOGRAM_BINS - 1).astype(np.intp)
    at = (watt + (gpu * HISTOGRAM_BINS)[:, None]).ravel()
    counts = np.bincount(at, weights=h.ravel(), minlength=gpus * HISTOGRAM_BINS)
    hist = counts.astype(np.float64).reshape(gpus, HISTOGRAM_BINS)
    # kept for long: the reductions only, not the rows
    return Span(sums[1, :gpus], sums[0, :gpus], top[:gpus], memory_mib, None, kept.p99_w(),
                kept.bits_ns(), hist)  # fmt: skip


def throttled(bits_ns: IntArray | None, gpu: int) -> dict[str, float]:
    """One GPU's throttled seconds by reason, the reasons that happened only."""
    if bits_ns is None:
        return {}
    return {_REASONS[k]: float(bits_ns[k, gpu]) / 1e9 for k in np.flatnonzero(bits_ns[:, gpu])}


def counter_energy_j(
    first: tuple[list[float], list[int]], last: tuple[list[float], list[int]], length_ns: int
) -> list[float | None]:
    """Per cell, the energy counter's answer in J for a window ``length_ns`` long, from two rows'
    values (mJ) and driver timestamps (µs): the value that held at the window's start (the last
    row read before it) and the last one read in it. The counter's mean power between those two
    values' driver timestamps times the window, so that its ~100 ms steps are not taken for the
    job's energy; None where it did not move, or its values span under half the window. Plain
    floats: two rows of a few GPUs want no numpy."""
    (v0, d0), (v1, d1) = first, last
    out: list[float | None] = []
    for a, b, s, e in zip(v0, v1, d0, d1, strict=True):
        rise_mj, span_ns = b - a, (e - s) * 1e3  # NaN: no value at one end
        ok = math.isfinite(rise_mj) and span_ns > 0 and span_ns >= length_ns / 2
        out.append(rise_mj / 1e3 * length_ns / span_ns if ok else None)
    return out

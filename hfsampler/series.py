"""The exported data model: series identities and the per-window snapshot every exporter reads.

A ``Series`` is one metric name plus its sorted labels, created once by ``SeriesRegistry`` and
reused every window, so exporters can cache what they derive from it (the encoder keeps its label
bytes by ``Series.id``). A ``Snapshot`` is one timestamp and a value per series.
"""

from __future__ import annotations

import bisect
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hfsampler.errors import InvalidLabelError
from hfsampler.histograms import NativeHistogram, ResetHint

# Prometheus's staleness marker: a NaN with this exact bit pattern ends a series.
STALE_NAN_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", STALE_NAN_BITS))[0]

# A histogram series' staleness marker: Prometheus's is a histogram whose sum is the stale NaN
# (model/value.IsStaleNaN on FloatHistogram.Sum); the rest is the empty histogram. Every stage
# that ends a histogram series sends this one; ``is_stale(h.sum)`` tells it apart.
STALE_HISTOGRAM = NativeHistogram(
    schema=0,
    zero_threshold=0.0,
    zero_count=0,
    count=0,
    sum=STALE_NAN,
    positive_spans=(),
    positive_deltas=(),
    negative_spans=(),
    negative_deltas=(),
    reset_hint=ResetHint.UNKNOWN,
)

METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def is_stale(value: float) -> bool:
    """True for the exact staleness-marker NaN, not for any other NaN."""
    return math.isnan(value) and struct.unpack("<Q", struct.pack("<d", value))[0] == STALE_NAN_BITS


def validate_labels(name: str, labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Check a label set as Remote-Write receivers do and return it sorted by label name.

    Label names are ASCII (``LABEL_NAME_RE``), so Python's code-point order is the byte order
    the spec asks for and Thanos and Mimir enforce.
    """
    if not METRIC_NAME_RE.match(name):
        raise InvalidLabelError(f"invalid metric name {name!r}")
    out = []
    for key, value in labels.items():
        if key == "__name__":
            raise InvalidLabelError("__name__ is the series name, not a label")
        if not LABEL_NAME_RE.match(key):
            raise InvalidLabelError(f"invalid label name {key!r} on {name}")
        if value == "":
            raise InvalidLabelError(f"empty value for label {key!r} on {name}")
        out.append((key, value))
    out.sort()
    return tuple(out)


def with_external_labels(own: Mapping[str, str], external: Mapping[str, str]) -> dict[str, str]:
    """A series' labels with the external labels added; on a shared name its own value wins.

    Prometheus's rule for ``external_labels``: they fill in names a series does not have and
    never replace one it has, so ``external_labels: {gpu: x}`` cannot make every GPU's series
    one. Every place that adds external labels goes through here."""
    return {**external, **own}


@dataclass(frozen=True, slots=True)
class Series:
    """One exported time series: its registry id, metric name and sorted labels (no __name__)."""

    id: int
    name: str
    labels: tuple[tuple[str, str], ...]

    def all_labels(self) -> tuple[tuple[str, str], ...]:
        """Labels as Remote-Write sends them: ``__name__`` included, all in byte order of name.

        ``__name__`` is no exception to the order: ``GPU_I_ID`` < ``UUID`` < ``__name__`` <
        ``device``. Receivers that check (Thanos Receive, Mimir) refuse any other order.
        """
        at = bisect.bisect_left(self.labels, "__name__", key=lambda label: label[0])
        return (*self.labels[:at], ("__name__", self.name), *self.labels[at:])


@dataclass(frozen=True, slots=True)
class Family:
    """A metric family's metadata for /metrics and Remote-Write metadata."""

    name: str
    help: str
    type: str  # "gauge", "counter" or "histogram" (a native histogram: no _bucket series)
    unit: str = ""


class SeriesRegistry:
    """Interns series so each (name, labels) exists once with a stable id.

    Ids are never reused, so a cache keyed by id (the encoder's label bytes) cannot confuse a
    forgotten series with a new one.
    """

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, tuple[tuple[str, str], ...]], Series] = {}
        self._next_id = 0
        self.families: dict[str, Family] = {}

    def series(self, name: str, labels: Mapping[str, str]) -> Series:
        key = (name, tuple(sorted(labels.items())))
        found = self._by_key.get(key)
        if found is None:
            found = Series(self._next_id, name, validate_labels(name, labels))
            self._next_id += 1
            self._by_key[key] = found
        return found

    def forget(self, series: Iterable[Series]) -> None:
        """Drop ended series (a pod that left, a lost GPU) so churn cannot grow memory."""
        for s in series:
            key = (s.name, s.labels)
            if self._by_key.get(key) is s:
                del self._by_key[key]

    def family(self, name: str, help_text: str, type_: str, unit: str = "") -> None:
        self.families.setdefault(name, Family(name, help_text, type_, unit))

    def __len__(self) -> int:
        return len(self._by_key)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every series' value at one timestamp (ms since the epoch): one window's export.

    ``histograms``: the native-histogram series (issue 26), each with its cumulative histogram at
    the same timestamp; their families are in ``families`` with type "histogram". Float series
    and histogram series never share a name.
    """

    timestamp_ms: int
    series: Sequence[Series]
    values: Sequence[float]
    families: Mapping[str, Family] = field(default_factory=dict)
    histograms: Sequence[tuple[Series, NativeHistogram]] = ()

    def __len__(self) -> int:
        return len(self.series)

    def items(self) -> Iterable[tuple[Series, float]]:
        return zip(self.series, self.values, strict=True)

"""dcgm-exporter's DCGM_EXP_XID_ERRORS_COUNT and _TOTAL, DCGM_EXP_CLOCK_EVENTS_COUNT and _TOTAL.

dcgm-exporter (4.8.3 and 4.8.4: ``internal/pkg/collector/expcollector.go`` with
``xid_collector.go`` and ``clock_events_collector.go``) asks DCGM at each scrape for every stored
value of DCGM_FI_DEV_XID_ERRORS, or of DCGM_FI_DEV_CLOCKS_EVENT_REASONS, from the last window (5
min by default) and counts them per GPU: per XID code (label ``xid``), and per reason bit set in
each value (label ``clock_event``, DCGM's reason names). A GPU with nothing in the window has one
series without that label, at 0. Every series carries ``window_size_in_ms``. Nothing is reset: the
window slides, so a code's series ends one window after its last event (here with a stale marker).

Here the counts come from each window's own series, so /metrics and every Remote-Write endpoint
see the same values. XID events are the increase of ``hfsampler_xid_events_total`` per code:
exact, as the sampler counts every event, where DCGM keeps one value per event too. An event
counted under ``other`` (a code outside ``fields.XID_CODES``) takes the GPU's last XID
(DCGM_FI_DEV_XID_ERRORS) as its code, or stays ``other`` when a listed code came after it in the
same window. Clock events count the windows whose DCGM_FI_DEV_CLOCKS_EVENT_REASONS (the OR over
the window, so a 2 ms throttle counts) had the reason's bit, where dcgm-exporter counts its polls
of the field (one per collect interval, 30 s by default): the same alert fires on ``> 0``, while
the count itself is per window here (up to 300 in 5 min with 1 s windows, 10 there).

The ``_TOTAL`` counters (4.8.3, ``xid_total_collector.go``, ``clock_events_total_collector.go``)
count since start, one series per code or reason seen, none before: XID events as above, and
clock events edge-counted, a reason counting once each time it turns on, a reason already on at
the first value not counted. Here an edge is between two windows' ORs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hfsampler.fields import XID_CODES, XID_OTHER, Field
from hfsampler.series import Series, SeriesRegistry

XID_FAMILY = "DCGM_EXP_XID_ERRORS_COUNT"
CLOCK_EVENTS_FAMILY = "DCGM_EXP_CLOCK_EVENTS_COUNT"
XID_TOTAL_FAMILY = "DCGM_EXP_XID_ERRORS_TOTAL"
CLOCK_EVENTS_TOTAL_FAMILY = "DCGM_EXP_CLOCK_EVENTS_TOTAL"
XID_COUNTER = "hfsampler_xid_events_total"
LAST_XID = "DCGM_FI_DEV_XID_ERRORS"
CLOCK_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
WINDOW_LABEL = "window_size_in_ms"

# DCGM's names for the reason bits (dcgm-exporter's clockEventToString, after dcgmi's), which
# are dcgm-exporter's `clock_event` values; fields.CLOCK_EVENT_REASONS names the same bits as NVML
CLOCK_EVENT_NAMES: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "clocks_setting",
    0x4: "power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}

_KNOWN_XIDS = frozenset(str(c) for c in XID_CODES)
Identity = tuple[str, str]  # (UUID, GPU_I_ID): a GPU or MIG instance whatever its other labels


def _identity(labels: Mapping[str, str]) -> Identity:
    return labels.get("UUID", ""), labels.get("GPU_I_ID", "")


@dataclass(frozen=True, slots=True)
class _Event:
    t_ns: int
    gpu: Identity
    label: str
    count: float


class _Counter:
    """One family's events over its trailing window, and the series that show them."""

    def __init__(self, family: str, label: str, window_s: float) -> None:
        self.family = family
        self.label = label
        self.window_ns = round(window_s * 1e9)
        self.window_ms = str(round(window_s * 1e3))
        self.events: deque[_Event] = deque()
        # the events' sum per GPU and label, kept as they come and go: a 10 ms window with a
        # 5 min count is 30,000 windows of events, not summed again each window
        self.counts: dict[Identity, dict[str, float]] = {}

    def add(self, event: _Event) -> None:
        self.events.append(event)
        per = self.counts.setdefault(event.gpu, {})
        per[event.label] = per.get(event.label, 0.0) + event.count

    def emit(
        self,
        t_ns: int,
        gpus: Mapping[Identity, dict[str, str]],
        registry: SeriesRegistry,
        out: list[tuple[Series, float]],
    ) -> None:
        """Drop what left the window (t_ns - window, t_ns]; one series per GPU and label."""
        while self.events and self.events[0].t_ns <= t_ns - self.window_ns:
            e = self.events.popleft()
            per = self.counts[e.gpu]
            per[e.label] -= e.count
            if per[e.label] <= 0:
                del per[e.label]
        for gpu, base in gpus.items():
            labels = {**base, WINDOW_LABEL: self.window_ms}
            found = self.counts.get(gpu)
            if not found:
                out.append((registry.series(self.family, labels), 0.0))
                continue
            for value, n in sorted(found.items()):
                out.append((registry.series(self.family, {**labels, self.label: value}), n))


class _Total:
    """One family's counts since start, per GPU and code or reason: a series once one is seen."""

    def __init__(self, family: str, label: str) -> None:
        self.family = family
        self.label = label
        self.totals: dict[tuple[Identity, str], float] = {}

    def emit(
        self,
        gpus: Mapping[Identity, dict[str, str]],
        registry: SeriesRegistry,
        out: list[tuple[Series, float]],
    ) -> None:
        for (gpu, value), n in sorted(self.totals.items()):
            base = gpus.get(gpu)
            if base is not None:
                out.append((registry.series(self.family, {**base, self.label: value}), n))


class EventCounts:
    """Counts XIDs and clock events per GPU, over trailing windows and since start, from each
    window's series."""

    def __init__(
        self,
        counted: Sequence[Field],
        registry: SeriesRegistry,
        *,
        xid_window_s: float = 300.0,
        clock_events_window_s: float = 300.0,
        previous: EventCounts | None = None,
    ) -> None:
        """``counted``: the selected fields with a ``counted``; ``previous``: the counts a
        reload replaces, whose events, totals and last values carry over."""
        kinds = {f.counted for f in counted}
        self._registry = registry
        self._xid = _Counter(XID_FAMILY, "xid", xid_window_s) if "xid" in kinds else None
        self._clock = (
            _Counter(CLOCK_EVENTS_FAMILY, "clock_event", clock_events_window_s)
            if "clock_events" in kinds
            else None
        )
        self._xid_total = _Total(XID_TOTAL_FAMILY, "xid") if "xid_total" in kinds else None
        self._clock_total = (
            _Total(CLOCK_EVENTS_TOTAL_FAMILY, "clock_event")
            if "clock_events_total" in kinds
            else None
        )
        for f in counted:
            registry.family(f.name, f.help, f.prometheus_type, f.unit)
        self._xid_seen: dict[tuple[Identity, str], float] = {}  # hfsampler_xid_events_total
        self._reasons: dict[Identity, int] = {}  # each GPU's last reason bits
        if previous is not None:
            self._xid_seen, self._reasons = previous._xid_seen, previous._reasons
            for mine, theirs in ((self._xid, previous._xid), (self._clock, previous._clock)):
                if mine is not None and theirs is not None:
                    mine.events, mine.counts = theirs.events, theirs.counts
            for total, before in (
                (self._xid_total, previous._xid_total),
                (self._clock_total, previous._clock_total),
            ):
                if total is not None and before is not None:
                    total.totals = before.totals

    def __bool__(self) -> bool:
        return any(c is not None for c in (self._xid, self._clock, self._xid_total,
                                          self._clock_total))  # fmt: skip

    def add(self, window: Iterable[tuple[Series, float]], t_ns: int) -> list[tuple[Series, float]]:
        """This window's count series, from its other series (``window``) ending at ``t_ns``."""
        xids = self._xid is not None or self._xid_total is not None
        clocks = self._clock is not None or self._clock_total is not None
        xid_gpus: dict[Identity, dict[str, str]] = {}
        clock_gpus: dict[Identity, dict[str, str]] = {}
        last_xid: dict[Identity, float] = {}
        increases: list[tuple[Identity, str, float]] = []
        reasons: list[tuple[Identity, str]] = []  # active in this window
        for s, value in window:
            if s.name == XID_COUNTER and xids:
                labels = dict(s.labels)
                code = labels.pop("xid", XID_OTHER)
                gpu = _identity(labels)
                xid_gpus.setdefault(gpu, labels)
                # counts start at 0 when the sampler opens, so a first value is all increase
                before = self._xid_seen.get((gpu, code), 0.0)
                self._xid_seen[gpu, code] = value
                if value > before:
                    increases.append((gpu, code, value - before))
            elif s.name == LAST_XID:
                last_xid[_identity(dict(s.labels))] = value
            elif s.name == CLOCK_EVENT_REASONS and clocks:
                labels = dict(s.labels)
                gpu = _identity(labels)
                clock_gpus[gpu] = labels
                bits = int(value) if value == value else 0
                reasons.extend((gpu, name) for bit, name in CLOCK_EVENT_NAMES.items() if bits & bit)
                before_bits = self._reasons.get(gpu)
                self._reasons[gpu] = bits
                if self._clock_total is not None and before_bits is not None:
                    # edge-counted: a reason counts when it turns on; one on at the first
                    # value is no transition seen (dcgm-exporter primes the same way)
                    for bit, name in CLOCK_EVENT_NAMES.items():
                        if bits & ~before_bits & bit:
                            key = (gpu, name)
                            self._clock_total.totals[key] = self._clock_total.totals.get(key, 0) + 1
        out: list[tuple[Series, float]] = []
        if xids:
            for gpu, code, n in increases:
                if code == XID_OTHER:
                    last = last_xid.get(gpu, 0.0)
                    if last > 0 and str(int(last)) not in _KNOWN_XIDS:
                        code = str(int(last))
                if self._xid is not None:
                    self._xid.add(_Event(t_ns, gpu, code, n))
                if self._xid_total is not None:
                    key = (gpu, code)
                    self._xid_total.totals[key] = self._xid_total.totals.get(key, 0.0) + n
        if self._xid is not None:
            self._xid.emit(t_ns, xid_gpus, self._registry, out)
        if self._xid_total is not None:
            self._xid_total.emit(xid_gpus, self._registry, out)
        if self._clock is not None:
            for gpu, name in reasons:
                self._clock.add(_Event(t_ns, gpu, name, 1.0))
            self._clock.emit(t_ns, clock_gpus, self._registry, out)
        if self._clock_total is not None:
            self._clock_total.emit(clock_gpus, self._registry, out)
        return out

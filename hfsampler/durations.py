"""Durations as text: one unit table and one tokenizer for every duration hfsampler reads.

hfsampler's own keys and flags take ``250us``, ``1ms``, ``1.5s``, ``5m``, ``1h30m``. A pasted
``remote_write`` block keeps Prometheus's grammar exactly (whole numbers, ``ms`` to ``y``, largest
unit first), so a block that works here works in Prometheus too.

Amounts are summed exactly, in nanoseconds, and turned into seconds once: ``100us`` is the float
nearest 1e-4, as ``0.1ms`` is, rather than ``100 * 1e-6`` (a hair under it).
"""

from __future__ import annotations

import re
from fractions import Fraction

from hfsampler.errors import ConfigError

_UNIT_NS = {
    "y": 365 * 86400 * 10**9,
    "w": 7 * 86400 * 10**9,
    "d": 86400 * 10**9,
    "h": 3600 * 10**9,
    "m": 60 * 10**9,
    "s": 10**9,
    "ms": 10**6,
    "us": 10**3,
    "µs": 10**3,
}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|[ywdhms])")
_HFSAMPLER_UNITS = frozenset({"d", "h", "m", "s", "ms", "us", "µs"})
_PROMETHEUS_ORDER = ("y", "w", "d", "h", "m", "s", "ms")  # each at most once, in this order


def _parts(text: str) -> list[tuple[str, str]] | None:
    """``text`` as (amount, unit) pairs, or None unless they cover all of it."""
    parts, pos = [], 0
    for m in _PART.finditer(text):
        if m.start() != pos:
            return None
        parts.append((m.group(1), m.group(2)))
        pos = m.end()
    return parts if parts and pos == len(text) else None


def parse_duration(value: object, key: str) -> float:
    """hfsampler's durations (``250us``, ``1ms``, ``1.5s``, ``5m``, ``1h30m``) in seconds."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(key, f"expected a duration, got {value!r}", "write it like 1ms, 1s or 5m")
    text = str(value).strip()
    if isinstance(value, int | float) or re.fullmatch(r"\d+(\.\d+)?", text):
        raise ConfigError(key, f"{text!r} has no unit", f"write {text}s or {text}ms"
                          if float(text) else "write it like 1ms, 1s or 5m")  # fmt: skip
    parts = _parts(text)
    if parts is None or any(unit not in _HFSAMPLER_UNITS for _, unit in parts):
        raise ConfigError(
            key, f"cannot read {text!r} as a duration", "use units us, ms, s, m, h: 250us, 1s, 5m"
        )
    return _seconds(parts)


def parse_prometheus_duration(value: object, key: str) -> float:
    """A Prometheus duration string (``30s``, ``100ms``, ``1h30m``) in seconds."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ConfigError(key, "must be a Prometheus duration string", "write it like '30s'")
    text = value.strip()
    if text == "0":
        return 0.0
    parts = _parts(text)
    units = [unit for _, unit in parts or ()]
    ranks = [_PROMETHEUS_ORDER.index(u) for u in units if u in _PROMETHEUS_ORDER]
    if (
        parts is None
        or len(ranks) != len(units)
        or ranks != sorted(set(ranks))
        or any("." in amount for amount, _ in parts)
    ):
        raise ConfigError(
            key, f"{value!r} is not a duration", "use units ms, s, m, h, d, w, y, e.g. '1m30s'"
        )
    return _seconds(parts)


def _seconds(parts: list[tuple[str, str]]) -> float:
    """The exact sum of the parts, as the nearest float number of seconds."""
    total_ns = sum(Fraction(amount) * _UNIT_NS[unit] for amount, unit in parts)
    return float(total_ns / 10**9)


def to_ns(seconds: float) -> int:
    """Seconds as whole nanoseconds, for comparing durations without float rounding."""
    return round(seconds * 10**9)

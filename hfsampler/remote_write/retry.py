"""Retry policy: what an HTTP answer means for a request, and how long to wait before the next try.

The spec's classes: 2xx delivered; 5xx and 429 recoverable (retried with backoff, ``Retry-After``
honoured); 413 too large (the sender splits); any other 4xx refused for good (Thanos's 409 for
out-of-order or duplicate samples included). Mimir's 529 "too many requests" counts as a 429.
Backoff doubles from ``min_backoff`` to ``max_backoff``, jittered so that shards spread out.
"""

from __future__ import annotations

import email.utils
import enum
import random
import time
from collections.abc import Callable
from datetime import UTC
from typing import NamedTuple

# The longest wait before trying a receiver that refused the connection again: a refused connect
# costs the receiver nothing, and a drain should start within a second of its return, however
# far max_backoff took the backoff during the outage.
RECEIVER_DOWN_RETRY_S = 1.0
# Statuses retried like 429 when retry_on_http_429 is on: Mimir's "too many requests" variant.
RATE_LIMIT_STATUSES = frozenset((429, 529))


class Outcome(enum.Enum):
    """What an HTTP status means for the request that got it."""

    DELIVERED = "delivered"
    RETRY = "retry"
    TOO_LARGE = "too_large"
    REFUSED = "refused"


def classify(status: int, retry_on_http_429: bool = True) -> Outcome:
    """The outcome of an answer with ``status``, as the Remote-Write spec classes it."""
    if 200 <= status < 300:
        return Outcome.DELIVERED
    if status in RATE_LIMIT_STATUSES:
        return Outcome.RETRY if retry_on_http_429 else Outcome.REFUSED
    if status >= 500:
        return Outcome.RETRY
    if status == 413:
        return Outcome.TOO_LARGE
    return Outcome.REFUSED


def parse_retry_after(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """``Retry-After`` as seconds from now; None when absent or anything but RFC 9110's
    delta-seconds (ASCII digits: ``str.isdigit`` also takes "²", which ``float`` refuses) or
    HTTP-date, so that the backoff is used instead."""
    if not value:
        return None
    value = value.strip()
    if not value.isascii():
        return None
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now())


def backoff_delay(backoff_s: float) -> float:
    """Jittered delay: between 75% and 100% of the current backoff, so shards spread out."""
    return backoff_s * (0.75 + 0.25 * random.random())


class Delay(NamedTuple):
    """How long to wait, and why a receiver's ``Retry-After`` was not taken as it was ("")."""

    seconds: float
    adjusted: str = ""


class Backoff:
    """One request's waits between tries: doubling from ``min_s`` to ``max_s``.

    A receiver's ``Retry-After`` is honoured between two bounds: never sooner than the current
    backoff step (``Retry-After: 0`` would make a hot loop) and never later than
    ``max_retry_after_s`` (``Retry-After: 999999`` would stop delivery for days while the queue
    overflows).
    """

    def __init__(self, min_s: float, max_s: float, max_retry_after_s: float = 300.0) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self.max_retry_after_s = max_retry_after_s
        self.current_s = min_s

    def next_delay(
        self, retry_after_s: float | None = None, slowest: bool = False, down: bool = False
    ) -> Delay:
        """The wait before the next try; ``slowest`` for faults that take long to clear (TLS),
        ``down`` for a refused connection (at most ``RECEIVER_DOWN_RETRY_S``)."""
        if slowest:
            self.current_s = self.max_s
        step = backoff_delay(self.current_s)
        self.current_s = min(self.current_s * 2, self.max_s)
        if down:
            step = min(step, RECEIVER_DOWN_RETRY_S)
        if retry_after_s is None:
            return Delay(step)
        if retry_after_s < step:
            return Delay(
                step, f"Retry-After {retry_after_s:g} s raised to the backoff's {step:.3f} s"
            )
        if retry_after_s > self.max_retry_after_s:
            return Delay(
                self.max_retry_after_s,
                f"Retry-After {retry_after_s:g} s capped at max_retry_after "
                f"{self.max_retry_after_s:g} s",
            )
        return Delay(retry_after_s)

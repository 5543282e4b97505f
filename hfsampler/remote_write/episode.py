"""Episode: how a fault that repeats is said in the log, for an endpoint's retries and refusals.

A fault is said when it starts, again when its kind changes ("HTTP 503" becomes a refused
connection) or every ``REMINDER_S``, and its end once; the repeats between go to debug, while
the caller counts every one in its metrics. An edge node in a long outage retries every
``max_backoff`` on every shard, and a receiver that refuses every window does so every window:
a line each would bury the one line that says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable

REMINDER_S = 300.0  # how often a fault that goes on is said again


class Episode:
    """One endpoint's stretch of a fault (``noun``: "retries", "refusals"), shared by its
    shards."""

    def __init__(
        self,
        noun: str,
        reminder_s: float = REMINDER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.noun = noun
        self.reminder_s = reminder_s
        self._clock = clock
        self.since: float | None = None
        self.count = 0
        self._said_at = 0.0
        self._said_kind = ""

    def happened(self, kind: str) -> str | None:
        """Counts one occurrence of ``kind``: what to add to its line when it is to be said
        (at the caller's level), or None to say it at debug."""
        now = self._clock()
        self.count += 1
        if self.since is None:
            self.since = now
            note = f"; later {self.noun} are said every {self.reminder_s:.0f} s or on a new reason"
        elif kind == self._said_kind and now - self._said_at < self.reminder_s:
            return None
        else:
            note = f"; {self.count} {self.noun} over {now - self.since:.0f} s"
        self._said_at, self._said_kind = now, kind
        return note

    def ended(self) -> tuple[int, float] | None:
        """Ends the stretch: (occurrences, seconds) when one was going on, else None."""
        if self.since is None:
            return None
        ended = (self.count, self._clock() - self.since)
        self.since, self.count, self._said_kind = None, 0, ""
        return ended

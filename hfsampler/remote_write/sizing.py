"""Sizing: how many samples each shard's queue holds, from what a window brings and
``queue_config``.

A window arrives whole (every series' sample at once), before the sender can take any of it: a
queue smaller than a window would drop part of every window, however fast the receiver. So the
bound is counted in windows of the plan (selected fields x GPUs and MIG instances x series per
field, plus hfsampler's own series): without ``capacity`` a shard holds ``DEFAULT_WINDOWS``
windows, or Prometheus's 10,000 samples where that is more; an explicit ``capacity`` is the
user's bound, but never less than one whole window (raised, and said). A memory queue keeps its
newest window whole even when the plan underestimated it (``queue.MemoryQueue``); past the bound
the oldest windows are dropped, counted and said as ``queue_full``.

A native histogram (issue 26) is queued as one sample of its series, as a float is, so a window's
samples count each histogram series once, as the plan's window (``planned_series``) must. Its bytes
are its encoded message, about 90 bytes for a GPU's power at 5% (19 buckets) and a few hundred at
most, beside a float's 32: a GPU's power histogram adds about 2% to the bytes of its default series.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfsampler.remote_write.config import DEFAULT_CAPACITY, QueueConfig

# Windows a shard's memory queue holds by default: a receiver's restart or a short outage (10 s
# at 1 s windows) loses nothing without a queue_dir. At 64 sim GPUs a window is about 14,000
# samples, and a queued sample costs about 32 bytes (value, timestamp, series reference, series
# end): 10 windows are about 4.5 MB.
DEFAULT_WINDOWS = 10


@dataclass(frozen=True, slots=True)
class QueueBound:
    """One shard's bound in samples, and what it comes from."""

    samples: int  # a shard's queue holds at most this many (its newest window always)
    window_samples: int  # a window's samples per shard, by the plan (0: not known)
    raised_from: int | None = None  # an explicit capacity below one window, raised from this

    @property
    def windows(self) -> float:
        """Whole windows the bound holds (0 when the window's size is not known)."""
        return self.samples / self.window_samples if self.window_samples else 0.0

    def describe(self) -> str:
        """The bound as logs say it: in windows where their size is known."""
        if not self.window_samples:
            return f"{self.samples} samples per shard"
        windows = f"{self.windows:.3g}"
        return f"{windows} window{'' if windows == '1' else 's'}, {self.samples} samples per shard"


def queue_bound(queue: QueueConfig, window_samples: int, n_shards: int = 1) -> QueueBound:
    """The bound of each of ``n_shards`` shards for windows of ``window_samples`` samples (a
    window's series spread over the shards; 0: not known, the configured capacity as it is)."""
    per_shard = -(-window_samples // max(n_shards, 1))  # rounded up
    if not per_shard:
        return QueueBound(queue.capacity, 0)
    if queue.capacity_set:
        if queue.capacity < per_shard:
            return QueueBound(per_shard, per_shard, raised_from=queue.capacity)
        return QueueBound(queue.capacity, per_shard)
    return QueueBound(max(DEFAULT_CAPACITY, DEFAULT_WINDOWS * per_shard), per_shard)


def raised_warning(key: str, bound: QueueBound, counted_on: str = "these fields and GPUs") -> str:
    """What to say of an explicit capacity raised to one window (``key``: its path;
    ``counted_on``: what the window's samples were counted on)."""
    return (
        f"{key} is {bound.raised_from} sample{'' if bound.raised_from == 1 else 's'}, less "
        f"than one window ({bound.window_samples} samples per shard with {counted_on}): it is "
        f"raised to {bound.samples} at start, or "
        f"every window would lose its oldest part; give {bound.window_samples * DEFAULT_WINDOWS} "
        f"to hold {DEFAULT_WINDOWS} windows, or leave capacity out to have it sized from the plan"
    )

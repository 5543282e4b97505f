"""What the sampler process is asked to do: its groups (name, interval, fields) and its plan.

Plain, picklable data, so the file format and the planners can name a group without importing the
multiprocessing sampler.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hfsampler.config.settings import check_intervals
from hfsampler.fields import Field, realtime_group
from hfsampler.sources.base import SourceSpec


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One sampling group: its name, interval and fields (all from the inventory)."""

    name: str
    interval_s: float
    fields: tuple[Field, ...]


@dataclass(frozen=True, slots=True)
class SamplerPlan:
    """Everything the sampler process needs: picklable, no handles."""

    source: SourceSpec
    groups: tuple[GroupPlan, ...]
    ring_names: tuple[str, ...]
    status_name: str
    gpus: int
    late_threshold_s: float
    spin_s: float | None  # None: calibrate at start
    realtime_priority: int  # SCHED_FIFO priority to ask for; 0 keeps the normal scheduler
    log_level: int = logging.INFO  # the parent's, so that the process logs as the service does
    log_json: bool = False


def plan_groups(fields: Sequence[Field], intervals_s: Mapping[str, float]) -> list[GroupPlan]:
    """One group per interval name that has fields: the real-time lane's first
    (``realtime_group``), then the others fastest first.

    A field whose group has no interval is a ``ConfigError``: it is never left out unsaid.
    """
    check_intervals(fields, intervals_s)
    lane = realtime_group(fields, intervals_s)
    groups = [
        GroupPlan(name, interval, tuple(f for f in fields if f.group == name))
        for name, interval in intervals_s.items()
    ]
    return sorted((g for g in groups if g.fields), key=lambda g: (g.name != lane, g.interval_s))

"""Reload: what a new configuration changes for a running service (SIGHUP, as Prometheus does).

``plan_reload`` compares the running ``Config`` with the one just loaded and says what to do:
endpoints to start, to stop and to restart (a changed endpoint is stopped, its queue flushed or
left spooled, and started anew with the same spool directory); whether the series' labels changed
(the metric model is rebuilt: old series end with stale markers, new ones start); and which keys
cannot change without a restart (the sampler's source, fields and timing, the listen address,
the queue directory), which stay as they were, with one log line naming them. Which key is which
is its declaration's ``reload``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hfsampler.config.settings import KEYS, Config
from hfsampler.remote_write.config import EndpointConfig

# Keys the running metric model holds: a change rebuilds it.
LABEL_KEYS = tuple(k.field for k in KEYS if k.reload == "labels")
# Keys taken as they are, the endpoints (restarted one by one) included.
_TAKEN = tuple(k.field for k in KEYS if k.reload != "restart")
# Keys that need a restart to change.
RESTART_KEYS = tuple(k.field for k in KEYS if k.reload == "restart")


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload does; ``config`` is what runs after it (restart-only keys as they were)."""

    config: Config
    start: tuple[EndpointConfig, ...]
    stop: tuple[EndpointConfig, ...]
    labels_changed: bool
    needs_restart: tuple[str, ...]


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """The plan for going from ``old`` to ``new``."""
    needs_restart = []
    for name in RESTART_KEYS:
        if name == "intervals_s" and old.auto_intervals:
            continue  # probed at start: the file's intervals are not what runs
        if getattr(old, name) != getattr(new, name):
            needs_restart.append(name)
    running = {ep.remote_name: ep for ep in old.remote_write}
    wanted = {ep.remote_name: ep for ep in new.remote_write}
    stop = tuple(ep for name, ep in running.items() if wanted.get(name) != ep)
    start = tuple(ep for name, ep in wanted.items() if running.get(name) != ep)
    labels_changed = any(getattr(old, k) != getattr(new, k) for k in LABEL_KEYS)
    merged = replace(old, **{k: getattr(new, k) for k in _TAKEN})
    return ReloadPlan(merged, start, stop, labels_changed, tuple(needs_restart))

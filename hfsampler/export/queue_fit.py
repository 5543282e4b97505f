"""Queue fit: whether a configuration's windows fit the Remote-Write queues it sets, said by
`check-config` before any GPU is opened.

A queue without ``capacity`` is sized from the plan at start and always fits. An explicit
``capacity`` below one window is raised to one window at start (``remote_write.sizing``);
check-config says so beforehand. A window's series are counted as `run` counts them (the metric
model of the plan), on the sim source's GPUs as configured; for a source whose GPUs are found
only at start, on a sim node of as many GPUs as ``devices`` lists, else ``ASSUMED_GPUS``; with
the consumers' series where the source reads them (``consumers: auto`` counts ``auto`` as NVML).
"""

from __future__ import annotations

from hfsampler.config.settings import Config
from hfsampler.export.consumer_run import planned_series as consumers_planned
from hfsampler.export.metrics import build_model
from hfsampler.remote_write.sizing import queue_bound, raised_warning
from hfsampler.sampling.groups import plan_groups
from hfsampler.sampling.plan import discover
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.sources.base import SourceSpec

ASSUMED_GPUS = 8  # an HGX or DGX node: the most GPUs a node commonly has


def window_samples(config: Config) -> tuple[int, str]:
    """A window's samples by the plan, and the GPUs they were counted on (for the message)."""
    mig: tuple[str, ...] = ()
    if config.source == "sim":
        gpus, what, mig = config.sim_gpus, f"{config.sim_gpus} sim GPUs", config.sim_mig
        if mig:
            what += f" with MIG {','.join(mig)}"
    else:
        gpus = len(config.devices) if config.devices else ASSUMED_GPUS
        what = f"{gpus} GPUs" + ("" if config.devices else " (a node's usual most)")
    spec = SourceSpec(kind="sim", gpus=gpus, sim_mig=mig)
    inventory = discover(spec, config.selected_fields(), config.intervals_s)
    groups = {p.name: p.fields for p in plan_groups(inventory.fields, config.intervals_s)}
    model = build_model(config, inventory.devices, groups, SelfMetrics())
    kind = "sim" if config.source == "sim" else "nvml" if config.source == "auto" else config.source
    return model.planned_series() + consumers_planned(config, kind, inventory.devices), what


def queue_warnings(config: Config) -> list[str]:
    """One line per endpoint whose explicit ``capacity`` cannot hold one window."""
    explicit = [(i, ep) for i, ep in enumerate(config.remote_write) if ep.queue.capacity_set]
    if not explicit or config.source == "jetson":  # a Jetson's one GPU: a few hundred series
        return []
    samples, what = window_samples(config)
    out = []
    for i, ep in explicit:
        bound = queue_bound(ep.queue, samples, ep.queue.min_shards)
        if bound.raised_from is not None:
            key = f"remote_write[{i}].queue_config.capacity"
            out.append(raised_warning(key, bound, f"these fields on {what}"))
    return out

"""The sampling plan: the one way a command turns a ``Config`` into what the sampler samples.

`run` and `record` build their run here from the same config and flags: the source it names
(``resolve_source``), the groups a probe recommends for ``intervals: auto``, the devices and
fields the source has (``discover``), and one ``GroupPlan`` per interval (``plan_groups``). So a
group or field that `run` samples is recorded too. ``Config`` refuses a selected field whose
group has no interval at load; ``plan_groups`` refuses one too, never dropping it in silence.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from hfsampler.config.settings import Config
from hfsampler.fields import Field, expand_mig, expand_xid
from hfsampler.sampling.groups import GroupPlan, plan_groups
from hfsampler.sampling.resolve import resolve_source
from hfsampler.sources.base import Inventory, SourceSpec
from hfsampler.sources.registry import open_source

log = logging.getLogger("hfsampler")


def discover(
    spec: SourceSpec, wanted: Sequence[Field], intervals_s: Mapping[str, float] | None = None
) -> Inventory:
    """Open the source once here to learn the devices and fields, then release it.

    Fields that no GPU supports are left out (the source logs each once). The XID counter is one
    field per code (``expand_xid``). With the groups' ``intervals_s``, the fields NVML has per
    MIG instance get their per-instance twins (``expand_mig``), kept where a GPU has MIG on.
    """
    fields = expand_xid(wanted)
    if intervals_s is not None:
        fields = expand_mig(fields, intervals_s)
    source = open_source(spec)
    try:
        inventory = source.open(fields)
    finally:
        source.close()
    keep: npt.NDArray[np.bool_] = np.asarray(inventory.supported.any(axis=0))
    if not keep.all():
        kept = tuple(f for f, k in zip(inventory.fields, keep, strict=True) if k)
        return Inventory(inventory.devices, kept, inventory.supported[:, keep])
    return inventory


@dataclass(frozen=True, slots=True)
class RunPlan:
    """What one run samples: its config (with any probed groups), source, inventory, groups."""

    config: Config
    spec: SourceSpec
    inventory: Inventory
    groups: tuple[GroupPlan, ...]

    @property
    def fields(self) -> tuple[Field, ...]:
        """Every field sampled, group by group (what a recording's header lists)."""
        return tuple(f for g in self.groups for f in g.fields)

    def only(self, positions: Sequence[int]) -> RunPlan:
        """The plan for the devices at ``positions`` (nvml: the source opens only those)."""
        if self.spec.kind != "nvml" or len(positions) == len(self.inventory.devices):
            return self
        # a MIG instance's slot is its GPU's: that GPU opens with all its slots
        indices = tuple(dict.fromkeys(self.inventory.devices[p].index for p in positions))
        return _planned(self.config, replace(self.spec, indices=indices))


def build_run(config: Config) -> RunPlan:
    """The run ``config`` asks for: every command that samples starts here."""
    spec = resolve_source(config)
    if config.auto_intervals:
        from hfsampler.sampling.probe import apply_recommendation, probe  # for `auto` alone

        log.info("measuring refresh periods for --intervals auto (a few seconds)...")
        result = probe(spec, config.selected_fields(), window_s=config.window_s)
        config = apply_recommendation(config, result)
        log.info(
            "groups from the probe: %s",
            ", ".join(f"{n} {s * 1e3:g} ms" for n, s in sorted(config.intervals_s.items())),
        )
    return _planned(config, spec)


def _planned(config: Config, spec: SourceSpec) -> RunPlan:
    inventory = discover(spec, config.selected_fields(), config.intervals_s)
    groups = plan_groups(inventory.fields, config.intervals_s)
    return RunPlan(config, spec, inventory, tuple(groups))

"""Which source a ``Config`` asks for, as the ``SourceSpec`` the sampler opens.

The one place ``source: auto`` is decided (nvml where a driver answers, else jetson on a Tegra,
else sim with a warning), and ``source: jetson`` refused where there is no Jetson; shared by
every command that samples; it lives beside the sources rather than in the CLI, so
`probe` and `record` need not import the CLI that registers them.
"""

from __future__ import annotations

import logging

from hfsampler.config.settings import KEYS, Config
from hfsampler.errors import ConfigError
from hfsampler.sources.base import SourceSpec

log = logging.getLogger("hfsampler")


def resolve_source(config: Config) -> SourceSpec:
    """The source to use. `auto`: NVML when it is usable; else, on a Jetson (a Tegra), its sysfs;
    else the sim, with a warning."""
    kind = config.source
    root = config.jetson_sysfs_root or "/"
    if kind == "auto":
        # pynvml and the sysfs probe load only when they are wanted
        from hfsampler.sources.jetson.sysfs import is_tegra
        from hfsampler.sources.nvml.source import probe_driver

        reason = probe_driver()
        if reason is None:
            kind = "nvml"
        elif is_tegra(root):
            log.info("no usable NVML (%s) on this Jetson: reading its sysfs (--source jetson)",
                     reason)  # fmt: skip
            kind = "jetson"
        else:
            log.warning(
                "no usable NVIDIA driver (%s): sampling %d SIMULATED GPUs instead "
                "(pass --source sim to silence this, --source nvml to insist on real GPUs)",
                reason,
                config.sim_gpus,
            )
            kind = "sim"
    elif kind == "jetson":
        _check_jetson(root)
    settings = {k.spec: getattr(config, k.field) for k in KEYS if k.spec is not None}
    return SourceSpec(kind=kind, jetson_root=root, **settings)


def _check_jetson(root: str) -> None:
    """``--source jetson`` where there is no Jetson is the user's mistake: say so, do not sample
    a GPU that is not there."""
    from hfsampler.sources.jetson.sysfs import NVIDIA_GPU_NODES, TEGRA, is_tegra

    if not is_tegra(root):
        where = "this machine" if root == "/" else f"jetson.sysfs_root {root!r}"
        raise ConfigError(
            "source",
            f"jetson, but {where} is not a Jetson (no {TEGRA}* in proc/device-tree/compatible, "
            f"no devfreq GPU node named {'/'.join(NVIDIA_GPU_NODES)})",
            "run it on a Jetson, or use --source auto, nvml or sim",
        )

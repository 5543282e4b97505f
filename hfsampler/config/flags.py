"""The flags that set a ``Config``: each defined once, and one function turning them into it.

`run`, `record` and `probe` register the flags they take with ``add_sampling_flags`` (a command
words a flag's help for itself where `run`'s wording does not fit) and build their ``Config``
with ``config_from_args``. A flag's name, metavar, type and what it changes in the ``Config`` are
the same wherever it is taken; a flag that sets one ``Config`` field is one row of ``FLAGS``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hfsampler import fields as catalogue
from hfsampler.config.settings import (
    LOG_FORMATS,
    LOG_LEVELS,
    SOURCES,
    Config,
    load_file,
    parse_label,
    with_remote_write_urls,
)
from hfsampler.durations import parse_duration
from hfsampler.sources.sim.mig import parse_layout

Convert = Callable[[str, str], Any]  # (the flag's value, its name) -> the Config's value


def _blank_is_none(value: str, name: str) -> str | None:
    return value or None  # '' turns the setting off


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag as every command that takes it spells it; ``help`` is `run`'s wording.

    ``key`` is the ``Config`` field the flag sets, its value passed through ``convert`` (which
    raises ``ConfigError`` naming the flag: a mistake in a flag reads like one in the file);
    flags without a key change the ``Config`` in ways ``config_from_args`` spells out.
    """

    name: str
    help: str | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    repeat: bool = False  # given once per value, collected in a list
    key: str | None = None
    convert: Convert | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


# In `hfsampler run --help` order.
FLAGS: tuple[Flag, ...] = (
    Flag(
        "--config",
        "YAML config file (repeatable: a later file's keys replace an earlier's, e.g. a "
        "Secret's remote_write over a ConfigMap's; flags override both)",
        metavar="FILE",
        repeat=True,
    ),
    Flag(
        "--source",
        "default: auto (NVML; on a Jetson without NVML, jetson; else sim)",
        choices=SOURCES,
        key="source",
    ),
    Flag("--gpus", "simulated GPUs (sim source)", metavar="N", type=int, key="sim_gpus"),
    Flag("--seed", "seed of the simulated GPUs", type=int, key="seed"),
    Flag(
        "--sim-mig",
        "MIG layout of every simulated GPU, e.g. 3g,2g,1g,1g (H200 profiles)",
        metavar="LAYOUT",
        key="sim_mig",
        convert=parse_layout,
    ),
    Flag("--interval", "the fast group's interval, e.g. 1ms", metavar="DUR"),
    Flag(
        "--intervals",
        "auto: measure refresh periods at start (hfsampler probe) and group fields by them",
        choices=("auto",),
    ),
    Flag(
        "--window",
        "window length, e.g. 1s (default)",
        metavar="DUR",
        key="window_s",
        convert=parse_duration,
    ),
    Flag(
        "--listen",
        "/metrics address; '' turns it off",
        metavar="HOST:PORT",
        key="listen",
        convert=_blank_is_none,
    ),
    Flag(
        "--duration",
        "stop after this long, e.g. 10s",
        metavar="DUR",
        key="duration_s",
        convert=parse_duration,
    ),
    Flag("--label", "external label (repeatable)", metavar="K=V", repeat=True),
    Flag(
        "--fields",
        "comma-separated field names or groups (fast, slow, gpm; all: per-link NVLink too)",
        metavar="LIST",
        repeat=True,
    ),
    Flag("--remote-write", "push to (repeatable)", metavar="URL", repeat=True),
    Flag(
        "--realtime-priority",
        "the sampler's SCHED_FIFO priority when allowed (default 1; 0: normal scheduler)",
        metavar="N",
        type=int,
        key="realtime_priority",
    ),
    Flag(
        "--pod-resources-socket",
        "kubelet pod-resources socket: add pod, namespace, container labels",
        metavar="PATH",
        key="pod_resources_socket",
        convert=_blank_is_none,
    ),
    Flag(
        "--hostname",
        "the Hostname label (in Kubernetes: the node's name)",
        metavar="NAME",
        key="hostname",
        convert=_blank_is_none,
    ),
    Flag(
        "--instance",
        "the instance label (default HOST:PORT, as a scrape would add; '' for none)",
        metavar="VALUE",
        key="instance",
    ),
    Flag(
        "--hpc-job-mapping-dir",
        "one file per GPU naming its jobs: hpc_job",
        metavar="DIR",
        key="hpc_job_mapping_dir",
        convert=_blank_is_none,
    ),
    Flag(
        "--queue-dir",
        "spool Remote-Write queues here (survives restarts)",
        metavar="DIR",
        key="queue_dir",
        convert=_blank_is_none,
    ),
    Flag("--log-level", choices=LOG_LEVELS, key="log_level"),
    Flag("--log-format", choices=LOG_FORMATS, key="log_format"),
)
BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}


def add_sampling_flags(
    parser: argparse.ArgumentParser,
    names: Sequence[str] | None = None,
    *,
    wording: Mapping[str, str | None] | None = None,
    sources: tuple[str, ...] = SOURCES,
) -> None:
    """Register the flags ``names`` (every one in ``FLAGS`` when None) on ``parser``, in order.

    ``wording`` replaces a flag's help for this command (None: no help text); ``sources`` narrows
    ``--source`` to the kinds the command can drive.
    """
    wording = wording or {}
    for name in names if names is not None else BY_NAME:
        flag = BY_NAME[name]
        options: dict[str, Any] = {
            "help": wording.get(name, flag.help),
            "metavar": flag.metavar,
            "choices": sources if name == "--source" else flag.choices,
        }
        if flag.type is not None:
            options["type"] = flag.type
        if flag.repeat:
            options.update(action="append", default=[])  # a new list per parser
        parser.add_argument(name, **options)


def config_from_args(args: argparse.Namespace, base: Config | None = None) -> Config:
    """``base`` (default ``Config()``), each ``--config`` file over it, then every flag given.

    Every command that samples builds its ``Config`` here. A flag a command registers itself must
    not take the ``dest`` of one in ``FLAGS`` (`record`'s ``--gpus`` selects GPUs: ``gpu_list``).
    """
    # A flag the command does not take reads as not given.
    args = argparse.Namespace(**({f.dest: [] if f.repeat else None for f in FLAGS} | vars(args)))
    config = base if base is not None else Config()
    for path in args.config:
        config = load_file(path, config)
    changes: dict[str, Any] = {}
    if args.intervals == "auto":
        changes["auto_intervals"] = True
    if args.interval is not None:
        intervals = dict(config.intervals_s)
        intervals[catalogue.FAST] = parse_duration(args.interval, "--interval")
        changes["intervals_s"] = intervals
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if flag.key is not None and value is not None:
            changes[flag.key] = value if flag.convert is None else flag.convert(value, flag.name)
    if args.label:
        changes["external_labels"] = {
            **config.external_labels,
            **dict(map(parse_label, args.label)),
        }
    if args.fields:
        changes["fields"] = tuple(t for item in args.fields for t in item.split(",") if t.strip())
    config = replace(config, **changes) if changes else config
    return with_remote_write_urls(config, args.remote_write)

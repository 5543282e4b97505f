"""The `probe` command: its flags, and a probe of the fields with its table or JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from hfsampler.config.flags import add_sampling_flags, config_from_args
from hfsampler.sampling.probe import DURATION_S, format_table, probe
from hfsampler.sampling.resolve import resolve_source


def register(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add `hfsampler probe` to the CLI (see ``hfsampler.cli.main.COMMAND_MODULES``)."""
    p = sub.add_parser("probe", help="measure field latency and refresh periods, recommend groups")
    add_sampling_flags(
        p,
        ("--config", "--source", "--gpus", "--duration", "--fields"),
        wording={
            "--config": "YAML config file (repeatable; flags override it): its source, fields, "
            "jetson.sysfs_root...",
            "--source": None,
            "--duration": "refresh measurement length",
            "--fields": None,
        },
        sources=("auto", "nvml", "sim", "jetson"),
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return {"probe": cmd_probe}


def cmd_probe(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    spec = resolve_source(config)
    duration_s = config.duration_s if config.duration_s is not None else DURATION_S
    result = probe(spec, config.selected_fields(), duration_s)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_table(result))
    return 0

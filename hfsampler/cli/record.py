"""The `record` command: its flags, and a recorder run around the job."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hfsampler import logs
from hfsampler.config.flags import add_sampling_flags, config_from_args
from hfsampler.config.settings import Config
from hfsampler.errors import ConfigError
from hfsampler.fields import FAST, Kind
from hfsampler.profiling.job_markers import PATTERN_HELP, compile_patterns
from hfsampler.profiling.record import (
    EXIT_CANNOT_EXECUTE,
    EXIT_INCOMPLETE,
    EXIT_NOT_FOUND,
    Recorder,
    RecordOptions,
    choose,
    log,
    visible_gpus,
)
from hfsampler.sampling.plan import build_run

EXIT_STATUS_HELP = f"""exit status:
  CMD's own status (128 + N when signal N ended it); once CMD has started it runs to its end
  whatever happens to the recording (a full disk stops the recording, not CMD).
  {EXIT_INCOMPLETE}  CMD succeeded but the recording is incomplete (the disk filled, the file system
      failed, the sampler died); the log and the file's end say why
  {EXIT_NOT_FOUND} CMD not found; {EXIT_CANNOT_EXECUTE} found but not executable (as a shell says)
  1   the recording could not start (its file, the GPUs); CMD did not run
  2   a mistake in the flags or config"""


def register(sub: Any) -> dict[str, Any]:
    p = sub.add_parser(
        "record",
        help="record every GPU sample while a command runs: hfsampler record -- CMD ARGS",
        description="Run CMD as a child and record the GPUs it may use for exactly its life.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    wording = {
        "--config": "YAML config file (repeatable; flags override it): its source, fields, "
        "intervals, jetson.sysfs_root...",
        "--interval": "the fast group's interval (default 1ms)",
        "--window": "window length for the statistics (1s)",
        "--label": "job label",
        "--duration": "without a command: record this long",
        "--source": None,
        "--fields": "field names or groups (default: all but the opt-in per-link NVLink)",
    }
    p.add_argument("-o", "--output", default="run.hfs", metavar="FILE", help="default run.hfs")
    add_sampling_flags(p, ("--config", "--interval", "--window"), wording=wording)
    # Not the sampling --gpus (how many simulated GPUs): which of this node's GPUs to record.
    gpus_help = "GPU indices, UUIDs or MIG UUIDs (default: CUDA_VISIBLE_DEVICES, else all)"
    p.add_argument("--gpus", dest="gpu_list", metavar="LIST", help=gpus_help)
    add_sampling_flags(
        p,
        ("--label", "--duration", "--source", "--seed", "--sim-mig", "--fields", "--procfs"),
        wording=wording,
        sources=("auto", "nvml", "sim", "jetson"),
    )
    p.add_argument("--quiet", action="store_true", help="no status line")
    p.add_argument("--mark-pattern", action="append", default=[], metavar="REGEX",
                   help=PATTERN_HELP)  # fmt: skip
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    return {"record": cmd_record}


def options(args: argparse.Namespace) -> RecordOptions:
    command = tuple(args.argv[1:] if args.argv[:1] == ["--"] else args.argv)
    config = config_from_args(args, Config(listen=None))  # `run`'s groups, gpm too
    if not command and config.duration_s is None:
        raise ConfigError("record", "nothing to record", "give -- CMD ARGS or --duration 10s")
    if args.mark_pattern and not command:
        raise ConfigError("--mark-pattern", "matches a command's output, and there is none",
                          "give -- CMD ARGS, or leave --mark-pattern out")  # fmt: skip
    wanted = visible_gpus(args.gpu_list, os.environ)
    if wanted and config.source == "sim" and all(t.isdigit() for t in wanted):
        config = replace(config, sim_gpus=max(int(t) for t in wanted) + 1)
    return RecordOptions(
        Path(args.output), command, config.duration_s, config,
        tuple(wanted) if wanted else None, status=not args.quiet,
        mark_patterns=compile_patterns(args.mark_pattern),
    )  # fmt: skip


def cmd_record(args: argparse.Namespace) -> int:
    opts = options(args)
    logs.setup(opts.config.log_level, opts.config.log_format)
    plan = build_run(opts.config)
    keep = choose(plan.inventory.devices, opts.gpus)
    if plan.spec.kind == "nvml" and len(keep) < len(plan.inventory.devices):
        # open only the job's GPUs: the others are not ours to read at 1 kHz
        plan = plan.only(keep)
        keep = choose(plan.inventory.devices, opts.gpus)
    if not keep or not plan.fields:
        log.error("nothing to record: no GPU or no supported field")
        return 1
    fast = [f for f in plan.fields if f.group == FAST and f.kind is Kind.GAUGE]
    gpus = sum(plan.inventory.devices[p].is_gpu for p in keep)
    log.info("recording %d GPU(s)%s, %d fields (%d fast) to %s", gpus,
             f" and {len(keep) - gpus} MIG instance slot(s)" if len(keep) > gpus else "",
             len(plan.fields), len(fast), opts.output)  # fmt: skip
    out = sys.stderr if opts.status else None
    return Recorder(opts, plan, keep, out).run()

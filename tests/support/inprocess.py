"""`run` and `record` in this process on a virtual clock: the sim through N windows in milliseconds.

The commands' own pieces (flags, ``build_run``, ``Service``, ``Recorder``) with a ``VirtualClock``,
so the window pipeline samples the source in this process (``SteppingSampler``) and nothing
sleeps. What only a real process shows (signals, exit codes, the sampler's priority) stays in the
subprocess tests.
"""

from __future__ import annotations

import socket
import time

from hfsampler.cli.main import build_parser
from hfsampler.cli.record import options
from hfsampler.config.flags import config_from_args
from hfsampler.profiling.record import Recorder, choose
from hfsampler.sampling.plan import RunPlan, build_run
from hfsampler.sampling.stepping import VirtualClock


def start_ns() -> int:
    """A start a minute ago, 0.3 s into a second (so the first window is a part one)."""
    return (time.time_ns() // 10**9 - 60) * 10**9 + 300_000_000


def run_plan(*argv: str) -> RunPlan:
    """The plan `hfsampler run ARGV` samples."""
    parser, _ = build_parser()
    return build_run(config_from_args(parser.parse_args(["run", *argv])))


def record(*argv: str, clock: VirtualClock) -> int:
    """`hfsampler record ARGV` on ``clock`` (without its logging setup); its exit status."""
    parser, _ = build_parser()
    opts = options(parser.parse_args(["record", *argv]))
    plan = build_run(opts.config)
    keep = choose(plan.inventory.devices, opts.gpus)
    return Recorder(opts, plan, keep, None, clock=clock).run()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

"""Commands in this process: any `hfsampler COMMAND` through ``main``, and `run` and `record` on a
virtual clock (the sim through N windows in milliseconds).

``hfsampler`` calls ``main`` with its output captured, as a fresh process would run it: a test
that checks what a command prints and returns needs no interpreter of its own (a second of CPU
each). ``record`` and ``run_plan`` take the commands' own pieces (flags, ``build_run``,
``Service``, ``Recorder``) with a ``VirtualClock``, so the window pipeline samples the source in
this process (``SteppingSampler``) and nothing sleeps. What only a real process shows (signals,
exit codes and stderr as a shell sees them, a piped stdout, the sampler's priority) stays in the
subprocess tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hfsampler.cli.main import build_parser, main
from hfsampler.cli.record import options
from hfsampler.config.flags import config_from_args
from hfsampler.profiling.record import FORWARDED, Recorder, choose
from hfsampler.sampling.plan import RunPlan, build_run
from hfsampler.sampling.stepping import VirtualClock

# What a command may change in this process that a test after it must not inherit: ``record``
# installs its signal forwarding, ``run`` (logs.setup) the root logger's handler and level and
# aiohttp's access log level.
_SIGNALS = (signal.SIGINT, *FORWARDED)
_LOGGERS = ("", "aiohttp.access")


@dataclass(frozen=True, slots=True)
class Exited:
    """What a shell sees of a command: its exit status and what it wrote."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _process_state_restored() -> Iterator[None]:
    """Signal handlers and logging as they were before, whatever the command set up."""
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    saved = [(lg, lg.handlers[:], lg.level) for lg in loggers]
    try:
        yield
    finally:
        for lg, kept, level in saved:
            lg.handlers[:] = kept
            lg.setLevel(level)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def hfsampler(*argv: str) -> Exited:
    """`hfsampler ARGV` through ``main`` in this process: its status (an argparse error's
    SystemExit included) and its stdout and stderr.

    The root logger starts as a fresh process has it, without handlers (pytest's are set aside
    meanwhile), so a command that sets up no logging (report, replay) has its warnings written to
    stderr by logging's last resort, as a user sees them; one that does (run) logs to the
    captured stderr. Both are put back afterwards, with the signal handlers.
    """
    out, err = io.StringIO(), io.StringIO()
    with _process_state_restored():
        root = logging.getLogger()
        root.handlers[:] = []
        root.setLevel(logging.WARNING)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(argv))
            except SystemExit as exc:  # argparse: --help, --version, a bad flag
                status = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return Exited(status, out.getvalue(), err.getvalue())


def start_ns() -> int:
    """A start a minute ago, 0.3 s into a second (so the first window is a part one)."""
    return (time.time_ns() // 10**9 - 60) * 10**9 + 300_000_000


async def reloaded(caplog: pytest.LogCaptureFixture) -> None:
    """Until the service has logged its reload (a clock action: the windows up to it were made
    while the reload ran); at most 30 s of real time."""
    for _ in range(3000):
        if "configuration reloaded" in caplog.text:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reloaded in 30 s")


def run_plan(*argv: str) -> RunPlan:
    """The plan `hfsampler run ARGV` samples."""
    parser, _ = build_parser()
    return build_run(config_from_args(parser.parse_args(["run", *argv])))


def record(*argv: str, clock: VirtualClock) -> int:
    """`hfsampler record ARGV` on ``clock`` (without its logging setup); its exit status. The
    signal forwarding it installs is undone afterwards."""
    parser, _ = build_parser()
    opts = options(parser.parse_args(["record", *argv]))
    plan = build_run(opts.config)
    keep = choose(plan.inventory.devices, opts.gpus)
    with _process_state_restored():
        return Recorder(opts, plan, keep, None, clock=clock).run()


def record_sim(out: Path, *argv: str) -> Path:
    """`hfsampler record --source sim --quiet ARGV -o OUT` on a virtual clock from a minute ago,
    of every sim GPU whatever CUDA_VISIBLE_DEVICES the test run has; OUT."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        status = record("--source", "sim", "--quiet", *argv, "-o", str(out),
                        clock=VirtualClock(start_ns()))  # fmt: skip
    assert status == 0, f"record exited {status}"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

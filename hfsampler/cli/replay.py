"""The `replay` command: its flags, and a recording pushed to a receiver."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import Any

from hfsampler.cli.aio import run_async
from hfsampler.config.labels import parse_label
from hfsampler.durations import parse_duration
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import RecordingError
from hfsampler.profiling.replay import TIMEOUT_S, replay


def register(sub: Any) -> dict[str, Any]:
    p = sub.add_parser("replay", help="push a recording to a Remote-Write receiver")
    p.add_argument("recording", metavar="RUN.hfs")
    p.add_argument("--remote-write", required=True, metavar="URL", help="receiver's write URL")
    p.add_argument("--raw", action="store_true", help="every raw sample (NAME_raw series)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="extra label")
    p.add_argument(
        "--timeout",
        default=f"{TIMEOUT_S:g}s",
        metavar="DUR",
        help=f"give up after this long, with a summary of what was not sent (default "
        f"{TIMEOUT_S:g}s)",
    )
    return {"replay": cmd_replay}


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        rec = Recording(args.recording)
    except RecordingError as exc:  # not a recording, or one of another format: the user's input
        print(f"hfsampler: error: {exc}", file=sys.stderr)
        return 2
    extra = dict(parse_label(t) for t in args.label)
    timeout_s = parse_duration(args.timeout, "--timeout")

    async def main() -> int:
        stop = asyncio.Event()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        result = await replay(rec, args.remote_write, args.raw, extra, timeout_s, stop)
        print(result.summary(args.recording, timeout_s))
        return result.exit_code

    return run_async(main)

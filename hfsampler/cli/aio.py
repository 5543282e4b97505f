"""The event loop the async commands run on: uvloop, or asyncio's own where it cannot load."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("hfsampler")


def run_async(factory: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a coroutine on uvloop, or on asyncio's own loop where uvloop cannot load."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        log.info("uvloop is not available; using asyncio's default event loop")
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(factory())

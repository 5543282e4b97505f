"""The sampler: deadline loops in their own process that read a source into the rings.

It runs apart from the service's event loop because a busy asyncio loop in the same interpreter
holds the GIL for milliseconds and the ticks would be late. Each sampling group has its own
interval and ring. Inside the process (``sampling.lanes``) the fastest group has a thread to
itself and every other group shares a second one, so a slow read never delays a fast tick; each
loop sleeps to its next deadline (the fast one spins the last stretch only when a calibration at
start shows that sleep alone overshoots too much) and counts ticks, late ticks and missed ticks
per group. Repeats (a driver timestamp that did not change) are kept out of the samples by the
rings' readers, once per window rather than on every tick.

The rings are checked before they are made: no more than ``max_ring_bytes`` in all, and room for
them in the shared-memory directory. When the process ends on its own, the parent learns why (its
exception, sent over a pipe, or the signal or status it ended with) and says so in one line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import multiprocessing.process
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import numpy as np
import numpy.typing as npt

from hfsampler import logs
from hfsampler.config.settings import DEFAULT_MAX_RING_BYTES
from hfsampler.errors import ConfigError, SourceError
from hfsampler.sampling import spawning
from hfsampler.sampling.groups import GroupPlan, SamplerPlan
from hfsampler.sampling.lanes import (
    ERROR,
    FAILED,
    GLOBAL_SLOTS,
    PER_GROUP,
    PID,
    PR_SET_PDEATHSIG,
    RT_PRIORITY,
    SPIN_NS,
    STARTING,
    STATE,
    STOP,
    STOPPED,
    StuckRead,
    prctl,
    run_lanes,
)
from hfsampler.sampling.ring import (
    ROOM_FIX,
    Ring,
    SharedInts,
    block_bytes,
    check_room,
    format_bytes,
    ring_bytes,
    shm_dir,
    sweep_orphans,
)
from hfsampler.sources.base import BoolArray as BoolMask
from hfsampler.sources.base import DeviceInfo, Inventory, SourceSpec
from hfsampler.sources.registry import open_source

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupCounters:
    ticks: int
    late: int
    missed: int


def ring_capacity(interval_s: float, window_s: float, windows: float = 4.0) -> int:
    """Rows for ``windows`` windows of ticks: the reader takes one window, the rest is slack."""
    return max(16, math.ceil(windows * window_s / interval_s))


def _status_slots(groups: int, gpus: int) -> int:
    return GLOBAL_SLOTS + PER_GROUP * groups + gpus


def shared_bytes_needed(groups: Sequence[GroupPlan], gpus: int, window_s: float) -> int:
    """The shared memory a sampler for these groups takes: every ring and the status block."""
    rings = sum(
        ring_bytes(ring_capacity(g.interval_s, window_s), gpus, len(g.fields)) for g in groups
    )
    return rings + block_bytes(8 * _status_slots(len(groups), gpus))


def check_ring_memory(
    groups: Sequence[GroupPlan], gpus: int, window_s: float, max_ring_bytes: int
) -> int:
    """The bytes the rings need; a ``ConfigError`` naming what sized them when over the cap."""
    need = shared_bytes_needed(groups, gpus, window_s)
    if need > max_ring_bytes:
        intervals = ", ".join(f"{g.name} {g.interval_s * 1e3:g}ms" for g in groups)
        raise ConfigError(
            "max_ring_bytes",
            f"--window {window_s:g}s with intervals {intervals} on {gpus} GPU(s) needs "
            f"{format_bytes(need)} ({need} bytes) of sample rings, over the "
            f"{format_bytes(max_ring_bytes)} allowed",
            "shorten --window, lengthen the intervals, sample fewer GPUs or fields, or raise "
            "max_ring_bytes",
        )
    return need


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


EXIT_STUCK_READ = 3  # the child's status when it left a read the driver never returned from
_SIGNAL_HINTS: dict[int, str] = {
    signal.SIGBUS: " (its shared memory ran out: is /dev/shm full?)",
    signal.SIGKILL: " (the out-of-memory killer, or kill -9)",
    signal.SIGSEGV: " (a crash in native code: the NVML library or numpy)",
}


class LayoutTimeline:
    """The rows' devices over time, as the sampler process reports them (a MIG layout).

    Each entry holds from the time of the read that found it; a window asks for the devices
    that held in it and the rows that changed inside it. Entries no window can need again (all
    but the last before the window asked for) are dropped: windows only move forward.
    """

    def __init__(self, devices: Sequence[DeviceInfo]) -> None:
        self._entries: list[tuple[int, tuple[DeviceInfo, ...]]] = [(0, tuple(devices))]

    def add(self, since_ns: int, devices: Sequence[DeviceInfo]) -> None:
        if len(devices) != len(self._entries[0][1]):
            raise ValueError("a layout never changes the number of rows")
        self._entries.append((since_ns, tuple(devices)))

    def window(self, t0_ns: int, t1_ns: int) -> tuple[tuple[DeviceInfo, ...], BoolMask]:
        """The devices of ``[t0_ns, t1_ns)`` (the last that held in it) and per row whether
        it changed inside it."""
        entries = self._entries
        start = max(k for k, (since, _) in enumerate(entries) if since <= t0_ns or k == 0)
        del entries[:start]
        inside = [d for since, d in entries if since < t1_ns] or [entries[0][1]]
        first, last = inside[0], inside[-1]
        mixed = np.array(
            [any(d[r] != first[r] for d in inside) for r in range(len(first))], dtype=np.bool_
        )
        return last, mixed


class Sampler:
    """Owns the rings, the status block and the sampler process (the parent's side)."""

    def __init__(
        self,
        spec: SourceSpec,
        inventory: Inventory,
        groups: Sequence[GroupPlan],
        window_s: float,
        late_threshold_s: float | None = None,
        spin_s: float | None = None,
        realtime_priority: int = 0,
        max_ring_bytes: int = DEFAULT_MAX_RING_BYTES,
    ) -> None:
        self.spec = spec
        self.inventory = inventory
        self.groups = tuple(groups)
        gpus = len(inventory.devices)
        self.rings: dict[str, Ring] = {}
        self.status: SharedInts | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None  # the child's last word, if it had one
        self._layout: Connection | None = None  # the source's devices, when they change
        self._layouts = LayoutTimeline(inventory.devices)
        self._exit_reason: str | None = None
        fastest = min(g.interval_s for g in self.groups)
        threshold = late_threshold_s if late_threshold_s is not None else min(2e-4, fastest / 5)
        need = check_ring_memory(self.groups, gpus, window_s, max_ring_bytes)
        orphans = sweep_orphans()
        if orphans:
            log.info("freed %d shared-memory block(s) left by a killed run", len(orphans))
        check_room(need)
        try:
            for g in self.groups:
                capacity = ring_capacity(g.interval_s, window_s)
                self.rings[g.name] = Ring.create(capacity, gpus, len(g.fields))
            self.status = SharedInts.create(_status_slots(len(self.groups), gpus))
        except OSError as exc:  # taken by someone else since the check
            self.close()
            raise ConfigError(
                str(shm_dir()),
                f"cannot make {format_bytes(need)} ({need} bytes) of sample rings: {exc.strerror}",
                ROOM_FIX,
            ) from None
        except BaseException:
            self.close()
            raise
        self.plan = SamplerPlan(
            spec,
            self.groups,
            tuple(self.rings[g.name].name for g in self.groups),
            self.status.name,
            gpus,
            threshold,
            spin_s,
            realtime_priority,
            logging.getLogger().getEffectiveLevel(),
            any(isinstance(h.formatter, logs.JsonFormatter) for h in logging.getLogger().handlers),
        )

    @property
    def shared_bytes(self) -> int:
        return sum(r.nbytes for r in self.rings.values())

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the process and wait until it ticks (or fails)."""
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        layout_reader, layout_writer = ctx.Pipe(duplex=False)
        self._conn = reader
        self._layout = layout_reader
        self._exit_reason = None
        process = ctx.Process(
            target=_child_main,
            args=(self.plan, os.getpid(), writer, layout_writer),
            name="hfsampler-sampler",
        )
        process.daemon = True
        try:
            spawning.start(process)
        finally:
            writer.close()  # the child holds its own copy: EOF here once it is gone
            layout_writer.close()
        self._process = process  # only a started one: stop() joins it
        deadline = time.monotonic() + timeout_s
        status = self._array()
        while status[STATE] == STARTING:
            if not self._process.is_alive():
                reason = self.exit_reason()
                self.stop()
                raise SourceError(f"the sampler process did not start: {reason}")
            if time.monotonic() > deadline:
                self.stop()
                raise SourceError(f"the sampler process did not start within {timeout_s:g}s")
            time.sleep(0.01)
        if status[STATE] == FAILED:
            self._process.join(timeout_s)  # it returns right after saying why
            reason = self.exit_reason()
            self.stop()
            raise SourceError(f"the sampler process could not open the source: {reason}")

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def exit_reason(self) -> str | None:
        """Why the process ended, in one line: its error, or the signal or status it ended with.

        None while it runs, and before it started.
        """
        p = self._process
        if self._exit_reason is not None or p is None or p.exitcode is None:
            return self._exit_reason
        message = ""
        if self._conn is not None:
            with contextlib.suppress(EOFError, OSError):
                if self._conn.poll():
                    message = str(self._conn.recv())
        code = p.exitcode
        if message:
            reason = message
        elif code < 0:
            reason = f"killed by {_signal_name(-code)}{_SIGNAL_HINTS.get(-code, '')}"
        elif code > 0:
            reason = f"exited with status {code}"
        else:
            reason = "exited without an error"
        self._exit_reason = " ".join(reason.split())  # one line, whatever the message held
        return self._exit_reason

    def counters(self, group_index: int) -> GroupCounters:
        s = self._array()
        base = GLOBAL_SLOTS + PER_GROUP * group_index
        return GroupCounters(int(s[base]), int(s[base + 1]), int(s[base + 2]))

    def layout(self, t0_ns: int, t1_ns: int) -> tuple[tuple[DeviceInfo, ...], BoolMask]:
        """The rows' devices for the window ``[t0_ns, t1_ns)`` and the rows whose device
        changed inside it (a MIG slot that held one instance and then another, or none).

        A changed row's window mixes two instances' samples: the caller leaves it out rather
        than label one's samples with the other's labels. Never blocks.
        """
        conn = self._layout
        if conn is not None:
            with contextlib.suppress(EOFError, OSError):
                while conn.poll():
                    since_ns, devices = conn.recv()
                    self._layouts.add(int(since_ns), devices)
        return self._layouts.window(t0_ns, t1_ns)

    def gpu_up(self) -> npt.NDArray[np.bool_]:
        s = self._array()
        start = GLOBAL_SLOTS + PER_GROUP * len(self.groups)
        up: npt.NDArray[np.bool_] = s[start : start + len(self.inventory.devices)] == 1
        return up

    @property
    def realtime_priority(self) -> int:
        """The SCHED_FIFO priority the sampler got (0: the normal scheduler)."""
        return int(self._array()[RT_PRIORITY])

    @property
    def spin_s(self) -> float:
        return int(self._array()[SPIN_NS]) / 1e9

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the process to stop, wait, then make sure it is gone."""
        if self._process is not None:
            running = self._process.is_alive()  # an end before this was said by whoever saw it
            if self.status is not None:
                self._array()[STOP] = 1
            self._process.join(timeout_s)
            killed = self._process.is_alive()
            if killed:
                self._process.kill()
                self._process.join(timeout_s)
            reason = self.exit_reason()  # kept for a caller that asks after stopping
            if killed:
                log.warning("the sampler process did not stop within %g s: killed", timeout_s)
            elif running and self._process.exitcode:
                log.warning("the sampler process stopped with an error: %s", reason)
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._layout is not None:
            self._layout.close()
            self._layout = None

    def close(self) -> None:
        """Stop the process and free every shared-memory block; safe to call twice. The blocks
        are freed even when the wait for the process is interrupted (Ctrl-C): it has been told to
        stop, and its own mappings outlive their names."""
        try:
            self.stop()
        finally:
            for ring in self.rings.values():
                ring.close()
            self.rings.clear()
            if self.status is not None:
                self.status.close()
                self.status = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _array(self) -> npt.NDArray[np.int64]:
        if self.status is None:
            raise RuntimeError("the sampler is closed")
        array: npt.NDArray[np.int64] = self.status.array
        return array


# -- the child process ---------------------------------------------------------------------------


def _child_main(
    plan: SamplerPlan, parent_pid: int, conn: Connection, layout: Connection | None = None
) -> None:
    # The parent owns Ctrl-C and SIGTERM and stops us through the status block, after the last
    # window is out: a signal sent to the whole process group (a terminal, a batch scheduler,
    # systemd's control-group kill) must not end sampling before the parent has finished.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload is the parent's; a hangup too
    # A parent killed with SIGKILL cannot tell us to stop: have the kernel end us with it (we
    # were started from a thread that lasts as long as it: ``sampling.spawning``).
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        return
    logs.setup(logging.getLevelName(plan.log_level), "json" if plan.log_json else "text")
    try:
        _run_child(plan, parent_pid, conn, layout)
    except BaseException as exc:
        # Whatever ends us early, the parent says why in its own log.
        _tell(conn, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        conn.close()
        if layout is not None:
            layout.close()


def _tell(conn: Connection, reason: object) -> None:
    with contextlib.suppress(OSError):
        conn.send(reason)


def _run_child(
    plan: SamplerPlan, parent_pid: int, conn: Connection, layout: Connection | None = None
) -> None:
    status = SharedInts.attach(plan.status_name)
    try:
        rings = [Ring.attach(name) for name in plan.ring_names]
    except BaseException:
        status.close()
        raise
    s = status.array
    s[PID] = os.getpid()
    source = open_source(replace(plan.source, reopened=True))  # discovery logged what it found
    try:
        all_fields = [f for g in plan.groups for f in g.fields]
        source.open(all_fields)
    except Exception as exc:
        _tell(conn, f"cannot open the {plan.source.kind} source: {exc}")  # the parent logs it
        s[STATE] = FAILED
        _detach(rings, status)
        return
    try:
        publish = None if layout is None else (lambda t, d: _tell(layout, (t, d)))
        run_lanes(plan, source, rings, s, parent_pid, publish)
        s[STATE] = STOPPED
    except StuckRead as exc:
        # The read still writes into a ring and holds the driver: closing either under it would
        # crash the process (a segfault, or NVML shut down mid-call). The parent unlinks the
        # shared memory; leaving now frees our mappings.
        _tell(conn, str(exc))
        s[STATE] = FAILED
        os._exit(EXIT_STUCK_READ)
    except Exception as exc:
        log.debug("the sampler loop failed", exc_info=True)  # the parent says why, in one line
        _tell(conn, f"the sampler loop failed: {type(exc).__name__}: {exc}")
        s[ERROR] = 1
        s[STATE] = FAILED
    finally:
        with contextlib.suppress(Exception):
            source.close()
        _detach(rings, status)


def _detach(rings: list[Ring], status: SharedInts) -> None:
    for r in rings:
        r.close()
    status.close()

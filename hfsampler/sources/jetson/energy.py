"""The jetson source's energy counter: the GPU rail's power integrated, in mJ since it opened.

A Jetson before Thor has no energy counter: the INA3221 gives a rail's power (or its voltage and
current) once a conversion cycle, and the counter is the integral of those readings, trapezoids
between consecutive distinct ones. For that to be the energy every conversion must be read:
whatever group asks for the counter, the source polls the rail on every read of any group (the
rail's files are re-read only once half a cycle has passed), and where no group reads that often
(only slow groups: the counter alone in the 100 ms group) a helper thread of the sampler process
reads the rail at its cycle. From 10 readings a second a 30 ms spike is missed whole or, caught,
counted for 100 ms (with the counter alone selected, the AGX Orin fixture's read 27 % high).

No energy is credited where the rail could not be read: a failed reading ends the integration,
and the next good one starts it again; two readings further apart than ``MAX_GAP_NS`` (a stalled
process) are not joined either. The time left out is counted and logged (after the first time,
at debug level).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hfsampler.sources.jetson.files import NAN, File, Value

log = logging.getLogger("hfsampler.sources.jetson.source")

MAX_GAP_NS = 500_000_000  # readings further apart are an outage, not a trapezoid
MIN_STEP_NS = 2_000_000  # the helper thread's step where the rail declares no cycle
SPARSE_READS = 3  # reads in a row this far apart start the helper thread


class Energy:
    """The GPU rail's power (``power``) integrated over its distinct readings."""

    def __init__(
        self,
        power: Value,
        lock: threading.Lock,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """``lock`` is the source's: held around each ``update`` (never across a file read) by
        the reads that poll the rail and by the helper thread."""
        self.power = power
        self.files: tuple[File, ...] = power.files
        self.step_ns = 0  # the helper thread's: half the rail's cycle, once it is known
        self.total_mj = 0.0
        self.last_w = NAN  # the last reading's power; NaN after a failed one
        self.last_ns = 0  # its time
        self.uncounted_ns = 0  # time left out: outages and gaps
        self.outages = 0
        self._lock = lock
        self._clock_ns = clock_ns
        self._seen_ns = 0  # monotonic time of the previous read (helper thread or not)
        self._sparse = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self) -> None:
        """After a poll of the rail's files: integrate its new reading, if it has one."""
        value, ts = self.power.evaluate()
        if value != value:  # no reading: the next good one starts afresh
            self.last_w = NAN
            return
        if ts == self.last_ns:
            return
        gap = ts - self.last_ns
        if self.last_ns and gap > 0:  # (a clock stepped back restarts the integral, no credit)
            if self.last_w == self.last_w and gap <= MAX_GAP_NS:
                self.total_mj += (self.last_w + value) * 0.5 * gap * 1e-6  # W x ns -> mJ
            else:
                self._left_out(gap)
        self.last_w, self.last_ns = value, ts

    def _left_out(self, gap_ns: int) -> None:
        self.uncounted_ns += gap_ns
        self.outages += 1
        say = log.info if self.outages == 1 else log.debug
        say("jetson: GPU rail energy: %.3g s without a reading left uncounted (%.3g s in all)",
            gap_ns / 1e9, self.uncounted_ns / 1e9)  # fmt: skip

    # -- the helper thread -----------------------------------------------------------------------

    @property
    def helped(self) -> bool:
        """Whether the helper thread reads the rail."""
        return self._thread is not None

    def watch(self) -> None:
        """Called on every read of the source: start the helper thread once reads come further
        apart than two of its steps, ``SPARSE_READS`` times in a row (monotonic time, so a test's
        made-up clock does not start it)."""
        if self._thread is not None:
            return
        if not self.step_ns:  # the files' periods are set at the end of open
            skip = min((f.skip_ns for f in self.files if f.skip_ns), default=0)
            self.step_ns = max(skip, MIN_STEP_NS)
        now = time.monotonic_ns()
        gap, self._seen_ns = now - self._seen_ns, now
        self._sparse = self._sparse + 1 if gap > 2 * self.step_ns else 0
        if self._sparse >= SPARSE_READS:
            self._thread = threading.Thread(target=self._run, name="jetson-energy", daemon=True)
            self._thread.start()
            log.debug("jetson: no group reads the GPU rail every %.1f ms: a thread reads it for "
                      "the energy counter", 2 * self.step_ns / 1e6)  # fmt: skip

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.step_ns / 1e9):
                now = self._clock_ns()
                for f in self.files:
                    f.poll(now)  # each under its file's lock
                with self._lock:
                    self.update()
        except Exception:  # never silent, never the sampler's loop
            log.exception("jetson: the energy counter's thread failed; energy from reads only")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

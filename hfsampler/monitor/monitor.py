"""The ``Monitor``: what any window of a job's own code cost, measured from inside the job.

It starts the sampler process `run` uses (its own, in the background: ``sampling.pipeline``'s
``Pipeline``, built by ``sampling.plan.build_run`` from a ``Config`` as `run` builds it), sampling
only what a window needs (power, the energy counter, throttle reasons, memory used) every
millisecond into the shared-memory rings, and a reducer process beside it (``monitor.reducer``)
that maps the same rings. ``begin_window`` only takes the time; ``end_window`` takes the time
again and hands the span to the reducer (one write to a pipe): no window boundary to wait for,
and nothing heavy in the job's process. The ``Measurement`` it returns waits for the reducer's
answer on its first read (``monitor.spans`` reads the rows, ``monitor.measurement`` reduces
them). Where there is no reducer to ask (a forked child, a test's virtual clock) the job's
process reduces the span itself, at once, the same way. Under ``hfsampler record`` each window
is also sent as a phase (``markers.edge``), with the same edges, so the report shows it.

Windows are keyed by any hashable; they nest and overlap, from any thread or coroutine (a lock
guards the open windows only). The rings hold ``history_s``; a window reaching back into their
oldest quarter is reduced at once in the job's process (the reducer might come to it too late);
one longer than the rings hold is answered from its running statistics (``monitor.running``,
kept by a pass every quarter of the history on a thread of the Monitor's), with a
``LongWindowWarning`` saying so, and is refused with a ``WindowTooLongError`` where even those
are missing: never from part of its span.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import warnings
import weakref
from collections.abc import Hashable, Iterator, Mapping, Sequence
from multiprocessing import util as mp_util
from types import TracebackType

from hfsampler import markers
from hfsampler.config.settings import Config
from hfsampler.errors import (
    ConfigError,
    DriverNotFoundError,
    HfsamplerError,
    NoPermissionError,
    SourceError,
)
from hfsampler.fields import CLOCK_EVENTS, ENERGY, FB_USED, POWER_AVERAGE, POWER_INSTANT
from hfsampler.monitor.gpus import CUDA_VISIBLE, choose
from hfsampler.monitor.measurement import Answer, Measurement, Span
from hfsampler.monitor.reducer import Pending, Reducer, ReducerGone, Reply
from hfsampler.monitor.running import Missed, RunningStats
from hfsampler.monitor.spans import Parts, SpanReader, bounds
from hfsampler.sampling.pipeline import RECORD, WALL, Clock, Pipeline
from hfsampler.sampling.plan import build_run
from hfsampler.sampling.ring import ROOM_FIX
from hfsampler.sampling.stepping import VirtualClock

SOURCES = ("auto", "nvml", "jetson", "sim")
# What a window needs, and nothing else: the fewer fields, the cheaper each tick.
FIELDS = (*POWER_INSTANT.names, *POWER_AVERAGE.names, *CLOCK_EVENTS.names, *FB_USED.names,
          *ENERGY.names)  # fmt: skip
DEFAULT_HISTORY_S = 60.0
# A window whose rows reach back further than this share of the rings is reduced at once, in the
# job's process: the reducer might come to it only after the rings had moved past its start.
_ASK_WITHIN = 0.75
# No row for this many intervals before a window's end: is the sampler still there? (A
# sampler kept from running a while is; asking costs a few microseconds more, no more.)
_QUIET_INTERVALS = 10
_NO_DRIVER_FIX = (
    "install the NVIDIA driver (in a container: run it with --gpus all, or the NVIDIA device "
    "plugin); to try the Monitor without a GPU, Monitor(source='sim')"
)
_PERMISSION_FIX = (
    "run as a user who may open /dev/nvidiactl and /dev/nvidia* (often the video group), or in "
    "a container given the GPUs"
)


class WindowTooLongError(HfsamplerError, ValueError):
    """A window began before the oldest sample the rings still hold, and has no running
    statistics to answer from."""


class LongWindowWarning(UserWarning):
    """A window longer than the rings hold, answered from the running statistics."""


class Monitor:
    """Energy, power, throttling and memory of any window of the job's code, per GPU.

    ::

        with Monitor() as mon:                  # the GPUs this process uses
            for step, batch in enumerate(loader):
                mon.begin_window("step")
                train_step(batch)
                m = mon.end_window("step")
                log(step, m.time, m.total_energy, m.gpu_peak_power[0])

    ``gpu_indices``: the GPUs as the job numbers them (``cuda:N``); by default ``LOCAL_RANK``'s
    where it is set, else every GPU ``CUDA_VISIBLE_DEVICES`` leaves visible. ``source``: auto
    (NVML, else a Jetson's sysfs; no GPU is an error), nvml, jetson or sim (simulated GPUs).
    ``config``: the rest as `run` reads it (the intervals, the sim's GPUs and seed, the ring
    cap), e.g. ``hfsampler.config.loader.load_file``'s. ``history_s``: how long a window may be.
    No GPU, no permission to the driver, or no room in ``/dev/shm`` raise here, naming the cause
    and the fix.
    """

    def __init__(
        self,
        gpu_indices: Sequence[int] | None = None,
        *,
        source: str = "auto",
        config: Config | None = None,
        history_s: float = DEFAULT_HISTORY_S,
        clock: Clock = WALL,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``clock`` and ``env`` are for tests: a ``VirtualClock`` samples in this process as the
        clock moves; ``env`` stands for ``os.environ``."""
        if source not in SOURCES:
            raise ConfigError("source", f"unknown source {source!r}", "use " + ", ".join(SOURCES))
        if not 1.0 <= history_s <= 4 * 3600:
            raise ConfigError("history_s", f"{history_s:g} s", "give 1 s to 4 h")
        env = os.environ if env is None else env
        base = config if config is not None else Config()
        kind = _source_kind(source, base)
        run_config = dataclasses.replace(
            base, source=kind, fields=FIELDS, window_s=history_s / 4, auto_intervals=False,
            listen=None, remote_write=(),
        )  # fmt: skip
        try:
            plan = build_run(run_config)
        except ConfigError as exc:
            raise _in_monitor_terms(exc, history_s, 0) from None
        if kind == "sim":  # CUDA's variables name this machine's GPUs, not simulated ones
            env = {k: v for k, v in env.items() if k != CUDA_VISIBLE}
        chosen = choose(plan.inventory.devices, gpu_indices, env)
        uuids = {i: plan.inventory.devices[r].uuid for i, r in chosen.items()}
        plan = plan.only(sorted(chosen.values()))
        rows = {d.uuid: r for r, d in enumerate(plan.inventory.devices) if d.is_gpu}
        self.gpus: dict[int, int] = {i: rows[u] for i, u in uuids.items()}  # cuda index -> row
        self._rows = list(self.gpus.values())
        self._indices = list(self.gpus)
        self._plan = plan
        self._parts = Parts.of(plan)
        self._clock = clock
        self._open: dict[Hashable, int] = {}
        self._lock = threading.Lock()
        # the threads reading the rings now (end_window, measure): close() waits for them
        self._readers: list[int] = []
        self._read_done = threading.Condition(self._lock)
        self._closing = False
        self._markers = markers.enabled()
        self.history_s = history_s
        self._stop = threading.Event()
        self._passes: list[threading.Thread] = []
        self._pid = os.getpid()  # a forked child's copy must not stop the parent's sampler
        try:
            self._pipeline: Pipeline | None = Pipeline(plan, RECORD, clock=clock)
        except ConfigError as exc:
            raise _in_monitor_terms(exc, history_s, len(self._rows)) from None
        # What stops it, once: close(), the Monitor collected once nothing refers to it (a
        # notebook cell run again), or the process's exit. multiprocessing's exit hook, not
        # atexit: a multiprocessing child (a DataLoader worker) runs only that one, and runs it
        # before it waits for its own children, the sampler among them, which would never end
        # otherwise. It is ignored in a forked child, whose copy is not its to stop.
        self._reducer: Reducer | None = None
        reducers: list[Reducer] = []  # what _shut stops: the Monitor's reducer, once started
        self._shut = mp_util.Finalize(
            self, _shut, args=(self._stop, self._passes, self._pipeline, reducers),
            exitpriority=100,
        )  # fmt: skip
        rings = self._pipeline.sampler.rings
        try:
            # the reducer starts while the sampler does; a test's clock samples in this process,
            # and reduces here too
            if not isinstance(clock, VirtualClock):
                self._reducer = Reducer(self._parts, self._rows, rings)
                reducers.append(self._reducer)
            self._pipeline.start()
            if self._reducer is not None:
                self._reducer.wait_ready()
        except ReducerGone as exc:
            self.close()
            raise SourceError(f"{exc}; the machine may be out of processes or memory") from None
        except ConfigError as exc:  # no room left for the reducer's answers
            self.close()
            raise _in_monitor_terms(exc, history_s, len(self._rows)) from None
        except BaseException:
            self.close()
            raise
        self._reader = SpanReader(self._parts, self._rows, rings)
        interval_ns = self._parts.intervals_ns[self._parts.group]
        self._quiet_ns = _QUIET_INTERVALS * interval_ns
        self._ask_ns = int(_ASK_WITHIN * self._reader.ring.capacity * interval_ns)
        self._running = RunningStats(self._reduce_with_histogram, clock.now_ns(), clock.now_ns)
        self._pass_s = history_s / 4
        if isinstance(clock, VirtualClock):  # a test's clock: the passes run as it moves
            clock.at(clock.now_ns() + int(self._pass_s * 1e9), self._virtual_pass)
        else:
            passes = threading.Thread(
                target=_pass_loop,
                args=(weakref.ref(self), self._stop, self._pass_s),
                name="hfsampler-monitor",
                daemon=True,
            )
            self._passes.append(passes)
            passes.start()

    @property
    def source(self) -> str:
        return self._plan.spec.kind

    # -- windows ---------------------------------------------------------------------------------

    def begin_window(self, key: Hashable) -> None:
        """Start the window ``key`` now (a ``ValueError`` if it is open already)."""
        t_ns = self._clock.now_ns()
        if self._pipeline is None:
            raise RuntimeError("the Monitor is closed")
        with self._lock:
            if key in self._open:
                raise ValueError(f"window {key!r} is open already: end it, or use another key")
            self._open[key] = t_ns
        if self._markers:
            markers.edge("begin", _name(key), t_ns)

    def end_window(self, key: Hashable) -> Measurement:
        """End the window ``key`` now and measure it (a ``KeyError`` if it was never begun)."""
        t_ns = self._clock.now_ns()
        with self._lock:
            t0_ns = self._open.pop(key, None)
            if t0_ns is not None:
                self._begin_read()
        if t0_ns is None:
            raise KeyError(f"window {key!r} was never begun (or has ended already)")
        try:
            if self._markers:
                markers.edge("end", _name(key), t_ns)
            try:
                return self._measure(t0_ns, t_ns, ended_now=True)
            except WindowTooLongError:
                running = self._running.claim(key, t0_ns, t_ns)
                if isinstance(running, Missed):
                    raise self._too_long(t0_ns, t_ns, running) from None
            return self._from_running(key, t0_ns, t_ns, *running)
        finally:
            self._end_read()

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[Window]:
        """``with mon.window("eval") as w: ...``, then ``w.measurement``; a window of its own
        even where another coroutine or thread opened one of the same name."""
        w = Window(name)
        self.begin_window(w)
        try:
            yield w
        finally:
            w.measurement = self.end_window(w)

    def measure(self, t0_ns: int, t1_ns: int) -> Measurement:
        """Any span ``[t0_ns, t1_ns)`` of wall-clock ns the rings still hold (a
        ``WindowTooLongError`` here where they do not; a ``ValueError`` for one that ends in
        the future, whose last samples would be taken to hold until then, or before it
        begins)."""
        if t1_ns < t0_ns:
            raise ValueError(f"the span ends before it begins ({t1_ns} < {t0_ns} ns)")
        now_ns = self._clock.now_ns()
        if t1_ns > now_ns:
            raise ValueError(
                f"the span ends {(t1_ns - now_ns) / 1e9:.3f} s in the future: the rings hold only "
                "what was sampled; measure it once it has passed (or use begin_window and "
                "end_window)"
            )
        with self._lock:
            self._begin_read()
        try:
            if self._pipeline is not None and bounds(self._reader.ring, t0_ns, t1_ns) is None:
                raise self._too_long(t0_ns, t1_ns)
            return self._measure(t0_ns, t1_ns)
        finally:
            self._end_read()

    def _begin_read(self) -> None:
        """With the lock held: this thread reads the rings until ``_end_read``."""
        if self._closing:
            raise RuntimeError("the Monitor is closed")
        self._readers.append(threading.get_ident())

    def _end_read(self) -> None:
        with self._lock:
            self._readers.remove(threading.get_ident())
            if self._closing:  # set under this lock before close() waits: only it waits
                self._read_done.notify_all()

    def _measure(self, t0_ns: int, t1_ns: int, ended_now: bool = False) -> Measurement:
        """``ended_now``: ``t1_ns`` is now, so every row in the ring is the window's. Asked of
        the reducer process, whose answer the Measurement waits for on its first read, where
        the window is well inside the rings; reduced here, at once, where there is no reducer
        (a forked child, a test's clock) or the window reaches back near the oldest row."""
        if self._pipeline is None:
            raise RuntimeError("the Monitor is closed")
        ring = self._reader.ring
        head = ring.write_seq
        if not head or t1_ns - ring.read_ns(head - 1) > self._quiet_ns:
            self._check_sampling()  # no row lately: the sampler may be gone
        stop = head if ended_now else None
        time_s = (t1_ns - t0_ns) / 1e9
        reducer = self._reducer
        if reducer is not None and reducer.gone and os.getpid() == self._pid:
            reducer.say_gone()
        # a window within the newest three quarters of the rings (which hold a row per interval,
        # or fewer): the reducer comes to it in time
        if (reducer is not None and t1_ns - t0_ns < self._ask_ns and not reducer.gone
                and os.getpid() == self._pid):  # fmt: skip
            pending = reducer.ask(t0_ns, t1_ns, stop)
            if pending is not None:  # None: the reducer is far behind; reduced here instead
                answering = _Answering(reducer, pending, self._reader, self._ask_ns)
                return Measurement.later(answering, time_s, self._indices)
        answer = self._reader.answer(t0_ns, t1_ns, stop)
        if answer is None:
            raise self._too_long(t0_ns, t1_ns)
        return Measurement.of(answer, time_s, self._indices)

    # -- windows longer than the rings hold --------------------------------------------------

    def _reduce_with_histogram(self, t0_ns: int, t1_ns: int) -> Span | None:
        pipeline = self._pipeline  # once: close() may clear it meanwhile (it joins this thread)
        if pipeline is None:
            return None
        rows = bounds(self._reader.ring, t0_ns, t1_ns)
        if rows is None:
            return None
        return self._reader.span(rows, t0_ns, t1_ns, histogram=True)

    def _from_running(
        self, key: Hashable, t0_ns: int, t1_ns: int, running: Span, passed_ns: int
    ) -> Measurement:
        """A window the rings no longer hold the start of: its running statistics up to the last
        pass, and the rings from there."""
        rest = self._reduce_with_histogram(passed_ns, t1_ns)
        if rest is None:
            raise self._too_long(t0_ns, t1_ns, self._running.behind(t1_ns))
        warnings.warn(
            f"window {_name(key)!r} ({(t1_ns - t0_ns) / 1e9:.1f} s) is longer than the "
            f"{self.history_s:g} s of samples the Monitor keeps: answered from its running "
            "statistics (energy, peak power, throttled time and memory exact; the p99 to a watt)",
            LongWindowWarning,
            stacklevel=3,
        )
        answer = Answer.of(running.merge(rest), [None] * len(self._rows), exact=False)
        return Measurement.of(answer, (t1_ns - t0_ns) / 1e9, self._indices)

    def _pass(self) -> None:
        with self._lock:
            open_windows = dict(self._open)
        self._running.advance(self._clock.now_ns(), open_windows)

    def _virtual_pass(self) -> None:
        if self._pipeline is None:
            return
        self._pass()
        clock = self._clock
        assert isinstance(clock, VirtualClock)
        clock.at(clock.now_ns() + int(self._pass_s * 1e9), self._virtual_pass)

    def _too_long(self, t0_ns: int, t1_ns: int, missed: Missed | None = None) -> WindowTooLongError:
        """The refusal of a window the rings no longer hold the start of, naming its cause: the
        history (a span alone, ``missed`` None), or why its running statistics are missing."""
        need = (t1_ns - t0_ns) / 1e9
        long = (f"the window is {need:.1f} s long, longer than the {self.history_s:g} s of "
                "samples the Monitor keeps")  # fmt: skip
        more = f"give Monitor(history_s={max(need * 2, 60):.0f}) to measure windows this long"
        if missed is None:
            return WindowTooLongError(f"{long} (history_s); {more}")
        if os.getpid() != self._pid:
            return WindowTooLongError(
                f"{long}, and a forked process has no running statistics (the parent's thread "
                f"keeps them); measure long windows in the process that made the Monitor, or "
                f"{more}"
            )
        return WindowTooLongError(f"{long}, and {missed.cause(self._pass_s, more)}")

    # -- life ------------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self._pipeline is not None and self._pipeline.alive()

    def _check_sampling(self) -> None:
        """A ``SourceError`` once the sampler process is gone: the rings' last samples would
        otherwise be taken to hold until now. Only the process that started it can ask."""
        pipeline = self._pipeline
        if pipeline is None or os.getpid() != self._pid or pipeline.alive():
            return
        reason = pipeline.sampler.exit_reason() or "it stopped"
        raise SourceError(
            f"the Monitor's sampler process is gone ({reason}): nothing was sampled since; "
            "close this Monitor and make a new one"
        )

    def close(self) -> None:
        """Stop the sampler process and free its shared memory; safe to call twice. In a forked
        child it only lets go of the parent's Monitor, which goes on. Calls of other threads
        reading the rings finish first; later ones raise ``RuntimeError``."""
        with self._lock:
            self._closing = True
            me = threading.get_ident()  # a signal handler's close() in a reading thread
            self._read_done.wait_for(lambda: all(r == me for r in self._readers))
        self._pipeline = None
        if os.getpid() == self._pid:
            self._shut()

    def __enter__(self) -> Monitor:
        return self

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError(
            "a Monitor cannot be sent to another process (its sampler and rings are this "
            "process's): make a Monitor in each process, or fork (a forked child may use its "
            "parent's)"
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _pass_loop(monitor: weakref.ref[Monitor], stop: threading.Event, every_s: float) -> None:
    """The running statistics' passes, holding the Monitor only during one: a Monitor nothing
    else refers to is collected, and its sampler stopped."""
    while not stop.wait(every_s):
        mon = monitor()
        if mon is None:
            return
        mon._pass()
        del mon


def _shut(
    stop: threading.Event,
    passes: list[threading.Thread],
    pipeline: Pipeline,
    reducers: list[Reducer],
) -> None:
    """Stop a Monitor's passes, its reducer (once it has answered every window asked of it) and
    its sampler, free its rings (without the Monitor, which may be gone)."""
    stop.set()
    try:
        for thread in passes:
            if thread is not threading.current_thread():
                thread.join()
    finally:  # this runs once: an interrupted join must not keep the sampler
        try:
            for reducer in reducers:
                reducer.stop()  # it answers what was asked, from its own mapping of the rings
            pipeline.close()
        finally:
            for reducer in reducers:
                reducer.close()


class Window:
    """A window opened by ``Monitor.window``: its name, and its ``measurement`` once ended."""

    __slots__ = ("measurement", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.measurement: Measurement | None = None

    def __repr__(self) -> str:
        return f"Window({self.name!r})"


def _name(key: Hashable) -> str:
    return key.name if isinstance(key, Window) else str(key)


class _Answering:
    """A window asked of the reducer: its answer, waited for (a callable a ``Measurement`` calls
    on its first read). It holds the reducer and the rings' reader, not the Monitor, which may
    be collected meanwhile."""

    __slots__ = ("_keep_ns", "_pending", "_reader", "_reducer")

    def __init__(
        self, reducer: Reducer, pending: Pending, reader: SpanReader, keep_ns: int
    ) -> None:
        """``keep_ns``: how long after its start a window's rows are surely still in the rings
        (the Monitor asks the reducer only windows that short)."""
        self._reducer, self._pending, self._reader = reducer, pending, reader
        self._keep_ns = keep_ns

    def __call__(self) -> Answer:
        # wait for the reducer no longer than the rings keep the window's rows: past that, a
        # stopped reducer would cost the window its answer (history_s under its patience)
        patience_s = (self._pending.t0_ns + self._keep_ns - time.time_ns()) / 1e9
        reply = self._reducer.wait(self._pending, self._here, max(patience_s, 0.0))
        if reply is not None:
            return reply
        p = self._pending
        raise WindowTooLongError(
            f"the window's {(p.t1_ns - p.t0_ns) / 1e9:.1f} s were no longer all in the rings "
            "when the Monitor's reducer process came to them (it was kept from running), nor "
            "when the window was read; give the Monitor a longer history_s"
        )

    def _here(self, pending: Pending) -> Reply:
        """The window reduced in this process: the reducer could not (its error is raised
        here again), or is gone."""
        try:
            return self._reader.answer(pending.t0_ns, pending.t1_ns, pending.stop)
        except (AttributeError, ValueError, BufferError):  # the rings are let go: closed
            raise RuntimeError(
                "the Monitor was closed before its reducer process answered this window"
            ) from None


def _in_monitor_terms(exc: ConfigError, history_s: float, gpus: int) -> ConfigError:
    """`run`'s refusal, whose fix names its flags (``--window``, ``--source``), as the Monitor's
    arguments: its rings hold ``history_s``, its source is ``source=``."""
    if exc.key == "max_ring_bytes":
        need = exc.problem.partition(" needs ")[2]
        return ConfigError(
            "history_s",
            f"{history_s:g} s on {gpus} GPU(s) needs {need}",
            "give a shorter history_s, fewer gpu_indices, or a config= with a larger "
            "max_ring_bytes",
        )
    if exc.fix == ROOM_FIX:
        return ConfigError(exc.key, exc.problem, ROOM_FIX.partition("; or ")[0]
                           + "; or give the Monitor a shorter history_s")  # fmt: skip
    if exc.key == "source":
        return ConfigError(exc.key, exc.problem, exc.fix.replace("--source ", "source="))
    return exc


def _source_kind(source: str, config: Config) -> str:
    """The source to open: ``auto`` and ``nvml`` insist on a usable driver (no silent sim)."""
    if source in ("sim", "jetson"):
        return source
    from hfsampler.sources.jetson.sysfs import is_tegra
    from hfsampler.sources.nvml.source import probe_driver

    reason = probe_driver()
    if reason is None:
        return "nvml"
    if source == "auto" and is_tegra(config.jetson_sysfs_root or "/"):
        return "jetson"
    if "permission" in reason:
        raise NoPermissionError(f"the Monitor cannot read the GPUs: {reason} ({_PERMISSION_FIX})")
    raise DriverNotFoundError(f"no GPU for the Monitor to measure: {reason} ({_NO_DRIVER_FIX})")

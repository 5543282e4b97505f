"""`hfsampler record`: sample the GPUs for exactly one command's life and keep it all in a file.

It builds its run as `run` does (``sampling.plan.build_run``: the same source, fields and groups
from the same config and flags) and takes its windows from the same ``Pipeline`` (the sampler in
its own process, its rings' readers, the window clock), with `record`'s policy: every window is
read, however late. Only the ending differs: each window's distinct raw samples and its
statistics go to a ``RecordingWriter`` instead of Remote-Write. The
command runs as a child in the same process group (so it keeps the terminal); signals sent to the
recorder are passed on to it, and the recorder exits with the child's exit code (128 + N when a
signal N ended it).

Markers: the child finds a socket in ``HFSAMPLER_MARKER_SOCKET`` (``hfsampler.markers`` sends
to it); with ``--mark-pattern`` its stdout and stderr go through pipes (``OutputTap``), copied
to ours as they come, and matching lines become markers too. Both are read on threads of their
own; the window loop takes what they found without waiting and stores it once per window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import numpy as np

import hfsampler
from hfsampler.config.settings import Config
from hfsampler.errors import ConfigError
from hfsampler.fields import POWER, locate
from hfsampler.markers import ENV as MARKER_ENV
from hfsampler.markers import PARENT_WIRE_VERSION
from hfsampler.markers import WIRE_ENV as MARKER_WIRE_ENV
from hfsampler.profiling.job_markers import MarkerSocket, OutputTap, parent_pid
from hfsampler.profiling.record_consumers import ConsumerLooks
from hfsampler.profiling.recording_format import Marker, RecordingWriteError, consumer_to_json
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.sampling.pipeline import RECORD, RECORD_GRACE_S, WALL, Clock, Pipeline, Window
from hfsampler.sampling.plan import RunPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.window import MAX, MEAN, WindowStats
from hfsampler.sources.base import DeviceInfo, ProcessReader
from hfsampler.sources.registry import open_processes

log = logging.getLogger(__name__)

EXIT_USAGE = 2
# The job exited 0 but the recording stopped early (a full disk, a failing file system, the
# sampler gone): sysexits' EX_IOERR. A job's own failure is passed on as it is.
EXIT_INCOMPLETE = 74
EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 126, 127  # as a shell says of a command it cannot run
# the GPUs' processes, their memory and SM utilisation: once a second (a PROC snapshot, when it
# says something new), and at every window's end (so that each window holds a look for its
# consumers' split; a snapshot only if one is due)
PROCESS_POLL_S = 1.0
PROCESS_KEEP_S = 10.0  # an unchanged snapshot is written again after this long
# the sampler's rows up to the child's exit (or a window's end) are committed by then
END_GRACE_S = RECORD_GRACE_S
# Signals passed on to the child. SIGINT only when stdin is not a terminal: a terminal's Ctrl-C
# already reaches the child, which shares our process group, and a second copy would interrupt
# its clean-up.
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def job_context(env: Mapping[str, str]) -> dict[str, str]:
    """Job identifiers from the environment, as label names: Slurm, Kubernetes."""
    out: dict[str, str] = {}
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NAME"):
        if env.get(var):
            out[var.lower()] = env[var]
    if env.get("KUBERNETES_SERVICE_HOST"):
        pod = env.get("POD_NAME") or env.get("HOSTNAME")
        if pod:
            out["pod"] = pod
        namespace = env.get("POD_NAMESPACE")
        ns_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        if not namespace and ns_file.exists():
            namespace = ns_file.read_text().strip()
        if namespace:
            out["namespace"] = namespace
    return out


def visible_gpus(selection: str | None, env: Mapping[str, str]) -> list[str] | None:
    """The GPUs to record: ``--gpus``, else ``CUDA_VISIBLE_DEVICES``, else None (all)."""
    text = selection if selection is not None else env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or items[0] == "-1":
        if selection is not None:
            raise ConfigError("--gpus", f"{text!r} selects no GPU", "e.g. --gpus 0,2")
        log.warning("CUDA_VISIBLE_DEVICES=%r names no GPU: recording all GPUs", text)
        return None
    return items


def choose(devices: Sequence[DeviceInfo], wanted: Sequence[str] | None) -> list[int]:
    """Positions in ``devices`` of the wanted GPUs: indices, or UUIDs (a unique prefix will do).

    A MIG UUID (``MIG-...``, as CUDA_VISIBLE_DEVICES names an instance) gives the instance's
    slot and its GPU (whose power, clocks and temperature the instance shares); a whole GPU
    gives its MIG slots too.
    """
    if wanted is None:
        return list(range(len(devices)))
    out: list[int] = []
    gpus = [p for p, d in enumerate(devices) if d.is_gpu]
    for item in wanted:
        if item.startswith("MIG-"):
            hits = [p for p, d in enumerate(devices) if d.mig and d.mig.uuid.startswith(item)]
        elif item.isdigit():
            hits = [p for p in gpus if devices[p].index == int(item)]
        else:
            hits = [p for p in gpus if devices[p].uuid.startswith(item)]
        if len(hits) != 1:
            have = ", ".join(str(devices[p].index) for p in gpus)
            instances = [d.mig.uuid for d in devices if d.mig is not None]
            if instances:
                have += "; MIG instances " + ", ".join(instances)
            raise ConfigError("--gpus", f"no single GPU {item!r}", f"this node has GPUs {have}")
        d = devices[hits[0]]
        if d.is_gpu:
            hits += [p for p, s in enumerate(devices) if not s.is_gpu and s.index == d.index]
        else:
            hits = [p for p in gpus if devices[p].index == d.index] + hits
        out.extend(p for p in hits if p not in out)
    return out


def store_window(
    writer: RecordingWriter, group: int, rows: RingRows, stats: WindowStats, keep: Sequence[int]
) -> None:
    """Write one group's window: its distinct raw samples and its statistics (kept GPUs only)."""
    writer.add_rows(group, rows, keep)
    writer.add_window(group, stats, keep, ticks=len(rows))


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it, from /proc (empty where there is no /proc)."""
    parents: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (ppid := parent_pid(int(entry.name))) is not None:
                parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = {pid}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@dataclass(frozen=True, slots=True)
class RecordOptions:
    """What one `hfsampler record` does, validated from the flags."""

    output: Path
    command: tuple[str, ...]
    duration_s: float | None
    config: Config
    gpus: tuple[str, ...] | None
    status: bool
    mark_patterns: tuple[re.Pattern[str], ...] = ()


class Recorder:
    """Runs the sampler, the child and the window loop, and writes the recording."""

    def __init__(self, opts: RecordOptions, plan: RunPlan, keep: Sequence[int],
                 out: TextIO | None, clock: Clock = WALL) -> None:  # fmt: skip
        """``clock``: a test's ``VirtualClock`` runs the pipeline in this process."""
        self.opts = replace(opts, config=plan.config)
        self.plan = plan
        self.clock = clock
        self.spec = plan.spec
        self.inventory = plan.inventory
        self.keep = list(keep)
        self.plans = list(plan.groups)
        self.out = out
        self.child: subprocess.Popen[bytes] | None = None
        self._stop = False
        self.inbox: MarkerSocket | None = None
        self.tap: OutputTap | None = None
        self._markers: list[Marker] = []
        self.markers_not_stored = 0
        self.incomplete: str | None = None  # why the recording stopped before the job did
        self._last_processes: dict[int, list[dict[str, Any]]] = {}  # as last written
        self._side: ProcessReader | None = None
        self._looks: ConsumerLooks | None = None  # each window's consumers, with a process reader
        self._processes_written_ns = 0
        self._next_poll_s = 0.0  # the next look at the processes, on the monotonic clock
        self._power = locate(POWER, [p.fields for p in self.plans])
        self.power_max = np.full(len(self.keep), np.nan)
        self.power_now = np.full(len(self.keep), np.nan)

    def header(self, start_ns: int) -> dict[str, Any]:
        devices = [self.inventory.devices[p] for p in self.keep]
        return {
            "hfsampler_version": hfsampler.__version__,
            "command": list(self.opts.command),
            "command_line": shlex.join(self.opts.command),
            "start_ns": start_ns,
            "host": socket.gethostname(),
            "source": self.spec.kind,
            "window_s": self.opts.config.window_s,
            "labels": dict(self.opts.config.external_labels),
            "job": job_context(os.environ),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "driver_version": devices[0].driver_version if devices else "",
            "pid": os.getpid(),
        }

    def run(self) -> int:
        """Record around the job and return its exit status (``EXIT_INCOMPLETE`` for a job that
        succeeded under a recording that stopped early). Every way out closes the sampler, the
        process reader, the marker socket (and its thread) and the file, each whatever the
        others did; once the job has started it runs to its end whatever the recording's fate."""
        with contextlib.ExitStack() as stack:
            pipeline = Pipeline(self.plan, RECORD, clock=self.clock)
            stack.callback(_quietly, pipeline.close, "the sampler")
            side = self._side = self._process_reader()
            if side is not None:
                stack.callback(_quietly, side.close, "the process reader")
                rows = {self.inventory.devices[p].index: i for i, p in enumerate(self.keep)
                        if self.inventory.devices[p].is_gpu}  # fmt: skip
                self._looks = ConsumerLooks(rows, self.opts.config.procfs)
            stack.callback(self._close_inbox)
            stack.callback(self._kill_child)  # a way out that did not wait for the job
            pipeline.start()
            start_ns = pipeline.begin()  # rows from before the child started are not the job's
            devices = [self.inventory.devices[p] for p in self.keep]
            writer = RecordingWriter(self.opts.output, self.header(start_ns), devices, self.plans)
            stack.callback(_quietly, writer.close, "the recording")
            self._install_signals()
            if self.opts.command and (refused := self._start_child()) is not None:
                writer.close({"end_ns": self.clock.now_ns(), "exit_code": refused, "samples": 0})
                return refused
            end: dict[str, Any] = {}
            try:
                code, end_ns = self._loop(pipeline, writer, side, start_ns)
                self._finish_markers(writer, end_ns)
            except Exception as exc:  # the recording's end, never the job's
                end["end_ns"] = self._recording_stopped(exc, start_ns)
                _quietly(pipeline.close, "the sampler")  # nothing more to sample
                code, end_ns = self._wait_for_job()
                end["job_end_ns"] = end_ns
            end = {"end_ns": end_ns, "exit_code": code, "samples": writer.samples_written, **end}
            if self.inbox is not None:
                end["markers_dropped_by_job"] = self.inbox.dropped_by_job
                end["marker_datagrams_rejected"] = self.inbox.rejected
            if self.markers_not_stored:
                end["markers_not_stored"] = self.markers_not_stored
            if self.incomplete is not None:
                end["incomplete"] = self.incomplete
            with contextlib.suppress(RecordingWriteError):
                writer.close(end)
            if writer.failed is not None and self.incomplete is None:
                self.incomplete = str(writer.failed)  # the end chunk or the sync failed
            self._status(writer, start_ns, end_ns, final=True)
            if self.incomplete is not None and code == 0:
                log.error("the job succeeded but the recording is incomplete: exit status %d",
                          EXIT_INCOMPLETE)  # fmt: skip
                return EXIT_INCOMPLETE
            return code
        raise AssertionError("unreachable")  # mypy: the with block always returns or raises

    def _recording_stopped(self, exc: Exception, start_ns: int) -> int:
        """Say in one line why the recording stopped, and when (returned)."""
        now = self.clock.now_ns()
        self.incomplete = str(exc)
        if self.out is not None and self.out.isatty():
            self.out.write("\n")  # below the status line, not over it
        where = f"after {(now - start_ns) / 1e9:.1f} s"
        job = "; the job runs on" if self.child is not None and self.child.poll() is None else ""
        if isinstance(exc, RecordingWriteError):
            log.error("the recording stopped %s: %s%s", where, exc, job)
        else:  # a defect of ours: its traceback helps whoever fixes it
            log.error("the recording stopped %s: %r%s", where, exc, job, exc_info=exc)
        return now

    def _wait_for_job(self) -> tuple[int, int]:
        """After the recording stopped: the job runs to its end (signals still passed on), its
        markers read and let go, so its sends never block and nothing grows; then its output's
        last lines. Returns its exit status and when it ended."""
        while self.child is not None and self.child.poll() is None:
            self._collect_markers()
            self.markers_not_stored += len(self._markers)
            self._markers = []
            self.clock.sleep(0.05)
        end_ns = self.clock.now_ns()
        if self.tap is not None:
            self.tap.finish(end_ns)
        code = self.child.returncode if self.child is not None else 0
        return (128 - code if code < 0 else code), end_ns

    def _close_inbox(self) -> None:
        if self.inbox is not None:
            _quietly(self.inbox.close, "the marker socket")

    def _kill_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    def _start_child(self) -> int | None:
        """Start the job; None, or the status a shell gives a command it cannot run (127: not
        found, 126: not executable), said in one line."""
        env = dict(os.environ)
        try:
            self.inbox = MarkerSocket()
            env[MARKER_ENV] = str(self.inbox.path)
            env[MARKER_WIRE_ENV] = str(PARENT_WIRE_VERSION)
        except OSError as exc:  # markers are a nice-to-have: the job runs all the same
            log.warning("no marker socket for the job (%s): hfsampler.markers calls are dropped",
                        exc)  # fmt: skip
            env.pop(MARKER_ENV, None)
            env.pop(MARKER_WIRE_ENV, None)
        piped = bool(self.opts.mark_patterns)
        if piped:  # a pipe makes Python block-buffer its output: lines, and marks, come late
            env.setdefault("PYTHONUNBUFFERED", "1")
        pipe = subprocess.PIPE if piped else None
        try:
            self.child = subprocess.Popen(list(self.opts.command), env=env, stdout=pipe,
                                          stderr=pipe)  # fmt: skip
        except OSError as exc:
            status = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_EXECUTE
            why = "command not found" if status == EXIT_NOT_FOUND else exc.strerror or str(exc)
            log.error("%s: %s", self.opts.command[0], why)
            return status
        if self.inbox is not None:
            self.inbox.watch(self.child.pid)
        if piped:
            self.tap = OutputTap(self.opts.mark_patterns, self.child.pid)
            self.tap.attach(self.child.stdout, self.child.stderr)
        return None

    def _collect_markers(self) -> None:
        if self.inbox is not None:
            self._markers += self.inbox.drain()
        if self.tap is not None:
            self._markers += self.tap.drain()

    def _store_markers(self, writer: RecordingWriter) -> None:
        """Store the markers found since the last window. A marker the file cannot take (a value
        the encoder refuses) is dropped, counted and said once: markers never end the job."""
        if not self._markers:
            return
        found, self._markers = sorted(self._markers, key=lambda m: m.t_ns), []
        try:
            writer.add_markers(found)
            return
        except RecordingWriteError:
            raise  # the file, not the markers: the recording stops
        except Exception:  # whatever it is, the recording goes on
            pass
        for marker in found:  # one by one, so one bad marker costs only itself
            try:
                writer.add_markers([marker])
            except RecordingWriteError:
                raise
            except Exception as exc:
                self.markers_not_stored += 1
                if self.markers_not_stored == 1:
                    log.warning("could not store a marker (%s): %r; later ones are counted only",
                                exc, marker)  # fmt: skip

    def _finish_markers(self, writer: RecordingWriter, end_ns: int) -> None:
        """The last markers: what waits in the socket, the output's last lines, an open phase."""
        if self.tap is not None:
            self._markers += self.tap.finish(end_ns)
        if self.inbox is not None:
            self.inbox.close()  # takes what is still queued: the job's last count of drops
        self._collect_markers()
        # lines read (or datagrams sent) after the child's exit belong to the recording's end
        self._markers = [m if m.t_ns <= end_ns else replace(m, t_ns=end_ns) for m in self._markers]
        self._store_markers(writer)
        if self.inbox is not None and self.inbox.dropped_by_job:
            log.warning("the job could not send %d markers (the socket's queue was full)",
                        self.inbox.dropped_by_job)  # fmt: skip

    def _loop(self, pipeline: Pipeline, writer: RecordingWriter, side: ProcessReader | None,
              start_ns: int) -> tuple[int, int]:  # fmt: skip
        # every window is written, however late: no catch-up as `run` does (RECORD)
        clock = self.clock
        end_at = start_ns + int(self.opts.duration_s * 1e9) if self.opts.duration_s else None
        self._next_poll_s = 0.0
        sampling = True
        while True:
            code = self.child.poll() if self.child is not None else None
            now = clock.now_ns()
            done = code is not None or self._stop or (end_at is not None and now >= end_at)
            if done:
                end_ns = min(now, end_at) if end_at is not None else now
                clock.sleep(END_GRACE_S)
                if sampling:
                    self._write(writer, pipeline.window(end_ns))
                if code is None:
                    return 0, end_ns
                return (128 - code if code < 0 else code), end_ns
            if now >= pipeline.due_ns:
                if sampling and not pipeline.alive():
                    # e.g. a group-wide SIGTERM: keep what we have, still wait for the child
                    log.error("the sampler process died (%s); the recording stops here",
                              pipeline.sampler.exit_reason())  # fmt: skip
                    self.incomplete = f"the sampler process died ({pipeline.sampler.exit_reason()})"
                    self._write(writer, pipeline.window(now))
                    sampling = False
                if sampling:
                    self._write(writer, pipeline.window())
                self._store_markers(writer)
                self._status(writer, start_ns, pipeline.t1_ns)
                pipeline.advance()
            if side is not None and clock.monotonic_s() >= self._next_poll_s:
                self._next_poll_s = clock.monotonic_s() + PROCESS_POLL_S
                self._processes(writer, side, clock.now_ns())
            self._collect_markers()
            clock.sleep(0.005)

    def _write(self, writer: RecordingWriter, window: Window) -> None:
        for g, part in enumerate(window.groups):
            store_window(writer, g, part.rows, part.stats, self.keep)
            stats = part.stats
            if self._power is not None and self._power[0] == g:
                j = self._power[1]
                now = stats[MEAN][self.keep, j]
                self.power_now = np.where(np.isnan(now), self.power_now, now)
                self.power_max = np.fmax(self.power_max, stats[MAX][self.keep, j])
        if self._side is not None and self._looks is not None:
            # a look at the window's end: every window has one, whatever the poll's phase
            due = self.clock.monotonic_s() >= self._next_poll_s
            if due:
                self._next_poll_s = self.clock.monotonic_s() + PROCESS_POLL_S
            self._processes(writer, self._side, self.clock.now_ns(), snapshot=due)
            consumers = self._looks.take(window.t0_ns, window.t1_ns)
            if consumers is not None:
                writer.add_consumers(consumers)

    def _process_reader(self) -> ProcessReader | None:
        """The compute-process list, here in the parent (once a second is no load to share)."""
        indices = [self.inventory.devices[p].index for p in self.keep]
        try:
            return open_processes(self.spec, indices)
        except Exception as exc:  # the list of processes is a nice-to-have, never a failure
            log.warning("cannot list GPU processes: %s", exc)
            return None

    def _processes(
        self, writer: RecordingWriter, reader: ProcessReader, now: int, snapshot: bool = True
    ) -> None:
        """One look at the recorded GPUs' processes at ``now``, for the window's consumers and
        (``snapshot``) the ``PROC`` snapshot; the job's own processes (the child's descendants)
        are marked ``in_job``, each with its consumer."""
        # the job has no process once the child has exited (the last window's look)
        running = self.child is not None and self.child.returncode is None
        job = descendants(self.child.pid) if running and self.child is not None else set()
        try:
            found = reader.read_processes(job, now)
        except Exception as exc:
            log.debug("listing GPU processes failed: %s", exc)
            return
        kept = {self.inventory.devices[p].index for p in self.keep}
        found = {gpu: procs for gpu, procs in found.items() if gpu in kept}
        consumers = self._looks.look(found, now) if self._looks is not None else {}
        if not snapshot:
            return
        taken = {
            gpu: [{"pid": p.pid, "used_memory_bytes": p.used_memory_bytes,
                   "sm_util_pct": p.sm_util_pct, "in_job": p.pid in job,
                   **({"consumer": consumer_to_json(consumers[p.pid])}
                      if p.pid in consumers else {})} for p in procs]
            for gpu, procs in found.items()
        }  # fmt: skip
        seen = any(taken.values())
        # a snapshot goes to the file when it says something new (the first empty one says
        # that they have gone), and every PROCESS_KEEP_S while there are processes, so a long
        # steady job does not grow the file and the report by a chunk a second
        changed = taken != self._last_processes
        due = seen and now - self._processes_written_ns >= PROCESS_KEEP_S * 1e9
        if (seen or self._last_processes) and (changed or due):
            writer.add_processes(now, taken)
            self._processes_written_ns = now
        self._last_processes = taken if seen else {}

    def _install_signals(self) -> None:
        def forward(signum: int, frame: FrameType | None) -> None:
            if self.child is not None and self.child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.child.send_signal(signum)
            elif self.child is None and signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._stop = True

        for sig in FORWARDED:
            signal.signal(sig, forward)
        interactive = sys.stdin is not None and sys.stdin.isatty()
        if self.opts.command and interactive:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child has its own Ctrl-C
        else:
            signal.signal(signal.SIGINT, forward)

    def _status(
        self, writer: RecordingWriter, start_ns: int, t_ns: int, final: bool = False
    ) -> None:
        if self.out is None:
            return
        power = " ".join(
            f"gpu{self.inventory.devices[p].index} {_w(self.power_now[i])}/{_w(self.power_max[i])}W"
            for i, p in enumerate(self.keep)
            if self.inventory.devices[p].is_gpu  # an instance's power is its GPU's
        )
        text = (
            f"record {(t_ns - start_ns) / 1e9:7.1f}s  {writer.samples_written:,} samples  "
            f"{writer.bytes_written / 1e6:.1f} MB  {power}"
        )
        tty = self.out.isatty()
        if final:
            self.out.write(("\r\x1b[K" if tty else "") + text + f"  -> {writer.path}\n")
        elif tty:
            self.out.write("\r\x1b[K" + text)
        elif int((t_ns - start_ns) / 1e9) % 10 == 0:  # a log file gets a line every ~10 s
            self.out.write(text + "\n")
        self.out.flush()


def _quietly(close: Callable[[], object], what: str) -> None:
    """One clean-up step whose failure is said and does not stop the next ones."""
    try:
        close()
    except Exception as exc:
        log.warning("closing %s: %s", what, exc)


def _w(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:.0f}"


# -- the command line ----------------------------------------------------------------------------

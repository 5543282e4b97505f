"""`run`'s consumers: who used each shared GPU, how much, and the energy each drew, per window.

The source's process lists (``ConsumerLists``: NVML's, or the sim's) are read in the service's
process, on a thread of their own a few times per window (``READS_PER_WINDOW``) and once more as
each window is taken, never in the sampler's process: the sampler's fast lane shares nothing with
them but the CPU (docs/design.md says why, with the benchmark's numbers). Each window, off the
event loop, ``window`` takes what the reads gathered, adds each GPU's energy over the window
(``GpuEnergy``) and hands them to ``ConsumerAttribution``, whose series join the window's
snapshot beside the GPU's own. ``refresh_names`` asks the container runtime (bounded by its
timeout) on an executor thread; ``end`` gives the stale markers at shutdown.

A failing read is one log line and a window without new reads, never a lost window; a consumer
list that cannot be opened at all leaves the run without consumer series, said once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence

from hfsampler import selfmetrics as sm
from hfsampler.config import consumer_keys
from hfsampler.config.settings import Config
from hfsampler.consumers.cri import CriNames
from hfsampler.consumers.procfs import ProcfsReader
from hfsampler.consumers.split import WindowUse
from hfsampler.export.consumer_attribution import ConsumerAttribution, GpuWindow
from hfsampler.export.metrics import MetricModel, gpu_labels
from hfsampler.fields import ENERGY, POWER, locate
from hfsampler.sampling.pipeline import Clock, Window
from hfsampler.sampling.plan import RunPlan
from hfsampler.sampling.stepping import VirtualClock
from hfsampler.sampling.window import LAST, MEAN, MIN
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import STALE_NAN, Series, SeriesRegistry
from hfsampler.sources.base import ConsumerLists, DeviceInfo
from hfsampler.sources.registry import open_consumer_lists

log = logging.getLogger(__name__)

READS_PER_WINDOW = 4  # list reads per window: a process that lives a fraction of one is seen
MIN_READ_INTERVAL_S = 0.05
MIG_SLICES = 7  # compute slices of a MIG-capable GPU (A100, H100, H200)
PROCFS_FAULTS = sm.CONSUMER_PROCFS_FAULTS
NAMES_WAIT_S = 5.0  # at shutdown, for an ask of the runtime in flight


def planned_series(config: Config, source_kind: str, devices: Sequence[DeviceInfo]) -> int:
    """The most consumer series a window has by the config (what Remote-Write queues are sized
    from, beside the model's): per GPU without MIG and per MIG slot, ``max_per_gpu`` consumers
    and ``other``, each with its three series (five with dcgm-exporter's virtual GPUs), and the
    row's unattributed and folded series; a MIG GPU's own row the last two only."""
    if not consumer_keys.enabled(config.consumers, source_kind):
        return 0
    per_consumer = 5 if config.consumers_dcgm_exporter_virtual_gpus else 3
    per_row = (config.consumers_max_per_gpu + 1) * per_consumer + 2
    mig = {d.index for d in devices if not d.is_gpu}
    return sum(2 if d.is_gpu and d.index in mig else per_row for d in devices)


class GpuEnergy:
    """Each GPU's energy over a window, in joules: the increase of its energy counter
    (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``, mJ) since the window before where it is sampled,
    so that consumers and unattributed add up to the counter's increase; else (the counter not
    selected, or not answering) the window's mean power times its length."""

    def __init__(self) -> None:
        self._last_mj: dict[int, float] = {}  # GPU row -> the counter where it stood

    def window(self, window: Window) -> dict[int, float]:
        stats = [g.stats for g in window.groups]
        fields = [s.fields for s in stats]
        energy, power = locate(ENERGY, fields), locate(POWER, fields)
        length_s = (window.t1_ns - window.t0_ns) / 1e9
        out: dict[int, float] = {}
        for r, d in enumerate(window.devices):
            if not d.is_gpu:
                continue
            last = math.nan
            if energy is not None:
                g, j = energy
                last = float(stats[g][LAST][r, j])
            if math.isfinite(last):
                before = self._last_mj.get(r, float(stats[g][MIN][r, j]))
                # a GPU reset starts the counter again: this window counts nothing, the next
                # from where it starts
                out[r] = (last - before) / 1e3 if last >= before else 0.0
                self._last_mj[r] = last
                continue
            self._last_mj.pop(r, None)
            mean_w = float(stats[power[0]][MEAN][r, power[1]]) if power is not None else math.nan
            out[r] = mean_w * length_s if math.isfinite(mean_w) and mean_w > 0 else 0.0
        return out


def instance_share(device: DeviceInfo) -> float:
    """A MIG instance's share of its GPU's SMs: its profile's compute slices of 7."""
    assert device.mig is not None
    head = device.mig.profile.split("g", 1)[0]
    slices = int(head) if head.isdigit() else 1
    return min(slices, MIG_SLICES) / MIG_SLICES


class ConsumerRun:
    """The consumers of one `run`; see the module's docstring."""

    def __init__(
        self,
        config: Config,
        lists: ConsumerLists,
        registry: SeriesRegistry,
        host: Mapping[str, str],
        devices: Sequence[DeviceInfo],
        metrics: SelfMetrics,
    ) -> None:
        self._lists = lists
        self._registry = registry
        self._host = dict(host)
        self._metrics = metrics
        self._lock = threading.Lock()  # the reading thread and the window's take
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._energy = GpuEnergy()
        self._devices: tuple[DeviceInfo, ...] = ()
        self._naming: asyncio.Future[None] | None = None  # the runtime's names, being asked
        self._faults_counted: dict[str, int] = {}  # procfs faults already in the self-metric
        self._ended: list[Series] = []  # a reload's old series, ended in the next window
        self.attribution = self._attribution(config)
        self.set_devices(devices)

    def _attribution(
        self, config: Config, reader: ProcfsReader | None = None, names: CriNames | None = None
    ) -> ConsumerAttribution:
        return ConsumerAttribution(
            self._registry,
            config.external_labels,
            procfs=config.procfs,
            runtime_socket=config.container_runtime_socket,
            pod_label_allowlist=config.consumers_pod_label_allowlist,
            max_per_gpu=config.consumers_max_per_gpu,
            virtual_gpus=config.consumers_dcgm_exporter_virtual_gpus,
            reader=reader,  # its cache and the faults it said carry over
            names=names,
        )

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        """The rows now: a MIG slot's new instance is read on its own handle from here on."""
        devices = tuple(devices)
        if devices == self._devices:
            return
        with self._lock:
            self._devices = devices
            self._guarded(lambda: self._lists.set_devices(devices), "find the GPUs' devices")

    def reconfigure(self, config: Config, host: Mapping[str, str]) -> None:
        """A reload changed the labels: from the next window the series are the new config's.
        A label set both have goes on as the same series, its counter from where it stood; the
        others end with stale markers in that window. The procfs reader and the runtime's names
        carry over."""
        with self._lock:
            old = self.attribution
            counters = old.series.counters()
            ended, _ = old.series.end_all(forget=False)
            self._ended += ended
            self._host = dict(host)
            names = old.names
            if names is not None and config.container_runtime_socket == names.socket_path:
                names.set_allowlist(config.consumers_pod_label_allowlist)
            elif names is not None:
                names.close()
                names = None
            self.attribution = self._attribution(config, old.procfs, names)
            self.attribution.series.take_over(counters)

    def start(self, window_s: float) -> None:
        """Read the lists on a thread of their own, ``READS_PER_WINDOW`` times per window."""
        interval_s = max(window_s / READS_PER_WINDOW, MIN_READ_INTERVAL_S)
        self._thread = threading.Thread(target=self._reading, args=(interval_s,),
                                        name="hfsampler-consumers", daemon=True)  # fmt: skip
        self._thread.start()

    def _reading(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                self._guarded(self._lists.read, "read the GPUs' process lists")

    def _guarded(self, call: Callable[[], None], what: str) -> None:
        try:
            call()
        except Exception as exc:  # a read is a nice-to-have: never a lost window, never a crash
            if not self._failing:
                self._failing = True
                log.warning("consumers: cannot %s (%s); their series wait for the next read "
                            "that works", what, exc)  # fmt: skip
            return
        if self._failing:
            self._failing = False
            log.info("consumers: the GPUs' process lists are read again")

    def refresh_names(self) -> None:
        """The container runtime's names, if due (blocks for at most its timeout)."""
        self.attribution.refresh_names()

    def ask_names(self, loop: asyncio.AbstractEventLoop) -> None:
        """``refresh_names`` on an executor thread, one ask at a time, never waited for: a slow
        runtime delays its names, never a window."""
        if self.attribution.names is None or (self._naming is not None and not self._naming.done()):
            return
        self._naming = loop.run_in_executor(None, self.refresh_names)

    async def names_asked(self) -> None:
        """Wait (bounded) for an ask in flight, so ``close`` does not close its channel under it."""
        if self._naming is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._naming), NAMES_WAIT_S)

    def window(self, window: Window) -> tuple[list[Series], list[float]]:
        """The window's consumer series (its GPUs up; a GPU down ends its consumers')."""
        with self._lock:
            self._guarded(self._lists.read, "read the GPUs' process lists")
            uses: dict[int, WindowUse] = {}
            self._guarded(lambda: uses.update(self._lists.take()), "take the process lists")
        energy = self._energy.window(window)
        up = window.gpu_up & ~window.mixed
        devices = window.devices
        gpus: list[GpuWindow] = []
        for r, d in enumerate(devices):
            if not d.is_gpu or not bool(up[r]):
                continue
            labels = gpu_labels(d, self._host)
            instances = tuple(
                (gpu_labels(s, self._host), uses.get(k, WindowUse.of(0.0)), instance_share(s))
                for k, s in enumerate(devices)
                if s.index == d.index and not s.is_gpu and s.mig is not None and bool(up[k])
            )
            if instances:
                gpus.append(GpuWindow(labels, energy.get(r, 0.0), instances=instances))
            else:
                gpus.append(GpuWindow(labels, energy.get(r, 0.0), uses.get(r)))
        with self._lock:
            out = self.attribution.gpus(gpus)
            ended, self._ended = self._ended, []
        if ended:  # a reload's: those the new config did not take on end now
            taken = {s.id for s in out[0]}
            gone = [s for s in ended if s.id not in taken]
            self._registry.forget(gone)
            out = (gone + out[0], [STALE_NAN] * len(gone) + out[1])
        for kind, n in self.attribution.procfs.faults.items():  # the reader's own count, since
            if n > self._faults_counted.get(kind, 0):  # it was made (a root refused at once too)
                self._metrics.inc(PROCFS_FAULTS, n - self._faults_counted.get(kind, 0),
                                  {"kind": kind})  # fmt: skip
                self._faults_counted[kind] = n
        return out

    def end(self) -> tuple[list[Series], list[float]]:
        """Stale markers for every consumer series: the last thing sent at shutdown, a reload's
        old series too where no window came after it to end them."""
        with self._lock:
            series, values = self.attribution.end()
            ended, self._ended = self._ended, []
        self._registry.forget(ended)
        return ended + series, [STALE_NAN] * len(ended) + values

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            self._guarded(self._lists.close, "close the process lists")
        self.attribution.close()


def open_consumers(
    plan: RunPlan, model: MetricModel, metrics: SelfMetrics, clock: Clock
) -> ConsumerRun | None:
    """`run`'s consumers where the config and the source say (``consumers``: auto reads them on
    NVML); None otherwise, or when the lists cannot be opened (said once: the GPUs' series go on).
    On a test's virtual clock nothing reads between windows: one read as each is taken."""
    config, spec = plan.config, plan.spec
    if not consumer_keys.enabled(config.consumers, spec.kind):
        return None
    try:
        lists = open_consumer_lists(spec, plan.inventory.devices, config.procfs, clock.now_ns)
    except Exception as exc:  # consumers are a nice-to-have: the GPUs' series go on
        log.warning("consumers: cannot open the GPUs' process lists (%s); no consumer series "
                    "this run", exc)  # fmt: skip
        return None
    if lists is None:
        log.warning("consumers: the %s source lists no GPU processes; no consumer series",
                    spec.kind)  # fmt: skip
        return None
    run = ConsumerRun(config, lists, model.registry, model.host, plan.inventory.devices, metrics)
    run.refresh_names()  # the first names before the first window (bounded by the timeout)
    if not isinstance(clock, VirtualClock):
        run.start(config.window_s)
    return run

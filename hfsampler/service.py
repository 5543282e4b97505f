"""The service: wires source, sampler, windows, metrics, /metrics and Remote-Write under uvloop.

It owns the window clock (windows end on wall-clock multiples of the window length), turns each
window into one snapshot, serves the latest on /metrics, hands it to every remote writer, and on
a signal or at the end of ``--duration`` sends stale markers, flushes, and frees shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import numpy.typing as npt
from aiohttp import web

from hfsampler import exposition
from hfsampler import selfmetrics as sm
from hfsampler.attribution import Labeller, build_labeller
from hfsampler.config import Config, parse_listen
from hfsampler.fields import Field
from hfsampler.metrics import MetricModel
from hfsampler.remote_write import RemoteWriter
from hfsampler.remote_write.dirlock import DirLock
from hfsampler.sampler import GroupPlan, Sampler
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Snapshot
from hfsampler.sources import Inventory, SourceSpec, open_source
from hfsampler.window import WindowReader, WindowStats, reduce

log = logging.getLogger(__name__)

WINDOW_GRACE_S = 0.01  # the sampler's last row of a window is committed by then
FLUSH_DEADLINE_S = 5.0


def discover(spec: SourceSpec, wanted: Sequence[Field]) -> Inventory:
    """Open the source once here to learn the devices and fields, then release it.

    Fields that no GPU supports are left out (the source logs each once).
    """
    source = open_source(spec)
    try:
        inventory = source.open(wanted)
    finally:
        source.close()
    keep: npt.NDArray[np.bool_] = np.asarray(inventory.supported.any(axis=0))
    if not keep.all():
        kept = tuple(f for f, k in zip(inventory.fields, keep, strict=True) if k)
        return Inventory(inventory.devices, kept, inventory.supported[:, keep])
    return inventory


def plan_groups(fields: Sequence[Field], intervals_s: dict[str, float]) -> list[GroupPlan]:
    """One group per interval name that has fields, fastest first."""
    groups = [
        GroupPlan(name, interval, tuple(f for f in fields if f.group == name))
        for name, interval in intervals_s.items()
    ]
    return sorted((g for g in groups if g.fields), key=lambda g: g.interval_s)


@dataclass(slots=True)
class _Group:
    plan: GroupPlan
    index: int
    reader: WindowReader
    ticks: int = 0
    late: int = 0
    missed: int = 0


class Service:
    """One running hfsampler: built from a validated config and a discovered inventory."""

    def __init__(
        self,
        config: Config,
        spec: SourceSpec,
        inventory: Inventory,
        *,
        out: TextIO | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.config = config
        self.spec = spec
        self.inventory = inventory
        self.metrics = SelfMetrics()
        self.plans = plan_groups(inventory.fields, dict(config.intervals_s))
        self.model = MetricModel(
            inventory.devices,
            {p.name: p.fields for p in self.plans},
            self.metrics,
            config.external_labels,
            hostname=config.hostname,
            stale_after_windows=config.stale_after_windows,
            host_label=config.host_label,
            instance=config.instance,
            instance_port=config.instance_port,
        )
        self.latest: Snapshot | None = None
        self.windows = 0
        self.out = out if out is not None else (sys.stdout if sys.stdout.isatty() else None)
        self._clock_ns = clock_ns
        self._stop = asyncio.Event()
        queue_dir = Path(config.queue_dir) if config.queue_dir else None
        # One process per queue_dir, refused here (exit 2) before anything is read or sampled.
        self._queue_lock = DirLock.acquire(queue_dir) if queue_dir is not None else None
        self._writers = [RemoteWriter(ep, self.metrics, queue_dir) for ep in config.remote_write]
        self._sampler: Sampler | None = None
        self._groups: list[_Group] = []
        self._labeller: Labeller | None = build_labeller(
            inventory.devices, config.pod_resources_socket, config.hpc_job_mapping_dir
        )

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Sample, reduce and export until stopped; 0 on a clean stop, 1 if the sampler died."""
        for warning in self.config.label_warnings():
            log.warning("%s", warning)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        sampler = Sampler(
            self.spec,
            self.inventory,
            self.plans,
            self.config.window_s,
            realtime_priority=self.config.realtime_priority,
        )
        self._sampler = sampler
        runner: web.AppRunner | None = None
        try:
            await loop.run_in_executor(None, sampler.start)
            self._groups = [
                _Group(p, i, WindowReader(sampler.rings[p.name])) for i, p in enumerate(self.plans)
            ]
            log.info(
                "sampling %d GPU(s) from %s: %s; window %gs; %d KiB of rings; spin %.0f us; %s",
                len(self.inventory.devices),
                self.spec.kind,
                ", ".join(f"{p.name} {len(p.fields)} fields every {p.interval_s * 1e3:g} ms"
                          for p in self.plans),
                self.config.window_s,
                sampler.shared_bytes // 1024,
                sampler.spin_s * 1e6,
                f"SCHED_FIFO {sampler.realtime_priority}"
                if sampler.realtime_priority
                else "normal scheduling",
            )  # fmt: skip
            log.debug("shared memory: %s", " ".join(r.name for r in sampler.rings.values()))
            runner = await self._serve()
            for w in self._writers:
                await w.start()
            return await self._window_loop(sampler)
        finally:
            await self._shutdown(runner)
            sampler.close()
            if self._queue_lock is not None:
                self._queue_lock.release()

    async def _window_loop(self, sampler: Sampler) -> int:
        window_ns = int(self.config.window_s * 1e9)
        started = self._clock_ns()
        end_ns = started + int(self.config.duration_s * 1e9) if self.config.duration_s else None
        t0 = started
        t1 = started - started % window_ns + window_ns
        loop = asyncio.get_running_loop()
        while True:
            if end_ns is not None and t1 > end_ns:
                await self._sleep_until(end_ns)
                return 0
            if await self._sleep_until(t1 + int(WINDOW_GRACE_S * 1e9)):
                return 0
            if not sampler.alive():
                log.error("the sampler process died; stopping")
                return 1
            stats = await loop.run_in_executor(None, self._reduce_all, t0, t1)
            if self._labeller is not None:  # a kubelet call or file reads: off the loop
                extra = await loop.run_in_executor(None, self._labeller.labels)
                self.model.set_extra_labels(extra)
            self._export(stats, t1)
            t0, t1 = t1, t1 + window_ns
            now = self._clock_ns()
            if now > t1 + window_ns:  # the loop was stalled: skip ahead, the rows are kept
                skipped = (now - t1) // window_ns
                log.warning("window loop fell %d window(s) behind; catching up", skipped)
                t1 += skipped * window_ns

    async def _sleep_until(self, t_ns: int) -> bool:
        """Sleep until wall-clock ``t_ns``; True if stopped meanwhile."""
        delay = (t_ns - self._clock_ns()) / 1e9
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
        return self._stop.is_set()

    def _reduce_all(self, t0: int, t1: int) -> dict[str, WindowStats]:
        return {g.plan.name: reduce(g.reader.take(t1), g.plan.fields, t0, t1) for g in self._groups}

    def _export(self, stats: dict[str, WindowStats], t1: int) -> None:
        assert self._sampler is not None
        gpu_up = self._sampler.gpu_up()
        self._update_self_metrics(stats, gpu_up)
        snapshot = self.model.snapshot(stats, gpu_up, t1)
        self.latest = snapshot
        self.windows += 1
        for w in self._writers:
            w.push(snapshot)
        if self.out is not None:
            self.out.write(status_line(self.inventory, stats, t1) + "\n")
            self.out.flush()

    def _update_self_metrics(self, stats: dict[str, WindowStats], gpu_up: np.ndarray) -> None:
        assert self._sampler is not None
        m = self.metrics
        for g in self._groups:
            labels = {"group": g.plan.name}
            c = self._sampler.counters(g.index)
            m.inc(sm.TICKS, c.ticks - g.ticks, labels)
            m.inc(sm.LATE_TICKS, c.late - g.late, labels)
            m.inc(sm.MISSED_TICKS, c.missed - g.missed, labels)
            g.ticks, g.late, g.missed = c.ticks, c.late, c.missed
            w = stats[g.plan.name]
            m.set(sm.TICK_LATENESS_P99, w.lateness_p99_ns / 1e9, labels)
            m.set(sm.TICK_LATENESS_MAX, w.lateness_max_ns / 1e9, labels)
            m.inc(sm.SAMPLES, w.ticks * w.count.size, labels)
            m.inc(sm.DISTINCT_SAMPLES, int(w.count.sum()), labels)
            m.inc(sm.RING_OVERWRITTEN, g.reader.lost_rows, labels)
            g.reader.lost_rows = 0
        for d, up in zip(self.inventory.devices, gpu_up, strict=True):
            m.set(sm.GPU_UP, 1.0 if up else 0.0, {"gpu": str(d.index), "UUID": d.uuid})
        m.inc(sm.WINDOWS)

    async def _serve(self) -> web.AppRunner | None:
        if not self.config.listen:
            return None
        host, port = parse_listen(self.config.listen)
        app = web.Application()
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/healthz", self._handle_health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(f"cannot listen on {self.config.listen}: {exc.strerror}") from None
        log.info("serving /metrics and /healthz on http://%s:%d", host, port)
        return runner

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        body = exposition.render(self.latest)
        return web.Response(body=body.encode(), headers={"Content-Type": exposition.CONTENT_TYPE})

    async def _handle_health(self, request: web.Request) -> web.Response:
        ok = self._sampler is not None and self._sampler.alive()
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "sampler down\n")

    async def _shutdown(self, runner: web.AppRunner | None) -> None:
        if self._labeller is not None:
            self._labeller.close()
        if self._writers:
            final = self.model.final_snapshot(self._clock_ns())
            for w in self._writers:
                if len(final):
                    w.push(final)
            await asyncio.gather(*(w.close(FLUSH_DEADLINE_S) for w in self._writers))
        if runner is not None:
            await runner.cleanup()


def status_line(inventory: Inventory, stats: dict[str, WindowStats], t1_ns: int) -> str:
    """One compact terminal line per window: per GPU power mean/max, util, memory, temperature."""
    wanted = {
        "DCGM_FI_DEV_POWER_USAGE_INSTANT": "P",
        "DCGM_FI_DEV_GPU_UTIL": "U",
        "DCGM_FI_DEV_FB_USED": "M",
        "DCGM_FI_DEV_GPU_TEMP": "T",
    }
    cells: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for w in stats.values():
        for j, f in enumerate(w.fields):
            if f.name in wanted:
                cells[f.name] = (w.mean[:, j], w.max[:, j])
    if "DCGM_FI_DEV_POWER_USAGE_INSTANT" not in cells:
        for w in stats.values():
            for j, f in enumerate(w.fields):
                if f.name == "DCGM_FI_DEV_POWER_USAGE":
                    cells["DCGM_FI_DEV_POWER_USAGE_INSTANT"] = (w.mean[:, j], w.max[:, j])
    stamp = time.strftime("%H:%M:%S", time.localtime(t1_ns / 1e9))
    parts = [stamp]
    for i, d in enumerate(inventory.devices):
        text = [f"gpu{d.index}"]
        if (p := cells.get("DCGM_FI_DEV_POWER_USAGE_INSTANT")) is not None:
            text.append(f"P {_fmt(p[0][i])}/{_fmt(p[1][i])}W")
        if (u := cells.get("DCGM_FI_DEV_GPU_UTIL")) is not None:
            text.append(f"U {_fmt(u[0][i])}%")
        if (mem := cells.get("DCGM_FI_DEV_FB_USED")) is not None:
            text.append(f"M {_fmt(mem[0][i] / 1024, 1)}GiB")
        if (t := cells.get("DCGM_FI_DEV_GPU_TEMP")) is not None:
            text.append(f"T {_fmt(t[0][i])}C")
        parts.append(" ".join(text))
    return " | ".join(parts)


def _fmt(value: float, digits: int = 0) -> str:
    return "-" if np.isnan(value) else f"{value:.{digits}f}"

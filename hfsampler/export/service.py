"""The service: wires a window pipeline to its sinks, /metrics and Remote-Write, under uvloop.

The pipeline (``sampling.pipeline``: the sampler, its rings' readers and the window clock, with
`run`'s catch-up policy) yields each window; the service turns it into one snapshot, serves the
latest on /metrics (behind TLS and basic auth when ``web_config_file`` says so: ``export.web``),
hands it to every remote writer, and on a signal or at the end of ``--duration`` sends stale
markers, flushes, and frees shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import numpy as np
from aiohttp import web

from hfsampler import logs
from hfsampler import selfmetrics as sm
from hfsampler.config.reload import plan_reload
from hfsampler.config.settings import Config, parse_listen
from hfsampler.errors import ConfigError
from hfsampler.export import exposition
from hfsampler.export.attribution import Labeller, build_labeller
from hfsampler.export.metrics import MetricModel, build_model
from hfsampler.export.web import BAD_REQUEST_FILTER, WebGate
from hfsampler.fields import FB_USED, GPU_TEMP, GPU_UTIL, POWER, Role, locate
from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.config import PROTOBUF_V2, EndpointConfig
from hfsampler.remote_write.dirlock import DirLock
from hfsampler.remote_write.intake import RemoteWriter, orphan_spools
from hfsampler.remote_write.sizing import raised_warning
from hfsampler.sampling.pipeline import RUN, WALL, Clock, Pipeline, Window
from hfsampler.sampling.plan import RunPlan
from hfsampler.sampling.window import MAX, MEAN, WindowStats
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Snapshot
from hfsampler.sources.base import DeviceInfo, Inventory, physical

log = logging.getLogger(__name__)

FLUSH_DEADLINE_S = 5.0


class Service:
    """One running hfsampler: built from a validated config and a discovered inventory."""

    def __init__(
        self,
        plan: RunPlan,
        *,
        out: TextIO | None = None,
        clock: Clock = WALL,
        loader: Callable[[], Config] | None = None,
        flush_deadline_s: float = FLUSH_DEADLINE_S,
    ) -> None:
        """``loader`` builds the configuration again from its files and flags (SIGHUP);
        ``clock``: a test's ``VirtualClock`` runs the pipeline in this process;
        ``flush_deadline_s``: how long what is queued may still be sent at the end (a test's
        receiver may take longer than a real one)."""
        self.plan = plan
        self.config = config = plan.config
        self.spec = plan.spec
        self.inventory = inventory = plan.inventory
        self.metrics = SelfMetrics()
        self.plans = plan.groups
        self.model = self._build_model(config)
        self.page = exposition.Page()  # /metrics: the latest window, rendered once
        self.windows = 0
        self.out = out if out is not None else (sys.stdout if sys.stdout.isatty() else None)
        self._clock = clock
        self._flush_deadline_s = flush_deadline_s
        self._stop = asyncio.Event()
        self._queue_dir = Path(config.queue_dir) if config.queue_dir else None
        # One process per queue_dir, refused here (exit 2) before anything is read or sampled.
        self._queue_lock = DirLock.acquire(self._queue_dir) if self._queue_dir is not None else None
        self._writers = [self._writer(ep) for ep in config.remote_write]
        self._loader = loader
        self._reloading: asyncio.Task[None] | None = None
        self._reload_again = False
        self._held: dict[str, list[Snapshot]] = {}
        self.metrics.set(sm.CONFIG_RELOAD_OK, 1.0)
        self.pipeline: Pipeline | None = None
        self._labeller: Labeller | None = build_labeller(
            inventory.devices, config.pod_resources_socket, config.hpc_job_mapping_dir
        )

    def stop(self) -> None:
        self._stop.set()

    def _build_model(self, config: Config, previous: MetricModel | None = None) -> MetricModel:
        groups = {p.name: p.fields for p in self.plans}
        return build_model(config, self.inventory.devices, groups, self.metrics, previous)

    def _warn_orphan_spools(self) -> None:
        if self._queue_dir is None:
            return
        for name, size in orphan_spools(self._queue_dir, self.config.remote_write):
            log.warning(
                "queue_dir %s: %d bytes are spooled for an endpoint named %r that is not "
                "configured (removed, or renamed; an unnamed one is named by its URL's hash): "
                "nothing sends them; configure it again with that name, or delete %s",
                self._queue_dir,
                size,
                name,
                self._queue_dir / name,
            )

    def _writer(self, endpoint: EndpointConfig, config: Config | None = None) -> RemoteWriter:
        """``endpoint``'s writer, its queues sized for the plan's windows (``config``: the
        configuration it is in, the running one by default)."""
        # the model's families from the start: a spool replayed before the first window goes
        # out as 2.0 with its series' metadata
        writer = RemoteWriter(endpoint, self.metrics, self._queue_dir, self.model.families,
                              window_samples=self.model.planned_series())  # fmt: skip
        if writer.bound.raised_from is not None:
            names = [ep.remote_name for ep in (config or self.config).remote_write]
            i = names.index(endpoint.remote_name) if endpoint.remote_name in names else 0
            log.warning("%s", raised_warning(f"remote_write[{i}].queue_config.capacity",
                                             writer.bound))  # fmt: skip
        return writer

    def request_reload(self) -> None:
        """SIGHUP: load the configuration again and apply it; one during a reload runs after it."""
        if self._loader is None:
            log.warning("SIGHUP: this run has no configuration to reload; ignored")
            return
        if self._reloading is not None and not self._reloading.done():
            self._reload_again = True
            return
        self._reloading = asyncio.get_running_loop().create_task(self._reload_all(self._loader))

    async def _reload_all(self, loader: Callable[[], Config]) -> None:
        while True:
            self._reload_again = False
            try:
                await self._reload(loader)
            except Exception as err:  # never a traceback from a reload, and never half applied
                log.error("configuration reload failed, the running one stays: %s", err)
                self.metrics.set(sm.CONFIG_RELOAD_OK, 0.0)
            if not self._reload_again:
                return

    async def _reload(self, loader: Callable[[], Config]) -> None:
        loop = asyncio.get_running_loop()
        try:
            new = await loop.run_in_executor(None, loader)
        except (ConfigError, OSError) as err:
            log.error("configuration reload refused, the running one stays: %s", err)
            self.metrics.set(sm.CONFIG_RELOAD_OK, 0.0)
            return
        plan = plan_reload(self.config, new)
        if plan.needs_restart:
            log.warning(
                "configuration reload: %s changed, which takes a restart; running with the old "
                "values of those",
                ", ".join(plan.needs_restart),
            )
        stopping = {ep.remote_name for ep in plan.stop}
        successors = {ep.remote_name: ep for ep in plan.start}
        leaving = [w for w in self._writers if w.config.remote_name in stopping]
        self._writers = [w for w in self._writers if w.config.remote_name not in stopping]
        # windows made while a changed endpoint's writer is replaced wait for the new one
        self._held = {w.config.remote_name: [] for w in leaving}
        try:
            if plan.labels_changed:
                # An endpoint removed ends its series here. The others go on: the new model
                # keeps the series it still has, and ends the rest with stale markers in its
                # first window, at that window's time (a window being reduced now ends before
                # now: a stale marker stamped now would come after the window's own samples).
                removed = [w for w in leaving if w.config.remote_name not in successors]
                if removed:
                    ended = self.model.final_snapshot(self._clock.now_ns(), end=False)
                    for w in removed:
                        w.push(ended)
                self.model = self._build_model(plan.config, previous=self.model)
            left = await asyncio.gather(
                *(self._retire(w, successors.get(w.config.remote_name)) for w in leaving)
            )
            backlog = {w.config.remote_name: b for w, b in zip(leaving, left, strict=True)}
            started: list[RemoteWriter] = []
            try:
                for ep in plan.start:
                    w = self._writer(ep, plan.config)
                    started.append(w)
                    await w.start()
            except Exception:
                await asyncio.gather(*(w.close(0.0, drop_reason="reload") for w in started))
                # put the endpoints back as they ran: the old configuration stays in force
                started = []
                for w in leaving:
                    back = self._writer(w.config)
                    await back.start()
                    started.append(back)
                self._take_over(started, backlog)
                raise
            self._take_over(started, backlog)
        finally:
            self._held = {}
        self.config = plan.config
        logs.set_level(plan.config.log_level)
        self._warn_orphan_spools()
        self.metrics.set(sm.CONFIG_RELOAD_OK, 1.0)
        self.metrics.set(sm.CONFIG_RELOAD_TIME, time.time())
        log.info(
            "configuration reloaded: %d endpoint(s) started, %d stopped%s",
            len(started),
            len(leaving),
            "; labels changed" if plan.labels_changed else "",
        )

    async def _retire(
        self, writer: RemoteWriter, successor: EndpointConfig | None
    ) -> list[list[Block]]:
        """Stop a writer a reload replaces or removes; what a successor is to send, per shard.

        A replaced endpoint's writer hands its queue over (``RemoteWriter.hand_over``): the new
        one sends it, in order, before anything newer, so a storm of reloads neither drops nor
        repeats a sample. A removed one flushes for a while (a memory queue) or stays spooled,
        stopped as for a handover: a request cancelled on the wire would be stored by the
        receiver and sent again from the spool if the endpoint came back."""
        if self._queue_dir is not None or (
            successor is not None and successor.queue.min_shards in (1, writer.n_shards)
        ):
            return await writer.hand_over(FLUSH_DEADLINE_S)
        # a memory queue sharded otherwise cannot be split again: it goes out before the new
        # writer starts, within the flush deadline (a removed endpoint's too)
        await writer.close(FLUSH_DEADLINE_S, drop_reason="reload")
        return []

    def _take_over(
        self, writers: list[RemoteWriter], backlog: dict[str, list[list[Block]]]
    ) -> None:
        """The writers a reload started take their predecessors' queues, then the windows held
        meanwhile, and join the running ones."""
        for w in writers:
            name = w.config.remote_name
            w.take_over(backlog.get(name, []))
            for snapshot in self._held.get(name, ()):
                w.push(snapshot)
        self._writers += writers

    async def run(self) -> int:
        """Sample, reduce and export until stopped; 0 on a clean stop, 1 if the sampler died."""
        for warning in self.config.warnings():
            log.warning("%s", warning)
        self._warn_orphan_spools()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        pipeline = Pipeline(self.plan, RUN, clock=self._clock,
                            realtime_priority=self.config.realtime_priority, log=log)  # fmt: skip
        self.pipeline = pipeline
        sampler = pipeline.sampler
        runner: web.AppRunner | None = None
        try:
            await loop.run_in_executor(None, pipeline.start)
            log.info(
                "sampling %d GPU(s)%s from %s: %s; window %gs; %d KiB of rings; spin %.0f us; %s",
                len(physical(self.inventory.devices)),
                _mig_text(self.inventory.devices),
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
            if self._writers:  # "is it pushing at all?" is the first question when data is missing
                log.info("pushing to %s; outages %s", "; ".join(
                    f"{w.config.remote_name} at {w.config.display_url} (Remote-Write "
                    f"{'2.0' if w.config.protobuf_message == PROTOBUF_V2 else '1.0'}, queue "
                    f"{w.bound.describe()})"
                    for w in self._writers),
                    "spooled in " + str(self._queue_dir) if self._queue_dir else "queued in memory",
                )  # fmt: skip
            return await self._window_loop(pipeline)
        finally:
            await self._shutdown(runner)
            pipeline.close()
            if self._queue_lock is not None:
                self._queue_lock.release()

    async def _window_loop(self, pipeline: Pipeline) -> int:
        loop = asyncio.get_running_loop()
        async for window in pipeline.windows(self._stop, self.config.duration_s):
            self._apply_layout(window)
            if self._labeller is not None:  # a kubelet call or file reads: off the loop
                extra = await loop.run_in_executor(None, self._labeller.labels)
                self.model.set_extra_labels(extra)
            self._export(window)
        if pipeline.died:
            log.error("the sampler process died (%s); stopping", pipeline.sampler.exit_reason())
            return 1
        return 0

    def _apply_layout(self, window: Window) -> None:
        """The window's devices (a MIG slot's instance may have changed) to the model and the
        labeller, before the window's labels are asked for."""
        if window.devices != self.model.devices:
            self.model.set_devices(window.devices)
            if self._labeller is not None:
                self._labeller.set_devices(window.devices)

    def _export(self, window: Window) -> None:
        # a MIG slot whose instance changed in the window: its samples are two instances'
        gpu_up = window.gpu_up & ~window.mixed
        self._update_self_metrics(window, gpu_up)
        stats = window.stats
        snapshot = self.model.snapshot(stats, gpu_up, window.t1_ns)
        self.page.update(snapshot)
        self.windows += 1
        for w in self._writers:
            w.push(snapshot)
        for held in self._held.values():  # endpoints being replaced by a reload
            held.append(snapshot)
        if self.out is not None:
            self.out.write(status_line(self.inventory, stats, window.t1_ns) + "\n")
            self.out.flush()

    def _update_self_metrics(self, window: Window, gpu_up: np.ndarray) -> None:
        m = self.metrics
        for g in window.groups:
            labels = {"group": g.plan.name}
            h = g.health
            if h.resumed_after_s is not None:
                log.info("sampler group %s ticks again after %.0f s", g.plan.name,
                         h.resumed_after_s)  # fmt: skip
            if h.stall_found:
                log.warning(
                    "sampler group %s has not ticked for %.0f s (every %g s expected): a read "
                    "stuck in the driver, or the sampler process stopped; its series go stale "
                    "and /healthz answers 503 until it ticks again",
                    g.plan.name,
                    h.stalled_s,
                    g.plan.interval_s,
                )
            m.set(sm.GROUP_STALLED, 1.0 if h.stalled_s else 0.0, labels)
            m.inc(sm.TICKS, h.ticks, labels)
            m.inc(sm.LATE_TICKS, h.late, labels)
            m.inc(sm.MISSED_TICKS, h.missed, labels)
            m.set(sm.TICK_LATENESS_P99, g.ticks.lateness_p99_ns / 1e9, labels)
            m.set(sm.TICK_LATENESS_MAX, g.ticks.lateness_max_ns / 1e9, labels)
            m.inc(sm.SAMPLES, g.ticks.ticks * g.stats.count.size, labels)
            m.inc(sm.DISTINCT_SAMPLES, int(g.stats.count.sum()), labels)
            m.inc(sm.RING_OVERWRITTEN, h.lost_rows, labels)
        for d, up in zip(self.inventory.devices, gpu_up, strict=True):
            if not d.is_gpu:
                continue  # a MIG slot is down while empty: that is no lost GPU
            m.set(sm.GPU_UP, 1.0 if up else 0.0, {"gpu": str(d.index), "UUID": d.uuid})
        m.inc(sm.WINDOWS)

    async def _serve(self) -> web.AppRunner | None:
        if not self.config.listen:
            return None
        host, port = parse_listen(self.config.listen)
        # read again now: the file may have changed since the configuration was loaded
        gate = WebGate(self.config.web_config_file) if self.config.web_config_file else None
        app = web.Application(middlewares=[gate.middleware] if gate is not None else [])
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/healthz", self._handle_health)
        if gate is not None:
            app.on_response_prepare.append(gate.add_headers)
        runner = web.AppRunner(app, access_log=None)
        logging.getLogger("aiohttp.server").addFilter(BAD_REQUEST_FILTER)  # once: one instance
        await runner.setup()
        ssl_context = gate.ssl_context() if gate is not None else None
        try:
            await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(f"cannot listen on {self.config.listen}: {exc.strerror}") from None
        log.info(
            "serving /metrics and /healthz on %s://%s:%d%s",
            "https" if ssl_context is not None else "http",
            host,
            port,
            f" ({gate.config.describe()})" if gate is not None else "",
        )
        return runner

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        # one page per window, whoever asks and how often (two Prometheus servers of an HA
        # pair, a scrape interval shorter than the window): the same bytes until the next one
        headers = {"Content-Type": exposition.CONTENT_TYPE, "Vary": "Accept-Encoding"}
        if exposition.accepts_gzip(request.headers.get("Accept-Encoding", "")):
            headers["Content-Encoding"] = "gzip"
            return web.Response(body=self.page.gzipped(), headers=headers)
        return web.Response(body=self.page.body(), headers=headers)

    async def _handle_health(self, request: web.Request) -> web.Response:
        if self.pipeline is None or not self.pipeline.alive():
            return web.Response(status=503, text="sampler down\n")
        stalled = self.pipeline.stalled()
        if stalled:
            return web.Response(status=503, text=f"sampler group stalled: {', '.join(stalled)}\n")
        return web.Response(status=200, text="ok\n")

    async def _shutdown(self, runner: web.AppRunner | None) -> None:
        if self._reloading is not None and not self._reloading.done():
            # let a reload finish (bounded by its flush deadline) so no endpoint is half replaced
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reloading), FLUSH_DEADLINE_S * 2)
        if self._labeller is not None:
            self._labeller.close()
        if self._writers:
            final = self.model.final_snapshot(self._clock.now_ns())
            for w in self._writers:
                if len(final):
                    w.push(final)
            await asyncio.gather(*(w.close(self._flush_deadline_s) for w in self._writers))
        if runner is not None:
            await runner.cleanup()


def _mig_text(devices: Sequence[DeviceInfo]) -> str:
    slots = [d for d in devices if not d.is_gpu]
    if not slots:
        return ""
    held = sum(d.mig is not None for d in slots)
    return f" and {held} MIG instance(s) in {len(slots)} slot(s)"


def status_line(inventory: Inventory, stats: dict[str, WindowStats], t1_ns: int) -> str:
    """One compact terminal line per window: per GPU power mean/max, util, memory, temperature."""
    windows = list(stats.values())

    def cell(role: Role) -> tuple[np.ndarray, np.ndarray] | None:
        at = locate(role, [w.fields for w in windows])
        if at is None:
            return None
        w, j = windows[at[0]], at[1]
        return w[MEAN][:, j], w[MAX][:, j]

    power, util, mem, temp = cell(POWER), cell(GPU_UTIL), cell(FB_USED), cell(GPU_TEMP)
    stamp = time.strftime("%H:%M:%S", time.localtime(t1_ns / 1e9))
    parts = [stamp]
    for i, d in enumerate(inventory.devices):
        if not d.is_gpu:
            continue  # one line per GPU; its instances are in the series
        text = [f"gpu{d.index}"]
        if power is not None:
            text.append(f"P {_fmt(power[0][i])}/{_fmt(power[1][i])}W")
        if util is not None:
            text.append(f"U {_fmt(util[0][i])}%")
        if mem is not None:
            text.append(f"M {_fmt(mem[0][i] / 1024, 1)}GiB")
        if temp is not None:
            text.append(f"T {_fmt(temp[0][i])}C")
        parts.append(" ".join(text))
    return " | ".join(parts)


def _fmt(value: float, digits: int = 0) -> str:
    return "-" if np.isnan(value) else f"{value:.{digits}f}"

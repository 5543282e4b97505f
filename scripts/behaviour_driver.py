"""One revision's behaviour on the sim, written as files that another revision's must equal.

Run by ``scripts/compare_behaviour.py`` once per revision, with ``PYTHONPATH`` at that revision's
tree: ``python scripts/behaviour_driver.py OUT_DIR --tree TREE``. Everything is deterministic:
the sim is seeded, every timestamp is injected (``T0_NS`` onwards), nothing sleeps, and no sampler
process runs (it runs on real time); this driver plays the sampler's part instead, filling the
real rings at injected tick times, and drives every stage after it for real:

- ``<scenario>.metrics.txt``: each window read from the rings by ``WindowReader``, reduced by
  ``reduce``, turned into a snapshot by ``MetricModel`` and rendered as /metrics text.
- ``<scenario>.rw1.json``, ``<scenario>.rw2.json``: those snapshots pushed by a ``RemoteWriter``
  (1.0, 2.0) one window at a time, as the service pushes, to a capture receiver on loopback
  (``behaviour_capture``); every request decoded (headers, series, samples with a NaN's bits,
  metadata, symbols) in the order sent. ``*_batched.json``: all of them queued before the writer
  starts, so its batches merge windows.
- ``recording.hfs``: ``sim_recordings.synthesize`` (the recorder's writer and window code) at a
  fixed start, with markers; ``report.json``: ``hfsampler report --format json`` on it.
- ``replay.json``: ``hfsampler replay`` of it to the capture receiver, decoded;
  ``replay_raw.json``: ``replay --raw``, whose four shards' requests arrive in any order, so
  merged per series and sorted.

Entry points are found through ``ENTRY_POINTS``: the new module path first, then the older ones,
so that the driver runs on the flat layout before the restructuring and on every layout since.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import io
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from behaviour_capture import (
    CaptureReceiver,
    Protos,
    bodies_text,
    merged_json,
    requests_json,
)

T0_NS = 1_767_225_600_250_000_000  # 2026-01-01 00:00:00.25 UTC: the first window is partial
SEED = 7
WINDOWS = 4
MANIFEST = "MANIFEST"  # what the driver made: a name and ``required`` or ``info`` a line
RECORDING_S = 3
HOST = "node-1"
INSTANCE = "node-1:9400"
EXTERNAL_LABELS = {"cluster": "behaviour"}
# Each scenario's Config keywords, beside the sim source, the seed and the host labels
SCENARIOS: dict[str, dict[str, Any]] = {
    "sim2": {"sim_gpus": 2},
    "mig": {"sim_gpus": 1, "sim_mig": ("3g", "2g", "1g", "1g")},
}

# Where each entry point lives: (module, attribute) in order, newest layout first. One table, so
# that a move on another branch is one line here.
ENTRY_POINTS: dict[str, tuple[tuple[str, str], ...]] = {
    "Config": (("hfsampler.config.settings", "Config"), ("hfsampler.config", "Config")),
    "build_run": (("hfsampler.sampling.plan", "build_run"), ("hfsampler.plan", "build_run")),
    "open_source": (
        ("hfsampler.sources.registry", "open_source"),
        ("hfsampler.sources", "open_source"),
    ),
    "Ring": (("hfsampler.sampling.ring", "Ring"), ("hfsampler.ring", "Ring")),
    "WindowClock": (
        ("hfsampler.sampling.window", "WindowClock"),
        ("hfsampler.window", "WindowClock"),
    ),
    "WindowReader": (
        ("hfsampler.sampling.window", "WindowReader"),
        ("hfsampler.window", "WindowReader"),
    ),
    "reduce": (("hfsampler.sampling.window", "reduce"), ("hfsampler.window", "reduce")),
    "TickStats": (("hfsampler.sampling.window", "TickStats"), ("hfsampler.window", "TickStats")),
    "MetricModel": (
        ("hfsampler.export.metrics", "MetricModel"),
        ("hfsampler.metrics", "MetricModel"),
    ),
    "render": (("hfsampler.export.exposition", "render"), ("hfsampler.exposition", "render")),
    "selfmetrics": (("hfsampler.selfmetrics", ""),),
    "RemoteWriter": (
        ("hfsampler.remote_write.intake", "RemoteWriter"),
        ("hfsampler.remote_write.sender", "RemoteWriter"),
    ),
    "endpoint_from_url": (("hfsampler.remote_write.config", "endpoint_from_url"),),
    "PROTOBUF_V2": (("hfsampler.remote_write.config", "PROTOBUF_V2"),),
    "Marker": (
        ("hfsampler.profiling.recording_format", "Marker"),
        ("hfsampler.profiling.recording", "Marker"),
        ("hfsampler.recording", "Marker"),
    ),
    "cli_main": (("hfsampler.cli.main", "main"), ("hfsampler.cli", "main")),
    "synthesize": (("sim_recordings", "synthesize"),),  # tests/support, or tests before
    "remote_pb2": (("hfsampler.remote_write.prompb.remote_pb2", ""),),
    "writev2_pb2": (("hfsampler.remote_write.prompb.writev2_pb2", ""),),
}


RESOLVED: dict[str, str] = {}  # entry point: where this tree had it (ENTRY_POINTS.txt, no artifact)


def resolve(name: str) -> Any:
    """The entry point ``name``: the first of its places that exists in this tree and has it.

    Only a module that is not there moves on to the next place; any other import error (a cycle,
    a missing dependency) is the tree's own and is raised."""
    tried = []
    for module_name, attr in ENTRY_POINTS[name]:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not f"{module_name}.".startswith(f"{exc.name}."):
                raise
            tried.append(f"{module_name}: {exc}")
            continue
        if not attr or hasattr(module, attr):
            RESOLVED[name] = f"{module_name}:{attr}" if attr else module_name
            return getattr(module, attr) if attr else module
        tried.append(f"{module_name}: no {attr}")
    raise ImportError(f"{name} not found: " + "; ".join(tried))


# -- the windows, as the service makes them --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    t1_ns: int
    snapshot: Any


def _lateness_ns(tick: int) -> int:
    """A tick's injected lateness: varied, so that the lateness statistics have something."""
    return (tick * 7919) % 50_000


def run_windows(scenario: dict[str, Any], count: int) -> tuple[list[Window], Any, Any]:
    """The scenario's windows through the real rings, reduction and metric model; then the
    model's final snapshot (stale markers for every live series) and its families."""
    import numpy as np

    sm = resolve("selfmetrics")
    config = resolve("Config")(
        source="sim",
        seed=SEED,
        hostname=HOST,
        instance=INSTANCE,
        external_labels=EXTERNAL_LABELS,
        **scenario,
    )
    plan = resolve("build_run")(config)
    inventory = plan.inventory
    source = resolve("open_source")(plan.spec)
    source.open(list(plan.fields))  # as the sampler process opens it: every group's fields
    metrics = sm.SelfMetrics()
    metrics.set(sm.CONFIG_RELOAD_OK, 1.0)
    model = resolve("MetricModel")(
        inventory.devices,
        {g.name: g.fields for g in plan.groups},
        metrics,
        config.external_labels,
        hostname=config.hostname,
        stale_after_windows=config.stale_after_windows,
        host_label=config.host_label,
        instance=config.instance,
        copy_device_fields=config.mig_copy_device_fields,
    )
    Ring, reduce, TickStats = resolve("Ring"), resolve("reduce"), resolve("TickStats")
    gpus = len(inventory.devices)
    now = [T0_NS]
    clock = resolve("WindowClock")(config.window_s, clock_ns=lambda: now[0])
    rings, readers, rows_of, next_tick = [], [], [], []
    for g in plan.groups:
        interval_ns = round(g.interval_s * 1e9)
        per_window = round(config.window_s * 1e9) // interval_ns
        ring = Ring.create(4 * per_window + 16, gpus, len(g.fields))
        rings.append(ring)
        readers.append(resolve("WindowReader")(ring))
        wanted = set(g.fields)
        cols = [k for k, f in enumerate(inventory.fields) if f in wanted]
        rows_of.append([int(r) for r in np.flatnonzero(inventory.supported[:, cols].any(axis=1))])
        next_tick.append(T0_NS - T0_NS % interval_ns + interval_ns)  # the sampler's deadlines
    windows: list[Window] = []
    ticks_total = [0] * len(plan.groups)
    try:
        for _ in range(count):
            t0, t1 = clock.t0_ns, clock.t1_ns
            now[0] = clock.due_ns
            stats, tick_stats = {}, {}
            for k, g in enumerate(plan.groups):
                interval_ns = round(g.interval_s * 1e9)
                while next_tick[k] <= now[0]:  # the sampler ran up to the window's due time
                    deadline = next_tick[k]
                    values, driver = rings[k].slot()
                    lateness = _lateness_ns(ticks_total[k])
                    source.read(g.fields, values, driver, deadline + lateness)
                    rings[k].commit(deadline + lateness, lateness)
                    ticks_total[k] += 1
                    next_tick[k] += interval_ns
                rows = readers[k].take(t1)
                stats[g.name] = reduce(rows, g.fields, t0, t1, only=rows_of[k])
                tick_stats[g.name] = TickStats.of(rows)
            gpu_up = np.array(source.gpu_up, dtype=np.bool_)
            _self_metrics(sm, metrics, plan.groups, stats, tick_stats, inventory.devices, gpu_up)
            windows.append(Window(t1, model.snapshot(stats, gpu_up, t1)))
            clock.advance()
        final = model.final_snapshot(clock.t0_ns + 1_000_000)
    finally:
        source.close()
        for ring in rings:
            ring.close()
    return windows, final, model.families


def _self_metrics(
    sm: Any,
    metrics: Any,
    groups: Sequence[Any],
    stats: dict[str, Any],
    ticks: dict[str, Any],
    devices: Sequence[Any],
    gpu_up: Any,
) -> None:
    """The service's per-window self-metrics that do not depend on a sampler process."""
    for g in groups:
        labels = {"group": g.name}
        w, t = stats[g.name], ticks[g.name]
        metrics.inc(sm.TICKS, t.ticks, labels)
        metrics.set(sm.TICK_LATENESS_P99, t.lateness_p99_ns / 1e9, labels)
        metrics.set(sm.TICK_LATENESS_MAX, t.lateness_max_ns / 1e9, labels)
        metrics.inc(sm.SAMPLES, t.ticks * w.count.size, labels)
        metrics.inc(sm.DISTINCT_SAMPLES, int(w.count.sum()), labels)
    for d, up in zip(devices, gpu_up, strict=True):
        if d.mig_slot is None:
            metrics.set(sm.GPU_UP, 1.0 if up else 0.0, {"gpu": str(d.index), "UUID": d.uuid})
    metrics.inc(sm.WINDOWS)


def metrics_text(windows: Sequence[Window]) -> str:
    render = resolve("render")
    return "".join(f"# window ending {w.t1_ns}\n{render(w.snapshot)}" for w in windows)


# -- the stages after the windows ----------------------------------------------------------------


async def _delivered(rx: CaptureReceiver, path: str, samples: int, timeout_s: float = 60.0) -> None:
    """Wait until the receiver holds ``samples`` samples on ``path`` (no clock is read: this only
    orders the pushes as the service's windows are, one delivered before the next is queued)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while rx.samples.get(path, 0) < samples:
        if rx.errors:
            raise RuntimeError(f"the capture receiver failed: {rx.errors[0]}")
        if loop.time() > end:
            raise TimeoutError(f"{path}: {rx.samples.get(path, 0)} of {samples} samples arrived")
        await asyncio.sleep(0.001)


async def push(
    rx: CaptureReceiver, path: str, snapshots: Sequence[Any], families: Any, v2: bool, batched: bool
) -> None:
    """``snapshots`` through a real ``RemoteWriter``: one at a time as the service pushes each
    window, or (``batched``) all queued before the writer starts."""
    sm = resolve("selfmetrics")
    endpoint = resolve("endpoint_from_url")(rx.url(path))
    if v2:
        endpoint = replace(endpoint, protobuf_message=resolve("PROTOBUF_V2"))
    # its own self-metrics: its send durations are real time, and must not reach the snapshots
    writer = resolve("RemoteWriter")(endpoint, sm.SelfMetrics(), None, families)
    if batched:
        for snapshot in snapshots:
            writer.push(snapshot)
        await writer.start()
    else:
        await writer.start()
        expected = 0
        for snapshot in snapshots:
            writer.push(snapshot)
            expected += len(snapshot)
            await _delivered(rx, path, expected)
    await writer.close(30.0)
    await _delivered(rx, path, sum(len(s) for s in snapshots))


def markers() -> list[Any]:
    """A job's markers over the recording: a phase, steps inside another, an instant."""
    Marker = resolve("Marker")
    start = _recording_start_ns()

    def at(ms: int) -> int:
        return start + ms * 1_000_000

    return [
        Marker(at(100), "begin", "load"),
        Marker(at(600), "end", "load"),
        Marker(at(600), "begin", "train", source="output"),
        *(Marker(at(600 + 500 * k), "step", "step", step=k) for k in range(4)),
        Marker(at(2200), "mark", "checkpoint"),
        Marker(at(2700), "end", "train"),
    ]


def _recording_start_ns() -> int:
    return T0_NS - T0_NS % 1_000_000_000  # synthesize's windows are whole seconds


def cli(argv: Sequence[str]) -> str:
    """``hfsampler ARGV`` in this process: its stdout; a failure is this driver's failure."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = resolve("cli_main")(list(argv))
    if code != 0:
        raise SystemExit(f"hfsampler {' '.join(argv)} exited {code}: {out.getvalue()}")
    return out.getvalue()


@dataclass(frozen=True, slots=True)
class Artifact:
    name: str
    required: bool  # False: shown, but a difference is no failure (an encoding's own bytes)


def drive(out: Path, quick: bool = False) -> list[Artifact]:
    """Every artifact into ``out``; ``quick``: one scenario, fewer windows (the test's run)."""
    sm = resolve("selfmetrics")
    # a counter family's start in 2.0 requests is the process's: injected, a second before T0
    sm.PROCESS_START_MS = T0_NS // 1_000_000 - 1000
    made: list[Artifact] = []

    def write(name: str, text: str, required: bool = True) -> None:
        (out / name).write_text(text, encoding="utf-8")
        made.append(Artifact(name, required))

    scenarios = list(SCENARIOS.items())[:1] if quick else list(SCENARIOS.items())
    protos = Protos(resolve("remote_pb2"), resolve("writev2_pb2"))
    with CaptureReceiver(protos) as rx:
        for scenario, keywords in scenarios:
            windows, final, families = run_windows(keywords, 2 if quick else WINDOWS)
            write(f"{scenario}.metrics.txt", metrics_text(windows))
            snapshots = [w.snapshot for w in windows] + [final]
            for v2 in (False, True):
                for batched in (False, True):
                    name = f"{scenario}.rw{2 if v2 else 1}{'_batched' if batched else ''}"
                    asyncio.run(push(rx, name, snapshots, families, v2, batched))
                    write(f"{name}.json", requests_json(rx.requests[name], protos))
                    write(f"{name}.bodies.txt", bodies_text(rx.requests[name]), required=False)
        recording = out / "recording.hfs"
        resolve("synthesize")(recording, 2, 2 if quick else RECORDING_S, True, seed=SEED,
                              start_ns=_recording_start_ns(), markers=markers())  # fmt: skip
        made.append(Artifact(recording.name, True))
        # relative paths: the replay's summary names the file, and nothing may name ``out``
        cli(["report", recording.name, "--format", "json", "-o", "report.json"])
        made.append(Artifact("report.json", True))
        said = cli(["replay", recording.name, "--remote-write", rx.url("replay")])
        write("replay.json", requests_json(rx.requests["replay"], protos))
        write("replay.bodies.txt", bodies_text(rx.requests["replay"]), required=False)
        write("replay.stdout.txt", said)
        said = cli(["replay", recording.name, "--raw", "--remote-write", rx.url("raw")])
        write("replay_raw.json", merged_json(rx.requests["raw"], protos))
        write("replay_raw.bodies.txt", bodies_text(rx.requests["raw"], False), required=False)
        write("replay_raw.stdout.txt", said)
    return made


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory for the artifacts (made if missing)")
    parser.add_argument("--tree", type=Path, help="the tree under test (default: this one)")
    parser.add_argument("--quick", action="store_true", help="one scenario, fewer windows")
    args = parser.parse_args(argv)
    tree = (args.tree or Path(__file__).resolve().parent.parent).resolve()
    # sim_recordings: in tests/support since the restructuring, in tests before
    support = next(d for d in (tree / "tests/support", tree / "tests")
                   if (d / "sim_recordings.py").exists())  # fmt: skip
    sys.path.insert(0, str(support))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    shm = out / "shm"  # the rings' blocks: this run's own folder, not /dev/shm
    shm.mkdir(exist_ok=True)
    os.environ["HFSAMPLER_SHM_DIR"] = str(shm)
    # An editable install's finder (the venv's, of another checkout) answers for every hfsampler
    # module that PYTHONPATH's tree lacks: an old tree would import the new layout's modules.
    sys.meta_path[:] = [
        f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
    ]
    os.chdir(out)
    made = drive(out, args.quick)
    loaded = {name: getattr(module, "__file__", None) for name, module in sys.modules.items()}
    strays = [f"{name} ({file})" for name, file in sorted(loaded.items())
              if name.partition(".")[0] == "hfsampler" and file is not None
              and tree not in Path(file).resolve().parents]  # fmt: skip
    if strays:
        raise SystemExit(f"modules loaded from outside {tree}: {', '.join(strays)}")
    found = "".join(f"{name} {where}\n" for name, where in RESOLVED.items())
    (out / "ENTRY_POINTS.txt").write_text(found, encoding="utf-8")
    shm.rmdir()
    manifest = "".join(f"{a.name}\t{'required' if a.required else 'info'}\n" for a in made)
    (out / MANIFEST).write_text(manifest, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

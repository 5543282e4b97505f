"""Backlog drain after an outage: spool N minutes of 8-GPU windows, then start Prometheus.

Phase 1 pushes ``--minutes`` of 1 s windows (the series a default ``sim`` run exports for
``--gpus`` GPUs, with dcgm-exporter's labels) into a ``RemoteWriter`` with a queue dir while
nothing listens: everything goes to the spool. Phase 2 starts a real Prometheus on that port and
times the drain. Prints a table and writes ``benchmarks/out/drain.json``:

- spool: disk bytes, disk bytes per hour of windows, peak RSS of this process while spooling
- drain: seconds, samples/s, and the multiple of real time (outage length / drain time)

    python benchmarks/drain.py [--gpus 8] [--minutes 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import receivers as rx  # the integration tests' receiver harness

from hfsampler import selfmetrics as sm
from hfsampler.config.settings import Config
from hfsampler.export.metrics import gpu_labels, host_labels
from hfsampler.fields import GPU_TEMP
from hfsampler.remote_write.config import parse_remote_write
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.sampling.window import exported_names
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Series, SeriesRegistry, Snapshot
from hfsampler.sources.base import DeviceInfo

OUT = Path(__file__).resolve().parent / "out"


def series_for(gpus: int) -> list[Series]:
    """The series of a default run: every exported name per GPU, dcgm-exporter's labels."""
    reg = SeriesRegistry()
    fields = [f for f in Config().selected_fields() if f.nvml_readable]  # an NVML node's
    names = [n for f in fields for n in exported_names(f)]
    host = host_labels(socket.gethostname(), instance="")
    out = []
    for g in range(gpus):
        uuid = f"GPU-{g:08x}-5e1f-4c2b-9d7a-{g:012x}"
        device = DeviceInfo(g, uuid, "NVIDIA H100 80GB HBM3", f"00000000:{g + 0x18:02X}:00.0",
                            "550.54.15", g)  # fmt: skip
        labels = {**gpu_labels(device, host), "cluster": "bench"}
        out.extend(reg.series(n, labels) for n in names)
    return out


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def run(gpus: int, minutes: float, root: Path) -> dict[str, float]:
    port = rx.free_port()
    (ep,) = parse_remote_write(
        [
            {
                "url": f"http://127.0.0.1:{port}/api/v1/write",
                "name": "bench",
                # Prometheus's defaults, but a short max_backoff so the drain starts promptly.
                "queue_config": {"max_backoff": "500ms"},
            }
        ]
    )
    series = series_for(gpus)
    windows = int(minutes * 60)
    metrics = SelfMetrics()
    writer = RemoteWriter(ep, metrics, root / "queue")
    await writer.start()
    rss_before = rss_mib()
    t0_ms = int(time.time() * 1000) - windows * 1000
    started = time.perf_counter()
    for w in range(windows):
        values = [float((w * 7 + i) % 1000) for i in range(len(series))]
        writer.push(Snapshot(t0_ms + 1000 * w, series, values))
        if w % 10 == 0:
            await asyncio.sleep(0)  # let the spool's writer task run, as the window loop does
    spool_s = time.perf_counter() - started
    await asyncio.sleep(0.5)  # the spool threads write the last records
    disk = writer.disk_bytes()
    rss_spool = rss_mib()
    pushed = windows * len(series)
    prom = rx.start_prometheus(root / "prometheus", port=port)
    try:
        ready = time.perf_counter()
        first = None
        while metrics.total(sm.RW_SAMPLES) < pushed:
            if first is None and metrics.total(sm.RW_SAMPLES) > 0:
                first = time.perf_counter()
            await asyncio.sleep(0.01)
            if time.perf_counter() - ready > 600:
                raise SystemExit("drain did not finish in 10 minutes")
        done = time.perf_counter()
        await writer.close(5)
        stored = prom.query(f'count_over_time({GPU_TEMP.name}{{gpu="0"}}[{windows + 60}s])')
    finally:
        prom.stop()
    drain_s = done - ready
    return {
        "gpus": gpus,
        "series": len(series),
        "outage_s": windows,
        "samples": pushed,
        "spool_push_s": round(spool_s, 2),
        "disk_bytes": disk,
        "disk_bytes_per_hour": round(disk * 3600 / windows),
        "bytes_per_sample_on_disk": round(disk / pushed, 2),
        "rss_mib_before_spooling": round(rss_before, 1),
        "peak_rss_mib_while_spooling": round(rss_spool, 1),
        "drain_s": round(drain_s, 2),
        "drain_s_from_first_success": round(done - (first or ready), 2),
        "drain_samples_per_s": round(pushed / drain_s),
        "drain_x_real_time": round(windows / drain_s, 1),
        "prometheus_windows_stored_gpu0": float(stored[0]["value"][1]) if stored else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hfsampler-drain-") as tmp:
        result = asyncio.run(run(args.gpus, args.minutes, Path(tmp)))
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    OUT.mkdir(exist_ok=True)
    (OUT / "drain.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

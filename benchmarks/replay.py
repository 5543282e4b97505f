"""`replay --raw` throughput into a real VictoriaMetrics: the array path against the snapshot path.

Synthesizes a recording of ``--gpus`` sim GPUs for ``--seconds``
(``tests/support/sim_recordings.synthesize``, the recorder's own writer, at virtual time), starts
VictoriaMetrics (the integration tests' harness), then replays every raw sample twice, each
under its own ``bench`` label:

- ``arrays``: what ``hfsampler replay --raw`` does now (``RawBatches``: encoded straight from
  the raw chunk arrays as blocks, ``RemoteWriter.push_block``);
- ``snapshots``: the path it replaced, a ``Snapshot`` per millisecond (``raw_snapshots``) through
  ``RemoteWriter.push``, the peer (run on the first ``--peer-seconds`` of the recording only, by
  default, since it is slow; its rate is per sample all the same).

Each is timed end to end (from opening the file to the last request acknowledged), and the
samples VictoriaMetrics stored are counted through its query API. Also timed: encoding alone
(no network), to tell the encoder's share from the receiver's. Prints a table and writes
``benchmarks/out/replay.json``. The machine may be shared: rates vary from run to run.

    python benchmarks/replay.py [--gpus 8] [--seconds 60] [--peer-seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tests" / "support"))

import receivers as rx  # noqa: E402 (the integration tests' receiver harness)
from sim_recordings import synthesize  # noqa: E402  (the tests' offline sim recordings)

from hfsampler import selfmetrics as sm  # noqa: E402
from hfsampler.profiling.recording import Recording  # noqa: E402
from hfsampler.profiling.replay import RawBatches, raw_snapshots, replay, replay_labels  # noqa: E402
from hfsampler.remote_write.config import endpoint_from_url  # noqa: E402
from hfsampler.remote_write.encoder import Encoder  # noqa: E402
from hfsampler.remote_write.intake import RemoteWriter  # noqa: E402
from hfsampler.selfmetrics import SelfMetrics  # noqa: E402

OUT = HERE / "out"


async def snapshot_path(rec: Recording, url: str, labels: dict[str, str],
                        until_ms: int) -> tuple[int, int]:  # fmt: skip
    """The old ``replay --raw`` loop: a snapshot per millisecond through ``push``."""
    metrics = SelfMetrics()
    writer = RemoteWriter(endpoint_from_url(url), metrics)
    await writer.start()
    limit = writer.config.queue.capacity // 2
    pushed = 0
    for snap in raw_snapshots(rec, labels):
        if snap.timestamp_ms >= until_ms:
            break
        writer.push(snap)
        pushed += len(snap)
        while writer.queued() > limit:  # noqa: ASYNC110 (as replay does: no event to wait on)
            await asyncio.sleep(0.005)
    await writer.close(600.0)
    assert metrics.total(sm.RW_DROPPED) == 0, "the peer dropped samples"
    return pushed, int(metrics.total(sm.RW_SAMPLES))


def stored(vm: rx.VictoriaMetrics, bench: str, end_s: float) -> int:
    vm.flush()
    got = vm.query(f'sum(count_over_time({{__name__=~".+_raw",bench="{bench}"}}[1d]))', end_s)
    return int(float(got[0]["value"][1])) if got else 0


def encode_only(rec: Recording, labels: dict[str, str], until_ms: int) -> dict[str, float]:
    began = time.perf_counter()
    new = sum(b.samples for b in RawBatches(rec, labels, 4))
    arrays_s = time.perf_counter() - began
    encoder = Encoder()
    began = time.perf_counter()
    old = 0
    for snap in raw_snapshots(rec, labels):
        if snap.timestamp_ms >= until_ms:
            break
        encoder.encode([snap])
        old += len(snap)
    snapshots_s = time.perf_counter() - began
    return {"arrays_samples_per_s": new / arrays_s, "snapshots_samples_per_s": old / snapshots_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--peer-seconds", type=int, default=10)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hfs-replay-bench-") as tmp:
        path = Path(tmp, "run.hfs")
        made = synthesize(path, ns.gpus, ns.seconds, quantize=True)
        rec = Recording(path)
        start_ns, end_ns = rec.time_range_ns()
        peer_until_ms = (start_ns + ns.peer_seconds * 10**9) // 10**6
        base = replay_labels(rec, {})
        encoding = encode_only(rec, base, peer_until_ms)
        vm = rx.start_victoria_metrics(Path(tmp, "vm"))
        try:
            url = vm.write_url
            began = time.perf_counter()
            result = asyncio.run(replay(Recording(path), url, True, {"bench": "arrays"}, 600.0))
            arrays_s = time.perf_counter() - began
            assert result.exit_code == 0, result.summary(str(path), 600.0)
            began = time.perf_counter()
            peer_pushed, peer_sent = asyncio.run(
                snapshot_path(Recording(path), url, {**base, "bench": "snapshots"}, peer_until_ms)
            )
            peer_s = time.perf_counter() - began
            end_s = end_ns / 1e9 + 1
            arrays_stored = stored(vm, "arrays", end_s)
            peer_stored = stored(vm, "snapshots", end_s)
        finally:
            vm.stop()
    out = {
        "gpus": ns.gpus,
        "seconds": ns.seconds,
        "peer_seconds": ns.peer_seconds,
        "file_bytes": made["bytes"],
        "cpus": os.cpu_count(),
        "arrays": {"samples": result.sent, "stored": arrays_stored, "seconds": arrays_s,
                   "samples_per_s": result.sent / arrays_s},
        "snapshots": {"samples": peer_sent, "stored": peer_stored, "seconds": peer_s,
                      "samples_per_s": peer_sent / peer_s},
        "encode_only": encoding,
    }  # fmt: skip
    out["ratio"] = out["arrays"]["samples_per_s"] / out["snapshots"]["samples_per_s"]
    assert peer_pushed == peer_sent
    OUT.mkdir(exist_ok=True)
    (OUT / "replay.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"replay --raw into VictoriaMetrics: {ns.gpus} sim GPUs x {ns.seconds} s, "
          f"{made['bytes'] / 1e6:.1f} MB file; {os.cpu_count()} CPUs, shared machine")  # fmt: skip
    print(f"{'path':<28} {'samples':>12} {'stored':>12} {'seconds':>9} {'samples/s':>12}")
    for name in ("arrays", "snapshots"):
        r = out[name]
        print(f"{name:<28} {r['samples']:>12,} {r['stored']:>12,} {r['seconds']:>9.2f} "
              f"{r['samples_per_s']:>12,.0f}")  # fmt: skip
    print(f"{'ratio arrays / snapshots':<28} {out['ratio']:>57.1f}x")
    print(f"{'encode only: arrays':<28} {encoding['arrays_samples_per_s']:>57,.0f}")
    print(f"{'encode only: snapshots':<28} {encoding['snapshots_samples_per_s']:>57,.0f}")
    print(f"wrote {OUT / 'replay.json'}")


if __name__ == "__main__":
    main()

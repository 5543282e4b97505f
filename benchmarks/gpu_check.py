"""Measure what real NVML gives hfsampler on this machine: latencies, refresh periods, tick rate.

Read-only: it never sets clocks, power limits or modes. Runs in well under 5 minutes:

1. latency of each per-device call the catalogue uses, per GPU;
2. latency of one batched ``nvmlDeviceGetFieldValues`` of every catalogue field id, per GPU;
3. each field's true refresh period on GPU 0: distinct driver timestamps over ~3 s for field ids,
   value changes for call-based fields (a lower bound on the rate: a value may not change);
4. the highest sustainable tick rate: ``NvmlSource.read`` of the fast group, back to back;
5. tick lateness at 1 kHz through ``sampling.sampler.Sampler`` (its own process, as in service),
   and through a plain in-process deadline loop for comparison;
6. GPM (Hopper and newer): support, sample and metrics latency, and which spacing between the two
   samples of a pair gives valid metrics (the finest GPM interval on the device);
7. ``hfsampler probe``: every catalogue field's read latency and true refresh period, and the
   sampling groups it recommends; its table is also written as ``probe-HOST-TIME.txt``.

Prints a table, writes JSON into the directory given as the first argument. Its NVML calls go
through ``hfsampler.sources.nvml.calls`` like the source's own, so both meet the same pynvml.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hfsampler import fields as F
from hfsampler.fields import Field
from hfsampler.sources.base import SourceSpec
from hfsampler.sources.nvml import calls
from hfsampler.sources.nvml.source import NvmlSource, probe_driver

NO_DRIVER_EXIT = 3


def stats_us(samples_ns: Sequence[int] | np.ndarray) -> dict[str, Any]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    if a.size == 0:
        return {"n": 0}
    return {
        "n": int(a.size),
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "max_us": float(a.max()),
        "mean_us": float(a.mean()),
    }


def open_handles(indices: Sequence[int] | None = None) -> list[Any]:
    """nvmlInit and the device handles (the caller shuts NVML down)."""
    calls.init()
    count = calls.device_count()
    return [calls.device_handle(i) for i in (indices or range(count))]


def catalogue_field_ids() -> dict[str, int]:
    """Every catalogue field read by id that this pynvml knows: field name -> NVML field id.

    Per-link NVLink fields are left out: their entries name a link (probed at open by the nvml
    source), so one id per field would measure link 0 only, or a link that is not there.
    """
    out = {}
    for f in F.CATALOGUE:
        fid = calls.field_id(f.nvml_field) if f.nvml_field and f.per != "link" else None
        if fid is not None:
            out[f.name] = fid
    return out


def _timed(fn: Callable[[], Any], repeats: int, budget_s: float) -> tuple[list[int], str | None]:
    took: list[int] = []
    end = time.perf_counter() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        try:
            fn()
        except calls.NvmlError as e:
            return took, calls.error_text(int(e.value))
        took.append(time.perf_counter_ns() - t0)
        if time.perf_counter() > end:
            break
    return took, None


def _working_reader(handle: Any, reader_key: str) -> tuple[calls.Reader | None, str | None]:
    error = None
    for candidate in calls.READERS[reader_key]:
        try:
            candidate(handle)
        except calls.NvmlError as e:
            error = calls.error_text(int(e.value))
            continue
        return candidate, None
    return None, error


def call_latency(
    handles: Sequence[Any], repeats: int = 200, budget_s: float = 0.1
) -> dict[str, list[dict[str, Any]]]:
    """Per call reader key, per GPU: latency of the call hfsampler would use there."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key in calls.READERS:
        rows = []
        for handle in handles:
            reader, error = _working_reader(handle, key)
            if reader is None:
                rows.append({"error": error})
                continue
            took, error = _timed(functools.partial(reader, handle), repeats, budget_s)
            rows.append({**stats_us(took), "error": error})
        out[key] = rows
    return out


class _Batched:
    """One preallocated ``nvmlDeviceGetFieldValues`` request, as the nvml source makes it."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.n = len(ids)
        self.values = (calls.FieldValue * self.n)()
        for k, fid in enumerate(ids):
            self.values[k].fieldId = fid
        self.fn = calls.c_function("nvmlDeviceGetFieldValues")

    def __call__(self, handle: Any) -> None:
        ret = self.fn(handle, self.n, self.values)
        if ret != calls.SUCCESS:
            raise calls.NvmlError(ret)


def batched_latency(
    handles: Sequence[Any], ids: Sequence[int], repeats: int = 500, budget_s: float = 0.5
) -> list[dict[str, Any]]:
    """Per GPU: latency of one batched read of every field id at once."""
    batch = _Batched(ids)
    out = []
    for handle in handles:
        took, error = _timed(functools.partial(batch, handle), repeats, budget_s)
        ok = sum(int(batch.values[k].nvmlReturn) == 0 for k in range(batch.n))
        out.append({**stats_us(took), "error": error, "fields": batch.n, "supported": ok})
    return out


def field_refresh(
    handle: Any,
    ids: dict[str, int],
    duration_s: float = 3.0,
    now: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Per field id: distinct driver timestamps seen while reading back to back for a while
    (``now``: the clock that says how long, in s)."""
    names = list(ids)
    batch = _Batched([ids[n] for n in names])
    seen: list[set[int]] = [set() for _ in names]
    reads = 0
    end = now() + duration_s
    t0 = now()
    while now() < end:
        batch(handle)
        reads += 1
        for k in range(batch.n):
            e = batch.values[k]
            if e.nvmlReturn == calls.SUCCESS:
                seen[k].add(int(e.timestamp))
    elapsed = now() - t0
    out: dict[str, Any] = {"reads": reads, "elapsed_s": elapsed}
    for name, stamps in zip(names, seen, strict=True):
        if not stamps:
            out[name] = {"supported": False}
            continue
        ts = np.array(sorted(stamps), dtype=np.int64)
        gaps = np.diff(ts)
        out[name] = {
            "supported": True,
            "distinct": int(ts.size),
            "per_s": ts.size / elapsed,
            "period_ms": float(np.median(gaps)) / 1000.0 if gaps.size else None,
        }
    return out


def call_refresh(
    handle: Any,
    keys: Sequence[str] | None = None,
    duration_s: float = 2.0,
    now: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Per call-based field key: value changes seen while calling back to back for a while
    (``now``: the clock that says how long, in s)."""
    out: dict[str, Any] = {}
    # the XID ones are the event set's, not a call to repeat
    for key in keys or [k for k, c in calls.CALL_FIELDS.items() if c.reader != "xid"]:
        spec = calls.CALL_FIELDS[key]
        reader, error = _working_reader(handle, spec.reader)
        if reader is None:
            out[key] = {"supported": False, "error": error}
            continue
        changes, n, last = 0, 0, None
        end = now() + duration_s
        t0 = now()
        while now() < end:
            try:
                v = spec.extract(reader(handle))
            except calls.NvmlError:
                continue
            n += 1
            if last is not None and v != last:
                changes += 1
            last = v
        elapsed = now() - t0
        out[key] = {
            "supported": True,
            "calls": n,
            "changes": changes,
            "changes_per_s": changes / elapsed,
            "period_ms_at_most": 1000.0 * elapsed / changes if changes else None,
        }
    return out


def fast_fields() -> tuple[Field, ...]:
    return tuple(f for f in F.CATALOGUE if f.group == F.FAST and f.nvml_readable)


def max_tick_rate(
    fields: Sequence[Field], duration_s: float = 2.0, indices: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """``NvmlSource.read`` of ``fields``, every GPU, back to back: the ceiling on the tick rate."""
    source = NvmlSource(indices)
    inv = source.open(fields)
    try:
        group = tuple(fields)
        shape = (len(inv.devices), len(group))
        values, ts = np.empty(shape), np.empty(shape, dtype=np.int64)
        took: list[int] = []
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            t0 = time.perf_counter_ns()
            source.read(group, values, ts, time.time_ns())
            took.append(time.perf_counter_ns() - t0)
    finally:
        source.close()
    s = stats_us(took)
    return {**s, "gpus": len(inv.devices), "ticks_per_s": 1e6 / s["mean_us"] if took else 0.0}


def deadline_loop(
    fields: Sequence[Field],
    rate_hz: float = 1000.0,
    duration_s: float = 5.0,
    indices: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Lateness of a plain in-process sleep-to-deadline loop reading ``fields`` at ``rate_hz``."""
    source = NvmlSource(indices)
    inv = source.open(fields)
    interval = int(1e9 / rate_hz)
    late: list[int] = []
    missed = 0
    try:
        group = tuple(fields)
        shape = (len(inv.devices), len(group))
        values, ts = np.empty(shape), np.empty(shape, dtype=np.int64)
        now = time.perf_counter_ns()
        deadline = now - now % interval + interval
        end = now + int(duration_s * 1e9)
        while deadline < end:
            remaining = deadline - time.perf_counter_ns()
            if remaining > 0:
                time.sleep(remaining / 1e9)
            lateness = time.perf_counter_ns() - deadline
            skip = lateness // interval
            missed += skip
            late.append(lateness - skip * interval)
            source.read(group, values, ts, time.time_ns())
            deadline += (skip + 1) * interval
    finally:
        source.close()
    return {**stats_us(late), "rate_hz": rate_hz, "missed": int(missed)}


def sampler_lateness(
    spec: SourceSpec, fields: Sequence[Field], rate_hz: float = 1000.0, duration_s: float = 5.0
) -> dict[str, Any]:
    """Tick lateness through hfsampler's own sampler process (the way the service samples)."""
    from hfsampler.sampling.groups import GroupPlan
    from hfsampler.sampling.sampler import Sampler
    from hfsampler.sources.registry import open_source

    probe = open_source(spec)
    inventory = probe.open(fields)
    probe.close()
    group = GroupPlan(F.FAST, 1.0 / rate_hz, tuple(fields))
    late: list[np.ndarray] = []
    with Sampler(spec, inventory, [group], window_s=1.0) as sampler:
        sampler.start()
        ring = sampler.rings[F.FAST]
        seq = ring.write_seq
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            time.sleep(min(0.25, max(0.0, end - time.monotonic())))
            seq, rows, _ = ring.read_since(seq)
            late.append(rows.lateness_ns)
        counters = sampler.counters(0)
        spin_s = sampler.spin_s
    lateness = np.concatenate(late) if late else np.empty(0, dtype=np.int64)
    return {
        **stats_us(lateness),
        "rate_hz": rate_hz,
        "ticks": counters.ticks,
        "late": counters.late,
        "missed": counters.missed,
        "spin_s": spin_s,
    }


# -- the run ---------------------------------------------------------------------------------------


def run(scale: float = 1.0) -> dict[str, Any]:
    """Every measurement, each ``scale`` times its usual duration."""
    result: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "pynvml": calls.PYNVML_VERSION,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    handles = open_handles()
    try:
        result["driver"] = calls.driver_version()
        result["gpus"] = [calls.device_name(h) for h in handles]
        ids = catalogue_field_ids()
        print(f"{len(handles)} GPU(s), driver {result['driver']}: measuring call latency...")
        result["call_latency"] = call_latency(handles, budget_s=0.1 * scale + 0.01)
        print("batched field-value latency...")
        result["batched_latency"] = batched_latency(
            handles, list(ids.values()), budget_s=0.5 * scale + 0.01
        )
        print("refresh periods on GPU 0 (field ids ~3 s, then each call ~2 s)...")
        result["field_refresh"] = field_refresh(handles[0], ids, duration_s=3.0 * scale)
        result["call_refresh"] = call_refresh(handles[0], duration_s=2.0 * scale)
    finally:
        calls.shutdown()
    fast = fast_fields()
    print("maximum tick rate of the fast group...")
    result["max_tick_rate"] = max_tick_rate(fast, duration_s=2.0 * scale)
    print("1 kHz through hfsampler's sampler process...")
    try:
        result["sampler_1khz"] = sampler_lateness(SourceSpec("nvml"), fast, 1000.0, 5.0 * scale)
    except Exception as e:  # the report should still come out if the sampler cannot run
        result["sampler_1khz"] = {"error": repr(e)}
    print("1 kHz through a plain in-process deadline loop...")
    result["deadline_loop_1khz"] = deadline_loop(fast, 1000.0, 5.0 * scale)
    print("GPM: support, call latency, valid sample spacing...")
    handles = open_handles()
    try:
        result["gpm"] = gpm_check(handles, repeats=max(1, int(3 * scale)))
    finally:
        calls.shutdown()
    print(f"hfsampler probe over {3.0 * scale:g} s (every catalogue field, through NvmlSource)...")
    from hfsampler.sampling.probe import probe

    result["probe"] = probe(SourceSpec("nvml"), duration_s=3.0 * scale).to_json()
    return result


GPM_SPACINGS_MS = (1, 5, 10, 20, 50, 100, 200)


def gpm_check(handles: Sequence[Any], repeats: int = 3) -> list[dict[str, Any]]:
    """Per GPU: GPM support, the latency of a sample and of a metrics computation, and, per
    spacing between the two samples of a pair, how many pairs gave a valid SM_UTIL (the finest
    interval GPM supports on this device is the shortest spacing where every pair is valid)."""
    out: list[dict[str, Any]] = []
    for handle in handles:
        try:
            supported = calls.gpm_supported(handle)
        except calls.NvmlError as e:
            out.append({"supported": False, "error": calls.error_text(int(e.value))})
            continue
        if not supported:
            out.append({"supported": False, "error": "not a GPM device"})
            continue
        s1, s2 = calls.gpm_sample_alloc(), calls.gpm_sample_alloc()
        request = calls.gpm_metrics_request([calls.gpm_metric_id("NVML_GPM_METRIC_SM_UTIL") or 0])
        request.sample1, request.sample2 = s1, s2
        sample_ns: list[int] = []
        metrics_ns: list[int] = []
        spacing: dict[str, dict[str, Any]] = {}
        try:
            for ms in GPM_SPACINGS_MS:
                ok, values = 0, []
                for _ in range(repeats):
                    t0 = time.perf_counter_ns()
                    calls.gpm_sample_get(handle, s1)
                    sample_ns.append(time.perf_counter_ns() - t0)
                    time.sleep(ms / 1000)
                    calls.gpm_sample_get(handle, s2)
                    t0 = time.perf_counter_ns()
                    try:
                        calls.gpm_metrics_get(request)
                    except calls.NvmlError:
                        continue
                    metrics_ns.append(time.perf_counter_ns() - t0)
                    if int(request.metrics[0].nvmlReturn) == 0:
                        ok += 1
                        values.append(float(request.metrics[0].value))
                spacing[f"{ms}ms"] = {"pairs": repeats, "valid": ok, "sm_util": values}
        finally:
            for s in (s1, s2):
                calls.gpm_sample_free(s)
        finest = next(
            (ms for ms in GPM_SPACINGS_MS if spacing[f"{ms}ms"]["valid"] == repeats), None
        )
        out.append(
            {
                "supported": True,
                "sample": stats_us(sample_ns),
                "metrics_get": stats_us(metrics_ns),
                "spacing": spacing,
                "finest_valid_spacing_ms": finest,
            }
        )
    return out


def _probe_result(data: dict[str, Any], cls: Any) -> Any:
    """A ProbeResult back from its JSON form (for the table)."""
    from hfsampler.sampling.probe import FieldProbe

    fields = tuple(FieldProbe(**{**f, "refresh_s": tuple(f["refresh_s"])}) for f in data["fields"])
    rest = {k: v for k, v in data.items() if k != "fields"}
    rest["gpus"], rest["batched_read_us"] = tuple(rest["gpus"]), tuple(rest["batched_read_us"])
    return cls(fields=fields, **rest)


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(r: dict[str, Any]) -> None:
    print(f"\nhfsampler gpu_check on {r['host']}: {len(r['gpus'])} GPU(s), driver {r['driver']}")
    print(f"\n{'call (per GPU)':<24}{'p50 us':>10}{'p99 us':>10}{'max us':>10}  note")
    for key, rows in r["call_latency"].items():
        ok = [x for x in rows if "p50_us" in x]
        errs = {x["error"] for x in rows if x.get("error")}
        if ok:
            p50 = float(np.median([x["p50_us"] for x in ok]))
            p99 = max(x["p99_us"] for x in ok)
            mx = max(x["max_us"] for x in ok)
            print(f"{key:<24}{p50:>10.1f}{p99:>10.1f}{mx:>10.1f}  {', '.join(errs)}")
        else:
            print(f"{key:<24}{'-':>10}{'-':>10}{'-':>10}  {', '.join(map(str, errs))}")
    print(f"\n{'batched read, GPU':<24}{'p50 us':>10}{'p99 us':>10}{'max us':>10}  fields ok")
    for i, x in enumerate(r["batched_latency"]):
        print(
            f"{i:<24}{_fmt(x.get('p50_us')):>10}{_fmt(x.get('p99_us')):>10}"
            f"{_fmt(x.get('max_us')):>10}  {x['supported']}/{x['fields']} {x.get('error') or ''}"
        )
    print(f"\n{'field (GPU 0)':<44}{'updates/s':>10}{'period ms':>11}")
    for name, x in r["field_refresh"].items():
        if isinstance(x, dict) and x.get("supported"):
            print(f"{name:<44}{x['per_s']:>10.1f}{_fmt(x['period_ms'], '.2f'):>11}")
        elif isinstance(x, dict):
            print(f"{name:<44}{'unsupported':>21}")
    for key, x in r["call_refresh"].items():
        if x.get("supported"):
            per = _fmt(x["period_ms_at_most"], ".2f")
            print(f"{'call ' + key:<44}{x['changes_per_s']:>10.1f}{per:>11}  (value changes)")
        else:
            print(f"{'call ' + key:<44}{'unsupported':>21}")
    m = r["max_tick_rate"]
    print(
        f"\nfast group, {m['gpus']} GPU(s): one tick p50 {_fmt(m.get('p50_us'))} us, "
        f"p99 {_fmt(m.get('p99_us'))} us -> at most {m['ticks_per_s']:.0f} ticks/s"
    )
    for i, g in enumerate(r.get("gpm", [])):
        if not g.get("supported"):
            print(f"GPM on GPU {i}: not supported ({g.get('error')})")
            continue
        valid = ", ".join(f"{k} {v['valid']}/{v['pairs']}" for k, v in g["spacing"].items())
        print(
            f"GPM on GPU {i}: sample p50 {_fmt(g['sample'].get('p50_us'))} us, metrics p50 "
            f"{_fmt(g['metrics_get'].get('p50_us'))} us; valid pairs by spacing: {valid}; "
            f"finest valid spacing {g['finest_valid_spacing_ms']} ms"
        )
    loops = (("sampler process", "sampler_1khz"), ("deadline loop", "deadline_loop_1khz"))
    for label, key in loops:
        x = r[key]
        if "error" in x:
            print(f"1 kHz {label}: failed: {x['error']}")
            continue
        extra = f", ticks {x['ticks']}, late {x['late']}" if "ticks" in x else ""
        print(
            f"1 kHz {label}: lateness p50 {_fmt(x.get('p50_us'))} us, p99 "
            f"{_fmt(x.get('p99_us'))} us, max {_fmt(x.get('max_us'))} us, "
            f"missed {x['missed']}{extra}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", nargs="?", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="a tenth of each duration")
    args = parser.parse_args(argv)
    reason = probe_driver()
    if reason is not None:
        print(f"gpu_check: no usable NVIDIA driver here ({reason}); nothing to measure.")
        return NO_DRIVER_EXIT
    result = run(scale=0.1 if args.quick else 1.0)
    print_table(result)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = f"{result['host']}-{time.strftime('%Y%m%dT%H%M%S')}"
    path = out / f"gpu_check-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {path}")
    if "probe" in result:
        from hfsampler.sampling.probe import ProbeResult, format_table

        table = format_table(_probe_result(result["probe"], ProbeResult))
        print("\n" + table)
        probe_path = out / f"probe-{stamp}.txt"
        probe_path.write_text(table + "\n")
        print(f"wrote {probe_path}")
    return 0


if __name__ == "__main__":
    # Progress lines show as they happen when piped through tee.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.exit(main())

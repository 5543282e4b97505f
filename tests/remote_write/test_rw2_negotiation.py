"""Remote-Write 2.0 negotiation against odd answers: nothing stored twice, nothing lost, and
metadata even for what a spool replays before the first window."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from conformance import ConformanceReceiver, Reply
from test_rw_sender import FAST, eventually, labels_of, make_series, snap

from hfsampler import selfmetrics as sm
from hfsampler.remote_write.config import EndpointConfig
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.relabel import parse_rules
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import Family, SeriesRegistry, Snapshot

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops

V2 = "io.prometheus.write.v2.Request"
NOW = int(time.time() * 1000)  # the conformance receiver refuses samples from long ago
FAMILY = Family("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge", "W")


def v2_endpoint(url: str, **queue: object) -> EndpointConfig:
    return EndpointConfig(url, name="t", protobuf_message=V2, queue=replace(FAST, **queue))


def stored(rx: ConformanceReceiver) -> int:
    return sum(len(v) for v in rx.samples.values())


async def test_unparsable_written_header_is_no_fallback_and_no_duplicate() -> None:
    """A 2.0 receiver's Written header that is not a count still says it decoded 2.0."""
    odd = Reply(204, headers={"X-Prometheus-Remote-Write-Samples-Written": "²"})
    async with ConformanceReceiver(script=[odd]) as rx:
        metrics = SelfMetrics()
        writer = RemoteWriter(v2_endpoint(rx.url), metrics)
        await writer.start()
        writer.push(snap(make_series(3), NOW + 1000))
        await eventually(lambda: metrics.total(sm.RW_SAMPLES) >= 3)
        writer.push(snap(make_series(3), NOW + 2000))
        await eventually(lambda: metrics.total(sm.RW_SAMPLES) >= 6)
        await writer.close(5)
    assert metrics.total(sm.RW_PROTOCOL_FALLBACKS) == 0
    assert metrics.total(sm.RW_DROPPED) == 0
    assert rx.protocols == ["2.0", "2.0"]


async def test_400_with_written_headers_is_a_refusal_not_a_fallback() -> None:
    refusal = Reply(
        400,
        'invalid label value for "content_type"',
        {"X-Prometheus-Remote-Write-Samples-Written": "2"},
    )
    async with ConformanceReceiver(script=[refusal]) as rx:
        metrics = SelfMetrics()
        cfg = v2_endpoint(rx.url)
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        writer.push(snap(make_series(3), NOW + 1000))
        await eventually(lambda: metrics.total(sm.RW_SAMPLES) + metrics.total(sm.RW_DROPPED) >= 3)
        await writer.close(5)
    assert metrics.total(sm.RW_PROTOCOL_FALLBACKS) == 0
    assert metrics.get(sm.RW_SAMPLES, labels_of(cfg)) == 2  # the partial write
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 1
    assert rx.requests == 1  # not resent as 1.0


async def test_415_to_1_0_after_a_fallback_tries_2_0_at_once() -> None:
    """A 1.x receiver replaced by one that takes 2.0 only: 1.0's 415 is no drop."""
    async with ConformanceReceiver(legacy_v1_only=True) as old:
        url = old.url
        metrics = SelfMetrics()
        writer = RemoteWriter(v2_endpoint(url), metrics, families={FAMILY.name: FAMILY})
        await writer.start()
        writer.push(snap(make_series(2), NOW + 1000))
        await eventually(lambda: metrics.total(sm.RW_SAMPLES) >= 2)
    assert metrics.total(sm.RW_PROTOCOL_FALLBACKS) == 1
    port = int(url.split(":")[2].split("/")[0])
    async with ConformanceReceiver(port=port, accept=(V2,)) as new:
        writer.push(snap(make_series(2), NOW + 2000))
        await eventually(lambda: stored(new) >= 2)
        await writer.close(5)
    assert metrics.total(sm.RW_DROPPED) == 0
    assert new.protocols[-1] == "2.0"
    new.assert_conformant()


async def test_a_spool_replayed_at_start_goes_out_with_metadata(tmp_path: Path) -> None:
    """Windows spooled by an earlier process reach a 2.0 receiver with their metadata."""
    reg = SeriesRegistry()
    series = [reg.series(FAMILY.name, {"gpu": str(g), "UUID": f"GPU-{g}"}) for g in range(2)]
    families = {FAMILY.name: FAMILY}
    async with ConformanceReceiver() as probe:
        dead = probe.url
    first = RemoteWriter(v2_endpoint(dead, max_backoff_s=0.05), SelfMetrics(), tmp_path, families)
    await first.start()
    first.push(Snapshot(NOW, series, [1.0, 2.0], families))
    await first.close(0.2)  # nobody listens: it stays spooled
    port = int(dead.split(":")[2].split("/")[0])
    async with ConformanceReceiver(port=port, require_metadata=True) as rx:
        metrics = SelfMetrics()
        second = RemoteWriter(v2_endpoint(rx.url), metrics, tmp_path, families)
        await second.start()  # the spool drains before any window of this process
        await eventually(lambda: stored(rx) >= 2)
        await second.close(5)
    rx.assert_conformant()
    assert {rx.metadata_of[k] for k in rx.samples} == {("gauge", FAMILY.help, "W")}


async def test_a_family_renamed_by_relabelling_keeps_its_metadata() -> None:
    """write_relabel_configs renaming ``__name__``: 2.0 metadata follows the series' new name."""
    rules = parse_rules(
        [{"source_labels": ["__name__"], "regex": "DCGM_FI_DEV_(.*)", "target_label": "__name__",
          "replacement": "gpu_$1"}],
        "write_relabel_configs",
    )  # fmt: skip
    reg = SeriesRegistry()
    series = [reg.series(FAMILY.name, {"gpu": str(g), "UUID": f"GPU-{g}"}) for g in range(2)]
    families = {FAMILY.name: FAMILY}
    async with ConformanceReceiver(require_metadata=True) as rx:
        metrics = SelfMetrics()
        cfg = replace(v2_endpoint(rx.url), relabel=rules)
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        writer.push(Snapshot(NOW + 1000, series, [1.0, 2.0], families))
        await eventually(lambda: stored(rx) >= 2)
        await writer.close(5)
    rx.assert_conformant()
    assert {dict(k)["__name__"] for k in rx.samples} == {"gpu_POWER_USAGE"}
    assert {rx.metadata_of[k] for k in rx.samples} == {("gauge", FAMILY.help, "W")}

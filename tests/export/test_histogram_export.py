"""Native-histogram series in the metric model and on /metrics' protobuf page (issue 26)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import yaml
from google.protobuf.internal.decoder import _DecodeVarint  # type: ignore[attr-defined]
from inprocess import free_port, reloaded, run_plan, start_ns

from hfsampler import fields
from hfsampler.cli.main import build_parser
from hfsampler.config.flags import config_from_args
from hfsampler.config.settings import Config
from hfsampler.export import exposition, exposition_proto
from hfsampler.export.exposition_pb import metrics_pb2
from hfsampler.export.metrics import MetricModel
from hfsampler.export.service import Service
from hfsampler.histograms import HistogramAccumulator, ResetHint
from hfsampler.remote_write.protowrite import varint
from hfsampler.sampling.histogram_counts import CountedHistogram
from hfsampler.sampling.stepping import VirtualClock
from hfsampler.sampling.window import STATS, WindowStats
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import STALE_HISTOGRAM, Snapshot, is_stale
from hfsampler.sources.sim.source import SimSource

ROOT = Path(__file__).resolve().parents[2]
S = 10**9
POWER = fields.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]
ENERGY = fields.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
HIST = "DCGM_FI_DEV_POWER_USAGE_histogram"
GROUP = (POWER, ENERGY)


def _stats(group: tuple[fields.Field, ...], mean: list[list[float]]) -> WindowStats:
    m = np.array(mean, dtype=np.float64)
    c = np.where(np.isnan(m), 0, 10).astype(np.int64)
    return WindowStats(0, 1, group, {s.name: m for s in STATS}, c)


def _model(gpus: int = 2, **kw: object) -> MetricModel:
    inv = SimSource(gpus).open(list(GROUP))
    return MetricModel(inv.devices, {"g": GROUP}, SelfMetrics(), {"cluster": "eu1"},
                       hostname="node1", histograms=[POWER.name], **kw)  # type: ignore[arg-type]  # fmt: skip


def _counted(
    accs: list[HistogramAccumulator], samples: list[list[float]]
) -> list[CountedHistogram]:
    out = []
    for row, (acc, values) in enumerate(zip(accs, samples, strict=True)):
        acc.add(np.array(values))
        out.append(CountedHistogram(row, 0, acc.snapshot()))
    return out


def _window(
    model: MetricModel, accs: list[HistogramAccumulator], up: list[bool], t: int
) -> Snapshot:
    counted = _counted(accs, [[300.0, 310.0, 320.0]] * len(accs))
    stats = _stats(GROUP, [[300, 5e9]] * len(accs))
    return model.snapshot({"g": stats}, np.array(up), t * 10**9, {"g": counted})


def test_a_histogram_series_per_gpu_with_its_floats_labels_and_a_histogram_family() -> None:
    model = _model()
    snap = _window(model, [HistogramAccumulator(), HistogramAccumulator()], [True, True], 1)
    floats = {dict(s.labels)["gpu"]: s.labels for s, _ in snap.items() if s.name == POWER.name}
    hists = {dict(s.labels)["gpu"]: (s, h) for s, h in snap.histograms}
    assert set(hists) == {"0", "1"}
    for gpu, (s, h) in hists.items():
        assert s.name == HIST
        assert s.labels == floats[gpu]  # the same labels: host, instance, cluster, GPU's
        assert dict(s.labels)["cluster"] == "eu1"
        assert h.count == 3
        assert h.reset_hint is ResetHint.YES
    family = snap.families[HIST]
    assert family.type == "histogram"
    assert family.help.startswith("Power draw") or "native histogram" in family.help
    assert "native histogram of every distinct sample" in family.help
    # only the field asked for: no energy histogram (a counter), no _min/_max of it
    assert {s.name for s, _ in snap.histograms} == {HIST}
    assert HIST not in {s.name for s, _ in snap.items()}


def test_a_lost_gpus_histogram_ends_with_one_stale_marker_and_shutdown_ends_all() -> None:
    model = _model()
    accs = [HistogramAccumulator(), HistogramAccumulator()]
    _window(model, accs, [True, True], 1)
    lost = _window(model, accs, [True, False], 2)
    stale = [(dict(s.labels)["gpu"], h) for s, h in lost.histograms if is_stale(h.sum)]
    assert stale == [("1", STALE_HISTOGRAM)]
    assert STALE_HISTOGRAM.count == 0
    assert is_stale(STALE_HISTOGRAM.sum)
    again = _window(model, accs, [True, False], 3)
    assert [dict(s.labels)["gpu"] for s, _ in again.histograms] == ["0"]
    back = _window(model, accs, [True, True], 4)  # back: its counts went on meanwhile
    assert {dict(s.labels)["gpu"]: h.count for s, h in back.histograms} == {"0": 12, "1": 12}
    final = model.final_snapshot(5 * 10**9)
    assert len(final.histograms) == 2
    assert all(h is STALE_HISTOGRAM for _, h in final.histograms)


def test_a_reload_without_the_histogram_ends_its_series() -> None:
    model = _model()
    accs = [HistogramAccumulator(), HistogramAccumulator()]
    before = _window(model, accs, [True, True], 1)
    inv = SimSource(2).open(list(GROUP))
    kept = MetricModel(inv.devices, {"g": GROUP}, SelfMetrics(), {"cluster": "eu1"},
                       hostname="node1", histograms=[POWER.name], previous=model)  # fmt: skip
    same = _window(kept, accs, [True, True], 2)
    assert [s.id for s, _ in same.histograms] == [s.id for s, _ in before.histograms]
    dropped = MetricModel(inv.devices, {"g": GROUP}, SelfMetrics(), {"cluster": "eu1"},
                          hostname="node1", previous=kept)  # fmt: skip
    stats = _stats(GROUP, [[300, 5e9]] * 2)
    after = dropped.snapshot({"g": stats}, np.array([True, True]), 3 * 10**9)
    assert [h for _, h in after.histograms] == [STALE_HISTOGRAM, STALE_HISTOGRAM]


def test_a_mig_instance_has_histograms_of_its_own_fields_never_of_copied_ones() -> None:
    group = fields.expand_mig(
        fields.select(["POWER_USAGE", "FB_USED"]), {"fast": 1e-3, "slow": 0.1}
    )
    inv = SimSource(1, mig=("3g", "1g")).open(list(group))
    model = MetricModel(inv.devices, {"g": group}, SelfMetrics(), copy_device_fields=True,
                        histograms=["DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED"])  # fmt: skip
    arr = model._groups["g"].histograms  # [row, field]
    names = [(r, j) for r, j in zip(*np.nonzero(arr != None), strict=True)]  # noqa: E711
    gpu_cols = {j for r, j in names if r == 0}
    assert gpu_cols == {0, 1}  # the GPU: power and its own memory
    for r, j in names:
        if r > 0:  # a slot: only its own per-instance memory
            assert group[j].mig_instance
    held = [r for r, d in enumerate(inv.devices) if d.mig is not None]
    assert held
    mem = next(j for j, f in enumerate(group) if f.mig_instance)
    for r in held:  # an instance's with its GPU_I_ID, as its floats
        instance = inv.devices[r].mig
        assert instance is not None
        assert dict(arr[r, mem].labels)["GPU_I_ID"] == str(instance.gpu_instance_id)


def test_a_slots_new_instance_ends_the_old_instances_histogram_and_starts_its_own() -> None:
    group = fields.expand_mig(fields.select(["FB_USED"]), {"fast": 1e-3, "slow": 0.1})
    inv = SimSource(1, mig=("3g", "1g")).open(list(group))
    model = MetricModel(
        inv.devices, {"g": group}, SelfMetrics(), histograms=["DCGM_FI_DEV_FB_USED"]
    )
    row = next(r for r, d in enumerate(inv.devices) if d.mig is not None)
    col = next(j for j, f in enumerate(group) if f.mig_instance)
    up = np.ones(len(inv.devices), np.bool_)
    stats = _stats(group, [[1000.0] * len(group)] * len(inv.devices))
    acc = HistogramAccumulator()
    acc.add(np.array([1000.0]))
    first = model.snapshot(
        {"g": stats}, up, 10**9, {"g": [CountedHistogram(row, col, acc.snapshot())]}
    )
    (old,) = [s for s, _ in first.histograms]
    instance = inv.devices[row].mig
    assert instance is not None
    moved = replace(instance, gpu_instance_id=instance.gpu_instance_id + 20, uuid="MIG-new")
    model.set_devices([replace(d, mig=moved) if r == row else d for r, d in enumerate(inv.devices)])
    # the window of the change counts into neither instance (sampling.histogram_counts)
    changed = model.snapshot({"g": stats}, up, 2 * 10**9, {"g": []})
    assert changed.histograms == [(old, STALE_HISTOGRAM)]
    fresh = HistogramAccumulator()
    fresh.add(np.array([2000.0]))
    after = model.snapshot(
        {"g": stats}, up, 3 * 10**9, {"g": [CountedHistogram(row, col, fresh.snapshot())]}
    )
    ((new, h),) = after.histograms
    assert dict(new.labels)["GPU_I_ID"] == str(moved.gpu_instance_id)
    assert new.id != old.id
    assert h.reset_hint is ResetHint.YES


def _families(page: bytes) -> list[metrics_pb2.MetricFamily]:
    out, at = [], 0
    while at < len(page):
        size, at = _DecodeVarint(page, at)
        out.append(metrics_pb2.MetricFamily.FromString(page[at : at + size]))
        at += size
    return out


def test_the_protobuf_page_is_what_the_generated_module_reads_and_writes() -> None:
    model = _model()
    accs = [HistogramAccumulator(), HistogramAccumulator()]
    _window(model, accs, [True, True], 1)
    snap = _window(model, accs, [True, False], 2)  # a stale float and a stale histogram in it
    page = exposition.Page()
    page.update(snap)
    body = page.body(protobuf=True)
    families = _families(body)
    # byte for byte what the protobuf library writes for the same messages
    assert b"".join(varint(f.ByteSize()) + f.SerializeToString() for f in families) == body
    by_name = {f.name: f for f in families}
    assert [f.name for f in families] == sorted(by_name)
    text = page.body().decode()
    # every float series the text page has, with its value and labels (instance left off)
    for f in families:
        if f.type == metrics_pb2.HISTOGRAM:
            continue
        for m in f.metric:
            labels = ",".join(f'{p.name}="{p.value}"' for p in m.label)
            value = m.gauge.value if f.type == metrics_pb2.GAUGE else m.counter.value
            assert f"{f.name}{{{labels}}} {exposition.format_value(value)}\n" in text
            assert "instance" not in {p.name for p in m.label}
    hist = by_name[HIST]
    assert hist.type == metrics_pb2.HISTOGRAM
    assert hist.help == snap.families[HIST].help
    [m] = hist.metric  # GPU 1 is down: its stale marker is not on the page
    h = m.histogram
    live = next(h_ for s, h_ in snap.histograms if dict(s.labels)["gpu"] == "0")
    assert (h.sample_count, h.sample_sum, h.schema) == (live.count, live.sum, live.schema)
    assert h.zero_threshold == live.zero_threshold > 0  # what marks it a native histogram
    assert [(s.offset, s.length) for s in h.positive_span] == list(live.positive_spans)
    assert list(h.positive_delta) == list(live.positive_deltas)
    assert not h.bucket  # no classic buckets
    # the text format has no native histograms: the page is as it was
    assert HIST not in text
    assert page.body(protobuf=True) is body
    assert page.renders == 2


@pytest.mark.parametrize(
    ("accept", "protobuf"),
    [
        ("", False),
        ("*/*", False),
        ("text/plain;version=0.0.4", False),
        # Prometheus 2.42 with --enable-feature=native-histograms
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
         "encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,"
         "application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,"
         "*/*;q=0.1", True),
        # Prometheus 3 with PrometheusProto first
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
         "encoding=delimited;q=0.5,application/openmetrics-text;version=1.0.0;q=0.4,"
         "text/plain;version=0.0.4;q=0.2,*/*;q=0.1", True),
        # Prometheus 3's default: text
        ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
         "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;"
         "escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1", False),
        # the weight decides, not the order
        ("text/plain;version=0.0.4;q=0.3,application/vnd.google.protobuf;"
         "proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7", True),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
         "encoding=delimited;q=0.1,text/plain;q=0.9", False),
        # protobuf text encodings are not served: text
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
         "encoding=text", False),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
         "encoding=delimited;q=0", False),
    ],
)  # fmt: skip
def test_the_format_is_negotiated_as_client_golang_does(accept: str, protobuf: bool) -> None:
    assert exposition_proto.wants_protobuf(accept) is protobuf


PROTOBUF_ACCEPT = (
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;"
    "q=0.5,text/plain;version=0.0.4;q=0.2"
)
INSTANT = "DCGM_FI_DEV_POWER_USAGE_INSTANT"


def _metric(families: list[metrics_pb2.MetricFamily], name: str, **labels: str):  # type: ignore[no-untyped-def]
    for f in families:
        if f.name == name:
            for m in f.metric:
                got = {p.name: p.value for p in m.label}
                if all(got.get(k) == v for k, v in labels.items()):
                    return m
    return None


async def test_a_run_serves_its_histograms_to_a_protobuf_scrape_and_a_reload_adds_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On the sim and a virtual clock: each window's page has every distinct sample counted
    (the window's count is what its refresh gauge says), text scrapes see no histogram, and a
    reload that adds a field starts its histogram while the other one keeps counting."""
    caplog.set_level(logging.INFO)
    port = free_port()
    path = tmp_path / "hfsampler.yml"
    path.write_text(yaml.safe_dump({"histograms": [INSTANT]}))
    parser, _ = build_parser()
    argv = ["run", "--source", "sim", "--gpus", "2", "--config", str(path),
            "--listen", f"127.0.0.1:{port}", "--duration", "7s"]  # fmt: skip

    def load() -> Config:
        return config_from_args(parser.parse_args(argv))

    started = start_ns()
    clock = VirtualClock(started)
    service = Service(run_plan(*argv[1:]), clock=clock, loader=load)
    pages: list[tuple[int, list[metrics_pb2.MetricFamily], str]] = []

    async def scrape(k: int) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers={"Accept": PROTOBUF_ACCEPT}) as resp:
                assert resp.headers["Content-Type"] == exposition_proto.CONTENT_TYPE
                assert resp.headers["Vary"] == "Accept, Accept-Encoding"  # for caches between
                proto = _families(await resp.read())
            async with session.get(url) as resp:
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = await resp.text()
        pages.append((k, proto, text))

    def reload() -> None:
        path.write_text(yaml.safe_dump({"histograms": [INSTANT, "GPU_TEMP"]}))
        service.request_reload()

    for k in range(1, 7):
        clock.at(started + k * S + S // 2, lambda k=k: scrape(k))
    clock.at(started + 3 * S + S // 4, reload)
    clock.at(started + 3 * S + S // 3, lambda: reloaded(caplog))
    assert await service.run() == 0
    assert [k for k, _, _ in pages] == [1, 2, 3, 4, 5, 6]
    counts = []
    for _, proto, text in pages:
        assert "_histogram" not in text  # text has no native histograms
        m = _metric(proto, INSTANT + "_histogram", gpu="0")
        assert m is not None
        counts.append(m.histogram.sample_count)
        assert {p.name for p in m.label} >= {"gpu", "UUID", "modelName", "hostname"}
        refresh = _metric(proto, "hfsampler_field_refresh_seconds", gpu="0", field=INSTANT)
        assert refresh is not None
        if len(counts) > 1:  # the window's distinct samples, all of them, once
            assert counts[-1] - counts[-2] == round(1.0 / refresh.gauge.value)
    temp = [_metric(proto, "DCGM_FI_DEV_GPU_TEMP_histogram", gpu="1") for _, proto, _ in pages]
    assert temp[:2] == [None, None]  # not asked for before the reload
    after = [m.histogram.sample_count for m in temp[3:] if m is not None]
    assert len(after) == 3
    assert after == sorted(after)
    assert 0 < after[0] <= 10  # the slow group's 100 ms: from its first window on

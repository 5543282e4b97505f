"""The metric model and /metrics text: dcgm-exporter names and labels, siblings, stale markers."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from hfsampler import fields
from hfsampler.export import exposition
from hfsampler.export.metrics import MetricModel
from hfsampler.sampling.window import STATS, WindowStats
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import is_stale
from hfsampler.sources.sim.source import SimSource

POWER = fields.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]
ENERGY = fields.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
XID = fields.BY_NAME["DCGM_FI_DEV_XID_ERRORS"]


def _stats(
    fields_: tuple[fields.Field, ...], mean: list[list[float]], count: int = 10
) -> WindowStats:
    m = np.array(mean, dtype=np.float64)
    c = np.where(np.isnan(m), 0, count).astype(np.int64)
    values = {**{s.name: m for s in STATS}, "min": m - 1, "max": m + 1, "p99": m + 0.5}
    return WindowStats(0, 1, fields_, values, c)


def _model(gpus: int = 2, **kw: object) -> MetricModel:
    inv = SimSource(gpus).open([POWER, ENERGY, XID])
    sm = SelfMetrics()
    sm.define("hfsampler_windows_total", "Windows.", "counter")
    sm.inc("hfsampler_windows_total")
    return MetricModel(
        inv.devices, {"g": (POWER, ENERGY, XID)}, sm, {"cluster": "eu1"}, hostname="node1", **kw
    )  # type: ignore[arg-type]


def _as_dict(snapshot) -> dict[tuple[str, str], float]:  # type: ignore[no-untyped-def]
    return {(s.name, dict(s.labels).get("gpu", "")): v for s, v in snapshot.items()}


def test_names_labels_and_siblings() -> None:
    model = _model()
    up = np.array([True, True])
    snap = model.snapshot(
        {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}, up, 2_500_000_000
    )
    assert snap.timestamp_ms == 2500
    values = _as_dict(snap)
    assert values[("DCGM_FI_DEV_POWER_USAGE", "0")] == 300
    assert values[("DCGM_FI_DEV_POWER_USAGE_min", "1")] == 309
    assert values[("DCGM_FI_DEV_POWER_USAGE_max", "1")] == 311
    assert values[("DCGM_FI_DEV_POWER_USAGE_p99", "0")] == 300.5
    assert values[("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "1")] == 6e9
    assert ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_max", "0") not in values
    assert values[("hfsampler_windows_total", "")] == 1
    series = next(s for s in snap.series if s.name == "DCGM_FI_DEV_POWER_USAGE")
    labels = dict(series.labels)
    assert labels["hostname"] == "node1"
    assert labels["cluster"] == "eu1"
    assert labels["device"] == "nvidia0"
    assert labels["modelName"] == "hfsampler sim H200"
    assert labels["UUID"].startswith("GPU-")
    assert labels["DCGM_FI_DRIVER_VERSION"] == "sim-1.0"
    assert labels["pci_bus_id"] == "00000000:18:00.0"


def test_series_are_interned_across_windows() -> None:
    model = _model()
    up = np.array([True, True])
    w = {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}
    a = model.snapshot(w, up, 1_000_000_000)
    b = model.snapshot(w, up, 2_000_000_000)
    assert [s.id for s in a.series] == [s.id for s in b.series]


def test_counters_carry_forward_gauges_go_stale_after_grace() -> None:
    model = _model(stale_after_windows=2)
    up = np.array([True, True])
    model.snapshot({"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}, up, 1)
    empty = {"g": _stats((POWER, ENERGY, XID), [[np.nan] * 3, [np.nan] * 3])}
    first = _as_dict(model.snapshot(empty, up, 2))
    assert first[("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "0")] == 5e9  # carried
    assert ("DCGM_FI_DEV_POWER_USAGE", "0") not in first  # no sample, still within grace
    second = model.snapshot(empty, up, 3)
    stale = {s.name for s, v in second.items() if is_stale(v)}
    assert "DCGM_FI_DEV_POWER_USAGE_max" in stale
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" not in stale


def test_lost_gpu_gets_stale_markers_once_and_shutdown_ends_everything() -> None:
    model = _model()
    w = {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}
    model.snapshot(w, np.array([True, True]), 1)
    lost = model.snapshot(w, np.array([True, False]), 2)
    stale = [(s.name, dict(s.labels)["gpu"]) for s, v in lost.items() if is_stale(v)]
    assert ("DCGM_FI_DEV_POWER_USAGE", "1") in stale
    assert all(gpu == "1" for _, gpu in stale)
    assert len(stale) == 9  # 4 power series + energy + xid + a refresh gauge per field
    again = model.snapshot(w, np.array([True, False]), 3)
    assert not any(is_stale(v) for _, v in again.items())
    final = model.final_snapshot(4)
    assert len(final) > 0
    assert all(is_stale(v) for _, v in final.items())


def test_a_reloaded_model_keeps_its_series_and_ends_the_others_in_its_first_window() -> None:
    """A reload that changes the labels and changes them back (a SIGHUP storm) between two
    windows: the series that came back keep their ids, so a writer keeps them on their shard,
    and nothing is stale-marked at the reload's own time, which may be after the window being
    reduced; series that really ended get their marker in the next window, at its time."""
    inv = SimSource(2).open([POWER, ENERGY, XID])
    sm = SelfMetrics()

    def model(dc: str, previous: MetricModel | None) -> MetricModel:
        return MetricModel(inv.devices, {"g": (POWER, ENERGY, XID)}, sm, {"dc": dc},
                           hostname="node1", previous=previous)  # fmt: skip

    w = {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}
    up = np.array([True, True])
    a = model("a", None)
    first = a.snapshot(w, up, 1_000_000_000)
    back = model("a", model("b", a))  # A -> B -> A before the next window
    again = back.snapshot(w, up, 2_000_000_000)
    assert not any(is_stale(v) for _, v in again.items())
    assert {s.id: s for s in again.series} == {s.id: s for s in first.series}
    b = model("b", back)
    moved = b.snapshot(w, up, 3_000_000_000)
    ended = [s for s, v in moved.items() if is_stale(v)]
    assert {s.id for s in ended} == {s.id for s in again.series}
    assert moved.timestamp_ms == 3000
    assert all(dict(s.labels)["dc"] == "b" for s, v in moved.items() if not is_stale(v))


def test_a_series_own_labels_win_over_external_labels() -> None:
    """``external_labels: {gpu: x, hostname: h}`` made every GPU's series one (the receiver
    kept one GPU); as in Prometheus, an external label only fills in a name a series lacks."""
    inv = SimSource(2).open([POWER, ENERGY, XID])
    sm = SelfMetrics()
    sm.define("hfsampler_gpu_up", "Up.", "gauge")
    sm.set("hfsampler_gpu_up", 1.0, {"gpu": "1"})
    external = {"gpu": "x", "hostname": "h", "cluster": "eu1"}
    model = MetricModel(inv.devices, {"g": (POWER, ENERGY, XID)}, sm, external, hostname="node1")
    w = {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}
    snap = model.snapshot(w, np.array([True, True]), 1_000_000_000)
    power = [dict(s.labels) for s in snap.series if s.name == "DCGM_FI_DEV_POWER_USAGE"]
    assert sorted(lb["gpu"] for lb in power) == ["0", "1"]
    assert {(lb["hostname"], lb["cluster"]) for lb in power} == {("node1", "eu1")}
    assert len({(s.name, s.labels) for s in snap.series}) == len(snap.series)  # none alike
    up = next(dict(s.labels) for s in snap.series if s.name == "hfsampler_gpu_up")
    assert (up["gpu"], up["hostname"], up["cluster"]) == ("1", "node1", "eu1")
    model.set_extra_labels([{"pod": "p0"}, {}])  # attribution relabels a GPU: still its own
    again = model.snapshot(w, np.array([True, True]), 2_000_000_000)
    text = exposition.render(again)
    assert 'gpu="0"' in text
    assert 'gpu="1"' in text
    assert 'gpu="x"' not in text


def test_page_serves_what_render_writes_and_keeps_only_live_series_text() -> None:
    """/metrics' page keeps each series' text across windows: a series whose labels changed (a
    pod came) is written with its new labels, never its old text."""
    model = _model(gpus=2)
    page = exposition.Page()
    assert page.body() == b""
    w = {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}
    for t, extra in enumerate(({}, {"pod": "p0"}, {"pod": "p1"})):
        model.set_extra_labels([extra, {}])
        snap = model.snapshot(w, np.array([True, True]), (t + 1) * 1_000_000_000)
        page.update(snap)
        assert page.body() == exposition.render(snap).encode()
        assert page.body() is page.body()  # rendered once
        assert gzip.decompress(page.gzipped()) == page.body()
    assert page.renders == 3
    assert b'pod="p1"' in page.body()
    assert b'pod="p0"' not in page.body()


@pytest.mark.parametrize(
    ("header", "takes"),
    [("gzip", True), ("gzip, deflate", True), ("GZIP;Q=0.5", True), ("*", True),
     ("br;q=1.0, gzip;q=0.8", True), ("", False), ("identity", False), ("deflate", False),
     ("gzip;q=0", False), ("*, gzip;q=0", False), ("gzip;q=0, *", False), ("gzip;q=x", False)],
)  # fmt: skip
def test_accepts_gzip(header: str, takes: bool) -> None:
    assert exposition.accepts_gzip(header) is takes


def test_exposition_text() -> None:
    model = _model(gpus=1)
    snap = model.snapshot(
        {"g": _stats((POWER, ENERGY, XID), [[300.25, 5e9, 43]])}, np.array([True]), 1
    )
    text = exposition.render(snap)
    assert "# TYPE DCGM_FI_DEV_POWER_USAGE gauge" in text
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter" in text
    assert "# HELP DCGM_FI_DEV_POWER_USAGE_max Power draw" in text
    line = next(x for x in text.splitlines() if x.startswith("DCGM_FI_DEV_POWER_USAGE{"))
    assert line.endswith(" 300.25")
    assert 'gpu="0"' in line
    assert 'cluster="eu1"' in line
    assert any(
        x.startswith("DCGM_FI_DEV_XID_ERRORS{") and x.endswith(" 43") for x in text.splitlines()
    )
    assert "hfsampler_windows_total{" in text
    assert exposition.render(None) == ""


def test_refresh_gauge_is_the_window_over_distinct_samples() -> None:
    from hfsampler.export.metrics import REFRESH_METRIC

    model = _model()
    w = {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}
    snap = model.snapshot(w, np.array([True, True]), 1)
    refresh = {
        (dict(s.labels)["field"], dict(s.labels)["gpu"]): v
        for s, v in snap.items()
        if s.name == REFRESH_METRIC
    }
    stats = w["g"]
    window_s = (stats.t1_ns - stats.t0_ns) / 1e9
    assert refresh[("DCGM_FI_DEV_POWER_USAGE", "0")] == window_s / stats.count[0, 0]
    assert len(refresh) == 6
    assert model.families[REFRESH_METRIC].type == "gauge"


def test_pod_churn_does_not_grow_the_registry() -> None:
    model = _model()
    up = np.array([True, True])
    w = {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}
    sizes = []
    seen_ids: set[int] = set()
    for k in range(20):
        model.set_extra_labels([{"pod": f"train-{k}"}, {}])
        snap = model.snapshot(w, up, k + 1)
        sizes.append(len(model.registry))
        pod_ids = {s.id for s, v in snap.items() if dict(s.labels).get("pod") and not is_stale(v)}
        assert pod_ids
        assert not pod_ids & seen_ids  # a new pod's series never reuse an old id
        seen_ids |= pod_ids
    assert sizes[-1] == sizes[2]  # bounded: each old pod's series are forgotten once staled
    pods = {dict(s.labels).get("pod") for s, v in snap.items() if not is_stale(v)}
    assert pods == {"train-19", None}


def _labels_of(model: MetricModel, name: str) -> list[dict[str, str]]:
    up = np.array([True, True])
    snap = model.snapshot(
        {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}, up, 2_500_000_000
    )
    return [dict(s.labels) for s in snap.series if s.name == name]


def test_instance_label_as_a_scrape_would_add_it() -> None:
    """dcgm-exporter's dashboards select on instance: every series, self-metrics too, has it."""
    for name in ("DCGM_FI_DEV_POWER_USAGE_max", "hfsampler_windows_total"):
        assert {lb["instance"] for lb in _labels_of(_model(), name)} == {"node1:9400"}
    assert {
        lb["instance"] for lb in _labels_of(_model(instance_port=9500), "hfsampler_windows_total")
    } == {"node1:9500"}
    custom = _labels_of(_model(instance="gpu17.fra1"), "DCGM_FI_DEV_POWER_USAGE")
    assert {lb["instance"] for lb in custom} == {"gpu17.fra1"}
    assert all(
        "instance" not in lb for lb in _labels_of(_model(instance=""), "DCGM_FI_DEV_POWER_USAGE")
    )


def test_host_label_name_is_chosen() -> None:
    """``hostname`` by default (dcgm-exporter 4.8.3 on); ``Hostname`` (4.8.2 and before) asked."""
    (default, _) = _labels_of(_model(), "DCGM_FI_DEV_POWER_USAGE")
    assert default["hostname"] == "node1"
    (first, _) = _labels_of(_model(host_label="Hostname"), "DCGM_FI_DEV_POWER_USAGE")
    assert first["Hostname"] == "node1"
    assert "hostname" not in first
    (selfm,) = _labels_of(_model(host_label="Hostname"), "hfsampler_windows_total")
    assert selfm["Hostname"] == "node1"
    assert "hostname" not in selfm


def test_per_instance_fields_are_one_series_each_with_their_label() -> None:
    """A field found several times on a device (a Jetson's rails) exports one series per
    instance, each with its own label beside the GPU's, its siblings and refresh gauge too."""
    from hfsampler.export.metrics import REFRESH_METRIC

    rail = fields.BY_NAME["hfsampler_jetson_rail_power_watts"]
    gpu_soc, cpu_cv = rail.instance("VDD_GPU_SOC"), rail.instance("VDD_CPU_CV")
    assert gpu_soc.labels == (("rail", "VDD_GPU_SOC"),)
    assert gpu_soc != cpu_cv
    inv = SimSource(1).open([POWER])
    model = MetricModel(inv.devices, {"g": (gpu_soc, cpu_cv)}, SelfMetrics(), hostname="n")
    snap = model.snapshot({"g": _stats((gpu_soc, cpu_cv), [[3.0, 4.5]])}, np.array([True]), 1)
    by_rail = {(s.name, dict(s.labels).get("rail")): v for s, v in snap.items()}
    assert by_rail[(rail.name, "VDD_GPU_SOC")] == 3.0
    assert by_rail[(rail.name + "_max", "VDD_CPU_CV")] == 5.5
    refresh = [s for s in snap.series if s.name == REFRESH_METRIC]
    assert sorted(dict(s.labels)["rail"] for s in refresh) == ["VDD_CPU_CV", "VDD_GPU_SOC"]
    assert len({s.id for s in snap.series}) == len(snap.series)  # no series twice
    # attribution labels swap the GPU's labels and keep the rail's
    model.set_extra_labels([{"pod": "p1"}])
    again = model.snapshot({"g": _stats((gpu_soc, cpu_cv), [[3.0, 4.5]])}, np.array([True]), 2)
    live = [dict(s.labels) for s, v in again.items() if s.name == rail.name and not is_stale(v)]
    assert sorted((d["pod"], d["rail"]) for d in live) == [
        ("p1", "VDD_CPU_CV"),
        ("p1", "VDD_GPU_SOC"),
    ]


def test_metrics_page_leaves_instance_to_the_scrape() -> None:
    """A scrape adds its own instance: one in the page would come back as exported_instance."""
    from hfsampler.export.exposition import render

    model = _model()
    up = np.array([True, True])
    snap = model.snapshot(
        {"g": _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])}, up, 2_500_000_000
    )
    assert any(dict(s.labels).get("instance") for s in snap.series)  # pushes carry it
    text = render(snap)
    assert "instance=" not in text
    assert 'hostname="node1"' in text


def test_a_statistic_the_window_lacks_is_left_out() -> None:
    """A recording made before a statistic existed replays without that statistic's series."""
    model = _model()
    w = _stats((POWER, ENERGY, XID), [[300, 5e9, 0], [310, 6e9, 0]])
    older = WindowStats(
        w.t0_ns, w.t1_ns, w.fields, {k: v for k, v in w.values.items() if k != "p99"}, w.count
    )
    values = _as_dict(model.snapshot({"g": older}, np.array([True, True]), 1))
    assert ("DCGM_FI_DEV_POWER_USAGE_p99", "0") not in values
    assert values[("DCGM_FI_DEV_POWER_USAGE_max", "0")] == 301
    assert values[("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "0")] == 5e9


def test_xid_counter_per_code_carries_the_gpu_labels_and_its_code() -> None:
    xids = fields.expand_xid((fields.BY_NAME["hfsampler_xid_events_total"],))
    inv = SimSource(2).open(xids)
    assert inv.supported.all()
    model = MetricModel(inv.devices, {"x": xids}, SelfMetrics(), hostname="node1")
    c79 = fields.XID_LABELS.index("79")
    counts = [[0.0] * len(xids), [0.0] * len(xids)]
    counts[1][c79] = 5.0  # a burst of five XID 79 on gpu 1 within the window
    snap = model.snapshot({"x": _stats(xids, counts)}, np.array([True, True]), 1)
    got = _as_dict_xid(snap)
    assert len(got) == 2 * len(fields.XID_LABELS)  # every code from the start, at 0
    assert got[("1", "79")] == 5.0
    assert got[("0", "79")] == 0.0
    s = next(s for s in snap.series if s.name == "hfsampler_xid_events_total")
    assert {"UUID", "hostname", "modelName", "xid"} <= dict(s.labels).keys()
    # a window without a fresh sample keeps the count: a counter never drops back
    empty = [[np.nan] * len(xids)] * 2
    again = _as_dict_xid(model.snapshot({"x": _stats(xids, empty)}, np.array([True, True]), 2))
    assert again[("1", "79")] == 5.0
    text = exposition.render(snap)
    assert "# TYPE hfsampler_xid_events_total counter" in text
    assert any('xid="79"' in x and x.endswith(" 5") for x in text.splitlines())


def _as_dict_xid(snapshot) -> dict[tuple[str, str], float]:  # type: ignore[no-untyped-def]
    return {
        (dict(s.labels)["gpu"], dict(s.labels)["xid"]): v
        for s, v in snapshot.items()
        if s.name == "hfsampler_xid_events_total"
    }


def test_a_gauge_never_sampled_on_a_gpu_is_no_series_there_not_even_stale() -> None:
    """A link down on GPU 1 from the start: its series never exists there, so no stale marker
    when GPU 0's ends or at shutdown; GPU 0's gets one."""
    tx = fields.BY_NAME["DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"].instance("17")
    inv = SimSource(2).open([POWER])
    model = MetricModel(inv.devices, {"g": (tx,)}, SelfMetrics(), hostname="n")
    up = np.array([True, True])
    names = lambda snap: {(s.name, dict(s.labels)["gpu"], is_stale(v)) for s, v in snap.items()  # noqa: E731
                          if s.name.startswith(tx.name)}  # fmt: skip
    first = names(model.snapshot({"g": _stats((tx,), [[2.0e9], [np.nan]])}, up, 1))
    assert {(n, g) for n, g, _ in first} == {(tx.name + s.suffix, "0") for s in STATS
                                             if s.exports(tx.kind)}  # fmt: skip
    ended = set()
    for t in range(2, 12):  # GPU 0's link goes quiet too: its series end after the grace
        ended |= names(model.snapshot({"g": _stats((tx,), [[np.nan], [np.nan]])}, up, t))
    assert {g for _, g, stale in ended if stale} == {"0"}
    assert not [s for s in model.final_snapshot(13).series if dict(s.labels)["gpu"] == "1"]

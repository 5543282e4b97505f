"""hfsampler's Grafana dashboards as code, with Grafana's typed builder (grafana-foundation-sdk).

Six dashboards over the series hfsampler pushes (dcgm-exporter names, ``_min``/``_max``/``_p99``
window siblings) and the recording rules in deploy/rules/: real-time status, history with the
min-max band, firing alerts, fleet distribution, MIG instances (memory and activity per
``GPU_I_ID`` / ``GPU_I_PROFILE``), and chargeback on shared GPUs (energy per namespace and per
Slurm job over the chosen range, top consumers, stranded capacity, from the consumer series).
The power distribution heatmaps (one GPU's on the history dashboard, each cluster's on the fleet
one) read ``DCGM_FI_DEV_POWER_USAGE_histogram``, the
native histogram of every distinct sample (``histograms: [DCGM_FI_DEV_POWER_USAGE]``).
``python deploy/grafana/build.py`` writes them to deploy/grafana/dashboards/*.json;
tests/test_deploy_grafana.py fails when the committed JSON and this file disagree, and
tests/integration/test_dashboards.py runs every panel's query against a real Prometheus fed by
hfsampler.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import (
    barchart,
    geomap,
    heatmap,
    prometheus,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

OUT = Path(__file__).resolve().parent / "dashboards"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
HOST_SEL = 'cluster=~"$cluster", hostname=~"$hostname", gpu=~"$gpu"'
# a GPU's own series: a MIG instance's (GPU_I_ID set, and device fields copied onto it with
# mig.copy_device_fields) are the instance dashboard's, never a second line for the same GPU
GPU_SEL = HOST_SEL + ', GPU_I_ID=""'
GPU_LEGEND = "{{hostname}} gpu {{gpu}}"
MEM_TOTAL = "(DCGM_FI_DEV_FB_USED{%s} + DCGM_FI_DEV_FB_FREE{%s} + DCGM_FI_DEV_FB_RESERVED{%s})"
POWER_HISTOGRAM = "DCGM_FI_DEV_POWER_USAGE_histogram"
HISTOGRAM_HELP = (
    "Every distinct sample of the driver's power reading, counted into Prometheus native "
    "histograms by hfsampler (histograms: [DCGM_FI_DEV_POWER_USAGE]; scraped in the protobuf "
    "format or pushed with send_native_histograms). Each cell is how many samples per second "
    "fell in that power bucket; buckets are about 9 % wide at the default 5 % error."
)


def query(
    expr: str, legend: str = "", ref: str = "A", instant: bool = False
) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).ref_id(ref).legend_format(legend or "__auto")
    return q.instant() if instant else q.range()


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=v, color=c) for v, c in steps])
    )


def variables(d: db.Dashboard, *, multi: bool = True) -> db.Dashboard:
    """Data source, then cluster → hostname → gpu, each narrowing the next."""
    d = d.with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    chain = [
        ("cluster", "label_values(DCGM_FI_DEV_POWER_USAGE, cluster)"),
        ("hostname", 'label_values(DCGM_FI_DEV_POWER_USAGE{cluster=~"$cluster"}, hostname)'),
        (
            "gpu",
            'label_values(DCGM_FI_DEV_POWER_USAGE{cluster=~"$cluster", '
            'hostname=~"$hostname"}, gpu)',
        ),
    ]
    for name, q in chain:
        v = (
            db.QueryVariable(name)
            .label(name)
            .datasource(DS)
            .query({"query": q, "refId": name})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.NUMERICAL_ASC)
        )
        # Host and GPU pick one at a time on the history dashboard (a min-max band per GPU)
        if multi or name == "cluster":
            v = v.multi(True).include_all(True).all_value(".*")
        d = d.with_variable(v)
    return d


def base(uid: str, title: str, description: str, time_from: str, refresh: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["hfsampler", "gpu"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .time(time_from, "now")
        .refresh(refresh)
        .timezone("browser")
    )


# -- 1. real-time status ------------------------------------------------------------------------


def status_stat(
    title: str, expr: str, unit: str, steps: list[tuple[float | None, str]], desc: str = ""
) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .with_target(query(expr, GPU_LEGEND, instant=True))
        .unit(unit)
        .thresholds(thresholds(*steps))
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.NONE)
        .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .height(6)
        .span(8)
    )


def realtime() -> db.Dashboard:
    s = GPU_SEL
    d = base(
        "hfsampler-realtime",
        "GPU real-time status (hfsampler)",
        "The latest 1 s window of every selected GPU: one value per GPU in each panel.",
        "now-15m",
        "5s",
    )
    d = variables(d)
    green = (None, "green")
    panels = [
        status_stat("Power, window mean", f"DCGM_FI_DEV_POWER_USAGE{{{s}}}", "watt",
                    [green, (500, "orange"), (650, "red")]),
        status_stat("Power, millisecond peak", f"DCGM_FI_DEV_POWER_USAGE_INSTANT_max{{{s}}}",
                    "watt", [green, (600, "orange"), (700, "red")],
                    "Highest 1 ms reading in the window: spikes a 15 s scrape never sees."),
        status_stat("Utilization", f"DCGM_FI_DEV_GPU_UTIL{{{s}}}", "percent",
                    [(None, "blue"), (20, "green")]),
        status_stat("Memory used, window peak",
                    f"DCGM_FI_DEV_FB_USED_max{{{s}}} / {MEM_TOTAL % (s, s, s)}", "percentunit",
                    [green, (0.85, "orange"), (0.95, "red")]),
        status_stat("Temperature, window max", f"DCGM_FI_DEV_GPU_TEMP_max{{{s}}}", "celsius",
                    [green, (80, "orange"), (85, "red")]),
        status_stat("Throttled (power + thermal), last 5 m",
                    f"(rate(DCGM_FI_DEV_POWER_VIOLATION{{{s}}}[5m])"
                    f" + rate(DCGM_FI_DEV_THERMAL_VIOLATION{{{s}}}[5m])) / 1e9",
                    "percentunit", [green, (0.05, "orange"), (0.2, "red")]),
        status_stat("Last XID", f"DCGM_FI_DEV_XID_ERRORS{{{s}}}", "none", [green, (1, "red")]),
        status_stat("NVML answers", 'hfsampler_gpu_up{hostname=~"$hostname", gpu=~"$gpu"}',
                    "bool_yes_no", [(None, "red"), (1, "green")]),
        status_stat("Correctable remapped rows", f"DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS{{{s}}}",
                    "none", [green, (1, "orange"), (64, "red")]),
    ]  # fmt: skip
    for p in panels:
        d = d.with_panel(p)
    return d


# -- 2. history with the min-max band -----------------------------------------------------------


def band(title: str, name: str, unit: str, span: str) -> timeseries.Panel:
    """mean, with the window min and max as a shaded band, downsampled without losing peaks."""
    s = 'cluster=~"$cluster", hostname=~"$hostname", gpu=~"$gpu"'
    return (
        timeseries.Panel()
        .title(f"{title}, {span}")
        .datasource(DS)
        .time_from(span)
        .with_target(query(f"max_over_time({name}_max{{{s}}}[$__interval])", "max", "A"))
        .with_target(query(f"avg_over_time({name}{{{s}}}[$__interval])", "mean", "B"))
        .with_target(query(f"min_over_time({name}_min{{{s}}}[$__interval])", "min", "C"))
        .unit(unit)
        .line_width(1)
        .fill_opacity(0)
        .override_by_name(
            "max",
            [
                dm.DynamicConfigValue(id_val="custom.fillBelowTo", value="min"),
                dm.DynamicConfigValue(id_val="custom.fillOpacity", value=20),
                dm.DynamicConfigValue(id_val="custom.lineWidth", value=0),
            ],
        )
        .override_by_name("min", [dm.DynamicConfigValue(id_val="custom.lineWidth", value=0)])
        .height(8)
        .span(6)
    )


def distribution_heatmap(title: str, expr: str, desc: str) -> heatmap.Panel:
    """A native histogram's buckets over time: Grafana draws each bucket of the query's
    histogram as a cell (no bucketing of its own)."""
    return (
        heatmap.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .with_target(query(expr).format(pm.PromQueryFormat.HEATMAP))
        .calculate(False)
        .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME)
               .scheme("Oranges").steps(64))
        .unit("watt")
        .height(9)
        .span(24)
    )  # fmt: skip


def history() -> db.Dashboard:
    d = base(
        "hfsampler-history",
        "GPU history (hfsampler)",
        "Trends of one GPU over 1 h, 24 h and 7 d: the window mean with the band between the "
        "lowest and highest millisecond sample of each step.",
        "now-24h",
        "1m",
    )
    d = variables(d, multi=False)
    d = d.with_panel(
        distribution_heatmap(
            "Power distribution, every sample",
            f"sum(rate({POWER_HISTOGRAM}{{{GPU_SEL}}}[$__rate_interval]))",
            HISTOGRAM_HELP,
        )
    )
    metrics = [
        ("Power", "DCGM_FI_DEV_POWER_USAGE_INSTANT", "watt"),
        ("Temperature", "DCGM_FI_DEV_GPU_TEMP", "celsius"),
        ("Utilization", "DCGM_FI_DEV_GPU_UTIL", "percent"),
        ("Memory used", "DCGM_FI_DEV_FB_USED", "decmbytes"),
    ]
    for span in ("1h", "24h", "7d"):
        d = d.with_row(db.Row(f"Last {span}"))
        for title, name, unit in metrics:
            d = d.with_panel(band(title, name, unit, span))
    return d


# -- 3. alerts ----------------------------------------------------------------------------------


def alerts() -> db.Dashboard:
    d = base(
        "hfsampler-alerts",
        "GPU alerts (hfsampler)",
        "Alerts from deploy/rules/ firing now, by severity (Prometheus's ALERTS series).",
        "now-6h",
        "30s",
    )
    d = d.with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    firing = 'ALERTS{alertstate="firing"}'
    d = d.with_panel(
        stat.Panel()
        .title("Firing, by severity")
        .datasource(DS)
        .with_target(query(f"count by (severity) ({firing})", "{{severity}}", instant=True))
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.NONE)
        .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
        .thresholds(thresholds((None, "green"), (1, "orange")))
        .override_by_name("critical", [dm.DynamicConfigValue("color", {"mode": "fixed",
                                                                       "fixedColor": "red"})])
        .height(5)
        .span(24)
    )  # fmt: skip
    d = d.with_panel(
        timeseries.Panel()
        .title("Firing over time, by severity")
        .datasource(DS)
        .with_target(query(f"count by (severity) ({firing})", "{{severity}}"))
        .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        .fill_opacity(30)
        .height(8)
        .span(24)
    )
    d = d.with_panel(
        table.Panel()
        .title("Firing alerts")
        .datasource(DS)
        .with_target(query(firing, instant=True).format(pm.PromQueryFormat.TABLE))
        .height(12)
        .span(24)
    )
    return d


# -- 4. fleet distribution ----------------------------------------------------------------------


def fleet_heatmap(title: str, expr: str, unit: str) -> heatmap.Panel:
    """Grafana buckets every GPU's value at each step: how the fleet spreads, not each GPU."""
    return (
        heatmap.Panel()
        .title(title)
        .datasource(DS)
        .with_target(query(expr, GPU_LEGEND))
        .calculate(True)
        .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME)
               .scheme("Oranges").steps(64))
        .unit(unit)
        .height(9)
        .span(12)
    )  # fmt: skip


def fleet_map() -> geomap.Panel:
    """GPUs per site, placed by the ``latitude`` / ``longitude`` external labels of each node."""
    expr = (
        "count by (datacenter, latitude, longitude) "
        '(DCGM_FI_DEV_POWER_USAGE{cluster=~"$cluster", GPU_I_ID=""})'
    )
    markers = (
        cb.MapLayerOptions()
        .type("markers")
        .name("GPUs per site")
        .location(
            cb.FrameGeometrySource()
            .mode(cm.FrameGeometrySourceMode.COORDS)
            .latitude("latitude")
            .longitude("longitude")
        )
        .config(
            {
                "showLegend": True,
                "style": {
                    "size": {"field": "Value", "fixed": 5, "min": 6, "max": 30},
                    "color": {"fixed": "dark-orange"},
                    "text": {"mode": "field", "field": "datacenter", "fixed": ""},
                    "textConfig": {"fontSize": 12, "offsetY": -18, "textAlign": "center"},
                },
            }
        )
        .tooltip(True)
    )
    # Label values are strings; the map needs numbers for its coordinates.
    to_numbers = dm.DataTransformerConfig(
        id_val="convertFieldType",
        options={
            "conversions": [
                {"targetField": "latitude", "destinationType": "number"},
                {"targetField": "longitude", "destinationType": "number"},
            ]
        },
    )
    return (
        geomap.Panel()
        .title("GPUs per site")
        .description(
            "Set external_labels {datacenter, latitude, longitude} on each node (see "
            "deploy/kubernetes/overlays/thanos/*/config.yml); marker size is the number of GPUs "
            "reporting."
        )
        .datasource(DS)
        .with_target(query(expr, "{{datacenter}}", instant=True).format(pm.PromQueryFormat.TABLE))
        .with_transformation(to_numbers)
        .view(geomap.MapViewConfig().id("zero").zoom(1))
        .layers([markers])
        .height(10)
        .span(24)
    )


def fleet() -> db.Dashboard:
    s = GPU_SEL
    d = base(
        "hfsampler-fleet",
        "GPU fleet distribution (hfsampler)",
        "Utilization and power across every selected GPU, and fleet totals from the recording "
        "rules in deploy/rules/.",
        "now-6h",
        "30s",
    )
    d = variables(d)
    fleet_stats = [
        ("GPUs reporting", 'cluster:gpus:count{cluster=~"$cluster"}', "none"),
        ("Fleet power", 'cluster:gpu_power_usage_watts:sum{cluster=~"$cluster"}', "watt"),
        ("Highest ms peak", 'cluster:gpu_power_peak_watts:max{cluster=~"$cluster"}', "watt"),
        ("Mean utilization", 'cluster:gpu_utilization_percent:avg{cluster=~"$cluster"}', "percent"),
    ]
    for title, expr, unit in fleet_stats:
        d = d.with_panel(
            stat.Panel()
            .title(title)
            .datasource(DS)
            .with_target(query(expr, "{{cluster}}", instant=True))
            .unit(unit)
            .graph_mode(cm.BigValueGraphMode.AREA)
            .height(4)
            .span(6)
        )
    d = d.with_panel(fleet_map())
    d = d.with_panel(
        fleet_heatmap("Utilization across GPUs", f"DCGM_FI_DEV_GPU_UTIL{{{s}}}", "percent")
    )
    d = d.with_panel(
        fleet_heatmap("Power (window mean) across GPUs", f"DCGM_FI_DEV_POWER_USAGE{{{s}}}", "watt")
    )
    quantiles: Callable[[str], list[prometheus.Dataquery]] = lambda name: [  # noqa: E731
        query(f"quantile by (cluster) ({q}, {name}{{{s}}})", f"{{{{cluster}}}} p{int(q * 100)}", r)
        for q, r in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ]
    for title, name, unit in (
        ("Utilization quantiles across GPUs", "DCGM_FI_DEV_GPU_UTIL", "percent"),
        ("Millisecond power peak quantiles across GPUs", "DCGM_FI_DEV_POWER_USAGE_INSTANT_max",
         "watt"),
    ):  # fmt: skip
        d = d.with_panel(
            timeseries.Panel().title(title).datasource(DS).targets(quantiles(name)).unit(unit)
            .height(8).span(12)
        )  # fmt: skip
    d = d.with_panel(
        distribution_heatmap(
            "Power distribution of $cluster, every sample of every GPU",
            f'sum(rate({POWER_HISTOGRAM}{{cluster=~"$cluster", GPU_I_ID=""}}[$__rate_interval]))',
            HISTOGRAM_HELP,
        ).repeat("cluster")
    )
    power_quantiles = [
        query(f'cluster:gpu_power_usage_watts:{name}{{cluster=~"$cluster"}}',
              f"{{{{cluster}}}} {label}", ref)
        for name, label, ref in (("p50_5m", "p50", "A"), ("p99_5m", "p99", "B"),
                                 ("p999_5m", "p99.9", "C"))
    ]  # fmt: skip
    d = d.with_panel(
        timeseries.Panel()
        .title("Fleet power quantiles, every sample over 5 m")
        .description(
            "From the recording rules on the power histograms: quantiles over every GPU's every "
            "distinct sample (a window's _p99 cannot be added up across GPUs or time)."
        )
        .datasource(DS)
        .targets(power_quantiles)
        .unit("watt")
        .height(8)
        .span(12)
    )
    d = d.with_panel(
        timeseries.Panel()
        .title("Throttled fraction, fleet mean")
        .datasource(DS)
        .with_target(query('cluster:gpu_throttled_ratio:avg5m{cluster=~"$cluster"}', "{{cluster}}"))
        .unit("percentunit")
        .height(8)
        .span(12)
    )
    d = d.with_panel(
        timeseries.Panel()
        .title("Top 10 GPUs by millisecond power peak")
        .datasource(DS)
        .with_target(query(f"topk(10, DCGM_FI_DEV_POWER_USAGE_INSTANT_max{{{s}}})", GPU_LEGEND))
        .unit("watt")
        .height(8)
        .span(12)
    )
    return d


# -- 5. MIG instances ---------------------------------------------------------------------------

MIG_SEL = HOST_SEL + ', GPU_I_ID!="", GPU_I_PROFILE=~"$GPU_I_PROFILE"'
MIG_LEGEND = "{{hostname}} gpu {{gpu}} / {{GPU_I_ID}} ({{GPU_I_PROFILE}})"


def instance_panel(title: str, expr: str, unit: str, desc: str) -> timeseries.Panel:
    return (
        timeseries.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .with_target(query(expr, MIG_LEGEND))
        .unit(unit)
        .line_width(1)
        .height(8)
        .span(12)
    )


def mig() -> db.Dashboard:
    s = MIG_SEL
    d = base(
        "hfsampler-mig",
        "MIG instances (hfsampler)",
        "Per MIG GPU instance (GPU_I_ID, GPU_I_PROFILE, as dcgm-exporter labels them): its own "
        "framebuffer and, on Hopper and newer, its activity from GPM. Power, clocks and "
        "temperature are the GPU's: see the real-time dashboard.",
        "now-1h",
        "10s",
    )
    d = variables(d)
    d = d.with_variable(
        db.QueryVariable("GPU_I_PROFILE")
        .label("profile")
        .datasource(DS)
        .query(
            {
                "query": 'label_values(DCGM_FI_DEV_FB_TOTAL{cluster=~"$cluster", '
                'hostname=~"$hostname", gpu=~"$gpu", GPU_I_ID!=""}, GPU_I_PROFILE)',
                "refId": "GPU_I_PROFILE",
            }
        )
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    d = d.with_panel(
        table.Panel()
        .title("Instances now")
        .description("Each GPU's MIG instances with their total framebuffer (MiB).")
        .datasource(DS)
        .with_target(
            query(f"DCGM_FI_DEV_FB_TOTAL{{{s}}}", MIG_LEGEND, instant=True).format(
                pm.PromQueryFormat.TABLE
            )
        )
        .height(8)
        .span(24)
    )
    panels = [
        ("Memory used", f"DCGM_FI_DEV_FB_USED{{{s}}}", "decmbytes",
         "The window mean of the instance's framebuffer in use."),
        ("Memory used, window peak", f"DCGM_FI_DEV_FB_USED_max{{{s}}}", "decmbytes",
         "The highest millisecond sample of each window: what an OOM is judged by."),
        ("Memory used / instance total",
         f"DCGM_FI_DEV_FB_USED_max{{{s}}} / DCGM_FI_DEV_FB_TOTAL{{{s}}}", "percentunit",
         "The window peak over the instance's own framebuffer."),
        ("SM active", f"DCGM_FI_PROF_SM_ACTIVE{{{s}}}", "percentunit",
         "GPM per instance (nvmlGpmMigSampleGet), Hopper and newer."),
        ("Tensor pipe active", f"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{s}}}", "percentunit",
         "GPM per instance, Hopper and newer."),
        ("DRAM active", f"DCGM_FI_PROF_DRAM_ACTIVE{{{s}}}", "percentunit",
         "GPM per instance, Hopper and newer."),
    ]  # fmt: skip
    for title, expr, unit, desc in panels:
        d = d.with_panel(instance_panel(title, expr, unit, desc))
    return d


# -- 6. chargeback on shared GPUs ---------------------------------------------------------------

ENERGY = "hfsampler_consumer_energy_joules_total"
UNATTRIBUTED = "hfsampler_gpu_unattributed_energy_joules_total"
CONSUMER_SEL = 'cluster=~"$cluster"'
J_PER_KWH = 3.6e6
# every label that names a consumer (export/consumer_series.py, consumers/identity.py, CRI names)
CONSUMER_LABELS = "namespace, pod, container, hpc_job, systemd_unit, uid, command, consumer"
CHARGEBACK_HELP = (
    "Each window's GPU energy, from the millisecond power, split among the processes' consumers "
    "by their share of the SMs (hfsampler_consumer_energy_joules_total); what no consumer drew "
    "is unattributed. Consumers and unattributed add up to the GPUs' energy over the range."
)


def energy_in_range(by: str, where: str = "") -> str:
    """kWh each ``by`` group drew over the dashboard's time range."""
    sel = CONSUMER_SEL + (f", {where}" if where else "")
    return f"sort_desc(sum by ({by}) (increase({ENERGY}{{{sel}}}[$__range]))) / {J_PER_KWH:g}"


def energy_table(title: str, by: str, where: str) -> table.Panel:
    return (
        table.Panel()
        .title(title)
        .description(CHARGEBACK_HELP)
        .datasource(DS)
        .with_target(
            query(energy_in_range(by, where), instant=True).format(pm.PromQueryFormat.TABLE)
        )
        .unit("kwatth")
        .height(10)
        .span(12)
    )


def energy_bars(title: str, by: str, where: str) -> barchart.Panel:
    return (
        barchart.Panel()
        .title(title)
        .description(CHARGEBACK_HELP)
        .datasource(DS)
        .with_target(
            query(energy_in_range(by, where), instant=True).format(pm.PromQueryFormat.TABLE)
        )
        .x_field(by)
        .orientation(cm.VizOrientation.HORIZONTAL)
        .unit("kwatth")
        .height(10)
        .span(12)
    )


def chargeback() -> db.Dashboard:
    d = base(
        "hfsampler-chargeback",
        "GPU chargeback (hfsampler)",
        "Who used the shared GPUs and the energy each drew over the chosen time range: per "
        "Kubernetes namespace and per Slurm job, the top consumers, and GPUs held but idle "
        "(stranded capacity). " + CHARGEBACK_HELP,
        "now-24h",
        "1m",
    )
    d = d.with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    d = d.with_variable(
        db.QueryVariable("cluster")
        .label("cluster")
        .datasource(DS)
        .query({"query": f"label_values({ENERGY}, cluster)", "refId": "cluster"})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    totals = [
        ("Energy drawn by consumers", f"sum(increase({ENERGY}{{{CONSUMER_SEL}}}[$__range]))"),
        ("Unattributed energy (no consumer using the SMs)",
         f"sum(increase({UNATTRIBUTED}{{{CONSUMER_SEL}}}[$__range]))"),
    ]  # fmt: skip
    for title, expr in totals:
        d = d.with_panel(
            stat.Panel()
            .title(title)
            .description(CHARGEBACK_HELP)
            .datasource(DS)
            .with_target(query(f"{expr} / {J_PER_KWH:g}", instant=True))
            .unit("kwatth")
            .graph_mode(cm.BigValueGraphMode.NONE)
            .height(4)
            .span(12)
        )
    d = d.with_panel(energy_table("Energy per namespace", "namespace", 'namespace!=""'))
    d = d.with_panel(energy_bars("Energy per namespace", "namespace", 'namespace!=""'))
    d = d.with_panel(energy_table("Energy per Slurm job", "hpc_job", 'hpc_job!=""'))
    d = d.with_panel(energy_bars("Energy per Slurm job", "hpc_job", 'hpc_job!=""'))
    top = (f"topk(20, sum by (hostname, gpu, {CONSUMER_LABELS}) "
           f"(increase({ENERGY}{{{CONSUMER_SEL}}}[$__range]))) / {J_PER_KWH:g}")  # fmt: skip
    d = d.with_panel(
        table.Panel()
        .title("Top consumers")
        .description(
            "The 20 consumers (pod's container, job, unit, user's command) that drew "
            "the most energy over the range, per GPU."
        )
        .datasource(DS)
        .with_target(query(top, instant=True).format(pm.PromQueryFormat.TABLE))
        .unit("kwatth")
        .height(10)
        .span(24)
    )
    power = [
        query(f"namespace:gpu_power_watts:rate5m{{{CONSUMER_SEL}}}", "{{namespace}}", "A"),
        query(f"hpc_job:gpu_power_watts:rate5m{{{CONSUMER_SEL}}}", "job {{hpc_job}}", "B"),
    ]
    d = d.with_panel(
        timeseries.Panel()
        .title("Power per namespace and per job")
        .description(
            "From the chargeback recording rules: the energy each drew per second, over 5 m."
        )
        .datasource(DS)
        .targets(power)
        .unit("watt")
        .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        .fill_opacity(20)
        .height(8)
        .span(24)
    )
    held = f'{{{CONSUMER_SEL}, consumer!="other"}}'
    stranded = (
        f"min_over_time(hfsampler_consumer_memory_used_bytes{held}[$__range]) > 0 "
        f"and max_over_time(hfsampler_consumer_sm_utilization_ratio{held}[$__range]) < 0.01"
    )
    d = d.with_panel(
        table.Panel()
        .title("Stranded capacity: GPUs held but idle over the range")
        .description(
            "Consumers that held GPU memory in every window of the range they were present in "
            "and never used 1 % of the SMs: capacity a scheduler could reclaim. The value is the "
            "least memory they held. The alert GPUCapacityStranded fires for those idle a whole "
            "hour (consumer:gpu_memory_stranded_bytes:min1h)."
        )
        .datasource(DS)
        .with_target(query(stranded, instant=True).format(pm.PromQueryFormat.TABLE))
        .unit("bytes")
        .height(10)
        .span(24)
    )
    return d


DASHBOARDS: dict[str, Callable[[], db.Dashboard]] = {
    "hfsampler-realtime": realtime,
    "hfsampler-history": history,
    "hfsampler-alerts": alerts,
    "hfsampler-fleet": fleet,
    "hfsampler-mig": mig,
    "hfsampler-chargeback": chargeback,
}


def render() -> dict[str, str]:
    """File name → JSON text of every dashboard."""
    return {
        f"{name}.json": json.dumps(make().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
        for name, make in DASHBOARDS.items()
    }


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else OUT
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Every Grafana dashboard panel's query runs against a real Prometheus fed by hfsampler.

One Prometheus per version (2.x and 3.x: the harness in ``receivers.py``) loads deploy/rules/
with a 1 s evaluation interval, one short pair of ``hfsampler run --source sim`` pushes into all
of them at once (and one of them serves its power histograms on /metrics, which they scrape with
native histograms on: the distribution panels' data) while consumer series of shared GPUs are
pushed beside them (the chargeback dashboard's data: hfsampler's own ``ConsumerSeries`` of each
window's ``split``, until `run` exports them itself); then each dashboard's variables are filled
from the label values Prometheus holds, as Grafana would, and every target runs through the HTTP
API (instant or range, as the panel asks). A query error or an empty result fails the
test: a dashboard whose panels say "No data" on a working setup is broken.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import receivers as rx

from hfsampler.consumers.identity import Consumer, Kind
from hfsampler.consumers.split import WindowUse, split
from hfsampler.export.consumer_series import ConsumerSeries
from hfsampler.series import SeriesRegistry

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
STEP_S = 2


@dataclass
class RulesPrometheus(rx.Prometheus):
    """The harness's Prometheus with deploy/rules/ evaluated every second, native histograms on,
    scraping the histograms of the feed's /metrics (the power distribution panels')."""

    # hfsampler ends its series with stale markers on exit: query while they were live
    live_until_s: float = 0.0


def _start(receivers_root: Path, build: rx.PrometheusBuild, feed: str) -> RulesPrometheus:
    root = receivers_root / f"{build.name}-dashboards"
    root.mkdir(parents=True, exist_ok=True)
    # only the histograms: the floats come pushed, and must not be there twice
    histograms = {"source_labels": ["__name__"], "regex": ".*_histogram", "action": "keep"}
    prom = RulesPrometheus(
        name=f"{build.name}-dashboards",
        port=rx.free_port(),
        data_dir=root,
        log_path=root / "prometheus.log",
        binary=build.binary,
        rule_files=rx.fast_rules(root),
        extra_flags=[rx.NATIVE_HISTOGRAMS_FLAG],
        scrape_configs=[
            {
                "job_name": "hfsampler-histograms",
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "static_configs": [{"targets": [feed]}],
                "metric_relabel_configs": [histograms],
            }
        ],
    )
    prom.start()
    return prom


# Two shared sim GPUs: on gpu 0 a pod of namespace ml (60 % of the SMs), Slurm job 4242 (20 %)
# and a notebook pod that holds memory and never computes (stranded); gpu 1 is the job's alone.
TRAINER = Consumer(Kind.POD, pod_uid="0f9a5b2c-1d3e-4f60-8a7b-9c0d1e2f3a4b", container_id="3f" * 32)
NOTEBOOK = Consumer(
    Kind.POD, pod_uid="5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9", container_id="a1" * 32
)
JOB = Consumer(Kind.HPC_JOB, hpc_job="4242")
CRI_NAMES = {TRAINER: ("ml", "trainer-0", "train"), NOTEBOOK: ("ml", "notebook-0", "jupyter")}


def _names(consumer: Consumer) -> dict[str, str]:
    """A consumer's labels with the names a CRI socket gives a pod's container."""
    names = CRI_NAMES.get(consumer)
    if names is None:
        return consumer.labels()
    return {**consumer.labels(), **dict(zip(("namespace", "pod", "container"), names, strict=True))}


def _feed_consumers(urls: Sequence[str], stop: threading.Event) -> None:
    """Each second, a window of the two GPUs' consumer series pushed to every Prometheus, as
    `run` pushes them, until ``stop``."""
    registry = SeriesRegistry()
    out = ConsumerSeries(registry, {"cluster": "ci", "datacenter": "fra1", "feed": "consumers"})
    pids = {10: TRAINER, 11: JOB, 12: NOTEBOOK, 20: JOB}
    gpu = {"device": "nvidia0", "modelName": "sim", "hostname": "shared-node"}
    while not stop.is_set():
        now_us = time.time_ns() // 1000
        zero = WindowUse.of(300.0, [(10, now_us, 60.0), (11, now_us, 20.0), (12, now_us, 0.0)],
                            [(10, 1, 8e9), (11, 1, 4e9), (12, 1, 10e9)])  # fmt: skip
        one = WindowUse.of(200.0, [(20, now_us, 90.0)], [(20, 1, 30e9)])
        rows = [({**gpu, "gpu": "0", "UUID": "GPU-shared-0"}, split(zero, pids)),
                ({**gpu, "gpu": "1", "UUID": "GPU-shared-1", "device": "nvidia1"},
                 split(one, pids))]  # fmt: skip
        series, values = out.window(rows, _names)
        body = rx.encode_write_request(
            (s.name, dict(s.labels), [(now_us // 1000, v)])
            for s, v in zip(series, values, strict=True)
        )
        for url in urls:
            status, text = rx.push(url, body)
            assert status < 300, text
        stop.wait(1.0)


def _wait_for_histograms(feed: str, proc: Any, log: Path, timeout_s: float = 60.0) -> None:
    """Until ``feed``'s /metrics serves the power histograms (its first windows' page)."""
    accept = (
        "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            request = urllib.request.Request(f"http://{feed}/metrics", headers={"Accept": accept})
            with urllib.request.urlopen(request, timeout=5) as resp:
                if b"DCGM_FI_DEV_POWER_USAGE_histogram" in resp.read():
                    return
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    pytest.fail(f"no histograms on {feed}/metrics in {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def fed_prometheuses(
    receivers_root: Path, prometheus_builds_here: dict[str, rx.PrometheusBuild]
) -> Iterator[dict[str, RulesPrometheus]]:
    """Every version's Prometheus with the rules, by build name, fed by the same two runs."""
    proms: dict[str, RulesPrometheus] = {}
    feed = f"127.0.0.1:{rx.free_port()}"
    try:
        for name, build in prometheus_builds_here.items():
            proms[name] = _start(receivers_root, build, feed)
        urls = [prom.write_url for prom in proms.values()]
        logs = receivers_root / "dashboards-feed"
        logs.mkdir(parents=True, exist_ok=True)
        # the plain run's power histograms, scraped from its /metrics
        config = logs / "histograms.yml"
        config.write_text("histograms: [DCGM_FI_DEV_POWER_USAGE]\n")
        # a site's coordinates as external labels place it on the fleet dashboard's map
        site = {"cluster": "ci", "datacenter": "fra1", "latitude": "50.11", "longitude": "8.68"}
        # MIG instances on every sim GPU of one run feed the instance view (and must not disturb
        # the rest); a GPU in MIG mode has no utilization (NVML refuses it), so a second run
        # beside it, without MIG, feeds the GPU panels that show it
        stop = threading.Event()
        consumers = threading.Thread(target=_feed_consumers, args=(urls, stop), daemon=True)
        consumers.start()
        # the plain run lasts until the MIG run is done, and that starts once the plain run's
        # /metrics serves its histograms: the panels are asked while both feeds are live, and
        # the histograms' rate() has scrapes behind it by then however slowly either started
        plain = rx.spawn_cli(
            rx.sim_run_args(urls, listen=feed, gpus=3, duration="60s",
                            labels={**site, "feed": "plain"}, extra=["--config", str(config)]),
            logs / "plain.log",
        )  # fmt: skip
        try:
            _wait_for_histograms(feed, plain, logs / "plain.log")
            args = rx.sim_run_args(
                urls, listen="", gpus=3, duration="8s",
                labels={**site, "feed": "mig"}, extra=["--sim-mig", "3g,2g,1g,1g"],
            )  # fmt: skip
            run = rx.run_cli(args, timeout_s=60).check()
            assert rx.stop_cli(plain) == 0, (logs / "plain.log").read_text()
        finally:
            rx.stop_cli(plain)
            stop.set()
            consumers.join(timeout=10)
        for prom in proms.values():
            prom.live_until_s = run.ended_ns / 1e9 - 3
            # the recording rules and the always-firing Watchdog need an evaluation after the data
            at = prom.live_until_s
            prom.wait_for("cluster:gpus:count", timeout_s=15, time_s=at)
            prom.wait_for("cluster:gpu_power_usage_watts:p99_5m", timeout_s=15, time_s=at)
            prom.wait_for('ALERTS{alertstate="firing"}', timeout_s=15, time_s=at)
            prom.wait_for("namespace:gpu_power_watts:rate5m", timeout_s=15, time_s=at)
        yield proms
    finally:
        for prom in proms.values():
            prom.stop()


@pytest.fixture(scope="module")
def fed_prometheus(
    fed_prometheuses: dict[str, RulesPrometheus], prometheus_build: rx.PrometheusBuild
) -> RulesPrometheus:
    """Prometheus 2.x, then 3.x, with the rules and the two runs' data."""
    return fed_prometheuses[prometheus_build.name]


def _dashboards() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def _fill(expr: str, values: dict[str, str]) -> str:
    """Substitute ``$var`` / ``${var}`` and Grafana's own interval variables."""
    builtins = {"__interval": f"{STEP_S}s", "__rate_interval": "1m", "__range": "1m"}
    merged = {**builtins, **values}
    return re.sub(
        r"\$\{?(\w+)\}?",
        lambda m: merged.get(m.group(1), m.group(0)),
        expr,
    )


def _variable_values(prom: rx.Prometheus, dash: dict[str, Any]) -> dict[str, str]:
    """Each query variable's first value, resolved in order as Grafana chains them."""
    values: dict[str, str] = {}
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
        assert m, f"{dash['uid']}: variable {var['name']} is not label_values(): {q}"
        selector, label = _fill(m.group(1), values), m.group(2)
        found = prom.api(f"/api/v1/label/{label}/values", {"match[]": selector})["data"]
        assert found, f"{dash['uid']}: variable {var['name']} has no values for {selector}"
        values[var["name"]] = sorted(found)[0]
    return values


@pytest.mark.parametrize("path", _dashboards(), ids=lambda p: p.stem)
def test_every_panel_query_returns_data(fed_prometheus: RulesPrometheus, path: Path) -> None:
    dash = json.loads(path.read_text())
    values = _variable_values(fed_prometheus, dash)
    now = fed_prometheus.live_until_s
    checked, problems = 0, []
    for panel in _panels(dash):
        for target in panel.get("targets", []):
            expr = _fill(target["expr"], values)
            assert "$" not in expr, f"unfilled variable in {expr}"
            try:
                if target.get("instant"):
                    result = fed_prometheus.query(expr, time_s=now)
                else:
                    result = fed_prometheus.query_range(expr, now - 60, now, STEP_S)
            except rx.ReceiverError as exc:
                problems.append(f"{panel['title']!r}: {expr}: {exc}")
                continue
            checked += 1
            if not result:
                problems.append(f"{panel['title']!r}: {expr}: empty result")
    assert checked, f"{path.name} has no queries"
    assert not problems, "\n".join(problems)


def test_instance_view_shows_each_instance(fed_prometheus: RulesPrometheus) -> None:
    """The MIG dashboard's memory panel has one series per instance, by GPU_I_ID and profile."""
    dash = json.loads((DASHBOARDS / "hfsampler-mig.json").read_text())
    values = _variable_values(fed_prometheus, dash)
    values.update(gpu=".*", GPU_I_PROFILE=".*", hostname=".*", cluster=".*")
    (panel,) = [p for p in _panels(dash) if p["title"] == "Memory used"]
    expr = _fill(panel["targets"][0]["expr"], values)
    rows = fed_prometheus.query(expr, time_s=fed_prometheus.live_until_s)
    got = sorted((r["metric"]["gpu"], r["metric"]["GPU_I_ID"], r["metric"]["GPU_I_PROFILE"])
                 for r in rows)  # fmt: skip
    layout = [("1", "3g.71gb"), ("3", "2g.35gb"), ("7", "1g.18gb"), ("8", "1g.18gb")]
    assert got == sorted((g, gi, p) for g in ("0", "1", "2") for gi, p in layout)
    gpu_level = fed_prometheus.query(
        'DCGM_FI_DEV_POWER_USAGE{GPU_I_ID!=""}', time_s=fed_prometheus.live_until_s
    )
    assert gpu_level == []  # power stays the GPU's (mig.copy_device_fields is off)


def test_fleet_map_places_each_site(fed_prometheus: RulesPrometheus) -> None:
    """The geomap panel's rows carry the coordinates it plots, one row per site, GPUs counted."""
    dash = json.loads((DASHBOARDS / "hfsampler-fleet.json").read_text())
    (panel,) = [p for p in _panels(dash) if p["type"] == "geomap"]
    (layer,) = panel["options"]["layers"]
    location = layer["location"]
    assert (location["mode"], location["latitude"], location["longitude"]) == (
        "coords",
        "latitude",
        "longitude",
    )
    (target,) = panel["targets"]
    expr = _fill(target["expr"], _variable_values(fed_prometheus, dash))
    (row,) = fed_prometheus.query(expr, time_s=fed_prometheus.live_until_s)
    assert row["metric"] == {"datacenter": "fra1", "latitude": "50.11", "longitude": "8.68"}
    assert float(row["value"][1]) == 6  # two feeds of 3 GPUs each (with and without MIG)

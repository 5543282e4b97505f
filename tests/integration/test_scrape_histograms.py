"""Real Prometheus (2.42 and 3, native histograms on) scrapes hfsampler's /metrics on the fake
NVML, and takes the same run's Remote-Write push, and stores the histograms exactly as counted.

One hfsampler run per version (`run --source nvml` on two fake GPUs, `histograms:
[DCGM_FI_DEV_POWER_USAGE]`), scraped every second by a Prometheus with deploy/rules/, while the
test reads the same /metrics in the protobuf format itself. Then, through Prometheus's query
API: every stored histogram's count is one the test saw served (nothing lost or changed on the
way), ``histogram_count`` is the last one, and ``histogram_quantile`` over both GPUs, by query
and by the recording rules, lands in the bucket of the fake's exact quantile, within the schema's
error. The same run pushes to the same Prometheus with ``send_native_histograms`` (Remote-Write
2.0 to Prometheus 3, 1.0 to 2.42), told apart from the scraped series by having no ``job``:
every count served was pushed too, and the pushed quantiles are the scraped ones.
The fake's driver power moves among five levels (300 to 304 W, a GPU's index in mW above)
every 100 ms, so a GPU has ten distinct samples a second.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import receivers as rx
from google.protobuf.internal.decoder import _DecodeVarint

from hfsampler.export.exposition_pb import metrics_pb2
from hfsampler.export.exposition_proto import CONTENT_TYPE
from hfsampler.histograms import bucket_indices, quantile_error_bound
from hfsampler.remote_write.config import PROTOBUF_V1, PROTOBUF_V2

pytestmark = pytest.mark.integration

NAME = "DCGM_FI_DEV_POWER_USAGE_histogram"
RUN_S = 12
ACCEPT = (
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited"
)


def _served_counts(url: str) -> dict[str, int]:
    """The histograms' counts by GPU on one protobuf page of hfsampler's /metrics."""
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.headers["Content-Type"] == CONTENT_TYPE
        page = resp.read()
    out, at = {}, 0
    while at < len(page):
        size, at = _DecodeVarint(page, at)
        family = metrics_pb2.MetricFamily.FromString(page[at : at + size])
        at += size
        if family.name == NAME:
            for m in family.metric:
                gpu = next(p.value for p in m.label if p.name == "gpu")
                out[gpu] = m.histogram.sample_count
    return out


class Fed:
    """One version's Prometheus after the run: what it stored, and what the run served."""

    def __init__(self, prom: rx.Prometheus, served: dict[str, set[int]], end_s: float) -> None:
        self.prom = prom
        self.served = served
        self.end_s = end_s


@pytest.fixture(scope="module")
def fed(receivers_root: Path, prometheus_build: rx.PrometheusBuild) -> Iterator[Fed]:
    root = receivers_root / f"{prometheus_build.name}-scrape-histograms"
    root.mkdir(parents=True, exist_ok=True)
    listen = f"127.0.0.1:{rx.free_port()}"
    prom = rx.start_prometheus(
        root,
        [{"job_name": "hfsampler", "scrape_interval": "1s", "scrape_timeout": "1s",
          "static_configs": [{"targets": [listen]}]}],
        name=f"{prometheus_build.name}-scrape-histograms",
        binary=prometheus_build.binary,
        extra_flags=[rx.NATIVE_HISTOGRAMS_FLAG],
        rule_files=rx.fast_rules(root),
    )  # fmt: skip
    config = root / "hfsampler.yml"
    protocol = PROTOBUF_V2 if prometheus_build.major >= 3 else PROTOBUF_V1
    config.write_text(
        "histograms: [DCGM_FI_DEV_POWER_USAGE]\nexternal_labels: {cluster: it}\n"
        f"remote_write:\n  - url: {prom.write_url}\n    send_native_histograms: true\n"
        f"    protobuf_message: {protocol}\n    queue_config: {{batch_send_deadline: 1s}}\n"
    )
    args = ["run", "--source", "nvml", "--config", str(config), "--listen", listen,
            "--duration", f"{RUN_S}s"]  # fmt: skip
    proc = rx.spawn_cli(args, root / "hfsampler.log", env=rx.fake_nvml_env({"gpus": 2}))
    served: dict[str, set[int]] = {"0": set(), "1": set()}
    try:
        while proc.poll() is None:  # every window's page: several reads a window
            try:
                for gpu, count in _served_counts(f"http://{listen}/metrics").items():
                    served[gpu].add(count)
            except OSError:
                pass  # not listening yet, or gone
            time.sleep(0.2)
        assert proc.returncode == 0, (root / "hfsampler.log").read_text()[-3000:]
        yield Fed(prom, served, time.time())
    finally:
        rx.stop_cli(proc)
        prom.stop()


SCRAPED = f'{NAME}{{job="hfsampler"}}'
PUSHED = f'{NAME}{{job=""}}'


def _stored(fed: Fed, selector: str = SCRAPED) -> dict[str, list[tuple[float, int]]]:
    """Every stored histogram sample's time and count, by GPU."""
    rows = fed.prom.query(f"{selector}[1m]", time_s=fed.end_s)
    return {
        r["metric"]["gpu"]: [(float(ts), int(h["count"])) for ts, h in r["histograms"]]
        for r in rows
    }


def test_every_stored_histogram_is_one_that_was_served(fed: Fed) -> None:
    stored = _stored(fed)
    assert sorted(stored) == ["0", "1"]
    # a window's count, as the test's polls saw it served or as the push (every window) holds it:
    # a loaded machine can delay a poll past a window that Prometheus's scrape caught
    windows = {gpu: {c for _, c in samples} for gpu, samples in _stored(fed, PUSHED).items()}
    for gpu, samples in stored.items():
        counts = [c for _, c in samples]
        assert len(counts) >= RUN_S // 2, counts
        assert counts == sorted(counts)  # cumulative: never a reset within a run
        seen = fed.served[gpu] | windows.get(gpu, set())
        assert set(counts) <= seen  # each exactly as hfsampler counted it
        # ten distinct samples a second (the fake's 100 ms refresh), every one counted
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        assert abs((c1 - c0) / (t1 - t0) - 10) < 2


def test_histogram_count_is_the_number_of_distinct_samples(fed: Fed) -> None:
    for gpu, samples in _stored(fed).items():
        last_s, last = samples[-1]
        (row,) = fed.prom.query(
            f'histogram_count({NAME}{{job="hfsampler",gpu="{gpu}"}})', time_s=last_s
        )
        assert int(float(row["value"][1])) == last
        (labels,) = fed.prom.series(
            f'{NAME}{{job="hfsampler",gpu="{gpu}"}}', fed.end_s - 60, fed.end_s
        )
        assert labels["cluster"] == "it"  # the floats' labels; the scrape adds instance


def test_every_served_histogram_was_pushed(fed: Fed) -> None:
    """The push holds every window, the test's polls of /metrics only those it caught (not the
    last, pushed at shutdown after /metrics closed, nor one a slow poll missed): whatever was
    served was pushed, as counted."""
    pushed = _stored(fed, PUSHED)
    assert sorted(pushed) == ["0", "1"]
    for gpu, samples in pushed.items():
        counts = [c for _, c in samples]
        assert len(counts) >= RUN_S // 2, counts  # one a window
        assert counts == sorted(counts)
        assert fed.served[gpu] - {0} <= set(counts), (sorted(fed.served[gpu]), counts)
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        assert abs((c1 - c0) / (t1 - t0) - 10) < 2


def _exact(q: float) -> float:
    """The fake's quantile over both GPUs: five levels equally often, GPU i i mW above."""
    levels = [300.0 + k + i / 1000 for k in range(5) for i in range(2)]
    return float(np.quantile(np.repeat(levels, 1000), q))


@pytest.mark.parametrize("q", [0.5, 0.99, 0.999])
def test_quantiles_across_gpus_are_the_exact_ones_within_the_schemas_error(
    fed: Fed, q: float
) -> None:
    last_s = max(s[-1][0] for s in _stored(fed).values())
    (row,) = fed.prom.query(f"histogram_quantile({q}, sum(increase({SCRAPED}[1m])))", time_s=last_s)
    got, exact = float(row["value"][1]), _exact(q)
    assert not math.isnan(got)
    assert abs(got - exact) <= quantile_error_bound(3) * exact
    at = np.array([got, exact])
    assert bucket_indices(at, 3)[0] == bucket_indices(at, 3)[1]  # the exact one's bucket
    name = {0.5: "p50", 0.99: "p99", 0.999: "p999"}[q]
    name = f"cluster:gpu_power_usage_watts:{name}_5m"
    rows = fed.prom.wait_for(f'{name}{{cluster="it"}}', time_s=last_s)
    assert len(rows) == 1, name
    recorded = float(rows[0]["value"][1])
    assert abs(recorded - exact) <= quantile_error_bound(3) * exact
    # pushed: the same samples, so the same bucket as the scrape's (whose windows it may cut
    # a little differently: the push holds whole windows, a scrape whatever page it found)
    last_s = max(s[-1][0] for s in _stored(fed, PUSHED).values())
    query = f"histogram_quantile({q}, sum(increase({PUSHED}[1m])))"
    (row,) = fed.prom.query(query, time_s=last_s)
    pushed = float(row["value"][1])
    assert abs(pushed - exact) <= quantile_error_bound(3) * exact
    assert bucket_indices(np.array([pushed]), 3)[0] == bucket_indices(np.array([exact]), 3)[0]

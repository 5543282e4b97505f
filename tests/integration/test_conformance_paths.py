"""Every path by which series leave hfsampler, against the strict conformance receiver.

``tests/support/conformance.py`` refuses what the Remote-Write spec, Thanos Receive or Mimir refuse
(label order, duplicates, limits, sample order across requests, timestamps, headers); Prometheus
and VictoriaMetrics would repair most of it silently. Each path must reach it with zero
violations: ``run`` with external labels, ``--label``, job attribution that changes mid-run and
every relabel action that can create or move a label; ``replay``; ``replay --raw``; and a spool
written during an outage, drained by the next start.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import receivers as rx
import yaml
from conformance import ConformanceReceiver, Limits

pytestmark = [pytest.mark.integration, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
# A run that only has to deliver a few windows: 4 half-second windows, not 4 of a second.
SHORT = {"window": "500ms", "duration": "2s"}
POWER_MAX = "DCGM_FI_DEV_POWER_USAGE_max"
NVLINK_TX = "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"  # one series per link: a `link` label


def links_by_gpu(receiver: ConformanceReceiver, name: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for labels in receiver.series_named(name):
        out.setdefault(dict(labels)["gpu"], set()).add(dict(labels)["link"])
    return out


def names_of(receiver: ConformanceReceiver) -> set[str]:
    return {dict(labels)["__name__"] for labels in receiver.samples}


def write_config(path: Path, url: str, flavor: str, jobs: Path) -> Path:
    config = {
        "external_labels": {"cluster": "fra1-a", "datacenter": "fra1"},
        "hpc_job_mapping_dir": str(jobs),
        "remote_write": [
            {
                "url": url,
                "flavor": flavor,
                "tenant": "team-a",
                "write_relabel_configs": [
                    # labelmap and replace create names anywhere in the order
                    {"regex": "(cluster|datacenter)", "action": "labelmap", "replacement": "k_$1"},
                    {"source_labels": ["gpu"], "target_label": "AAA_first", "replacement": "g$1"},
                    {"source_labels": ["UUID"], "target_label": "zz_last"},
                    {
                        "source_labels": ["UUID"],
                        "target_label": "shard",
                        "modulus": 4,
                        "action": "hashmod",
                    },
                    {"regex": "pci_bus_id", "action": "labeldrop"},
                ],
            }
        ],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _job_power_seen(receiver: ConformanceReceiver, job: str) -> bool:
    return any(dict(k).get("hpc_job") == job for k in receiver.series_named(POWER_MAX))


@pytest.mark.parametrize("flavor", ["thanos", "mimir"])
def test_run_with_labels_attribution_and_relabelling(tmp_path: Path, flavor: str) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0").write_text("slurm-4242\n")
    header = rx_tenant_header(flavor)
    with ConformanceReceiver(flavour=flavor, tenant_header=header) as receiver:  # type: ignore[arg-type]
        config = write_config(tmp_path / "hfsampler.yml", receiver.url, flavor, jobs)
        args = rx.sim_run_args(
            [], window="500ms", duration="60s", labels={"team": "ml"}, extra=["--fields", "all"]
        )  # all: the opt-in per-link NVLink series too; stopped once both jobs are seen
        proc = rx.spawn_cli([*args, "--config", str(config)], tmp_path / "run.log")
        try:
            # the first job's power series itself, not any series of it: a window's series come
            # in several requests over several shards, and a stop right after the swap below
            # may leave the rest of that window to a flush a loaded machine cannot finish
            receiver.wait(lambda r: proc.poll() is not None or _job_power_seen(r, "slurm-4242"), 20)
            (jobs / "0").write_text("slurm-4243\n")  # a new job on GPU 0: series swap
            # Until the new job's series arrive, however slowly a loaded machine started the run
            # (a fixed 6 s run sometimes ended before it read the job file again).
            receiver.wait(
                lambda r: proc.poll() is not None or _job_power_seen(r, "slurm-4243"),
                30,
            )
            assert rx.stop_cli(proc) == 0, (tmp_path / "run.log").read_text()
        finally:
            rx.stop_cli(proc)
    receiver.assert_conformant()
    report = receiver.report()
    assert report["statuses"].keys() <= {200, 204}, report
    power = receiver.series_named(POWER_MAX)
    assert power, report
    for labels in power:
        got = dict(labels)
        assert got["k_cluster"] == "fra1-a"
        assert got["team"] == "ml"
        assert got["shard"] in {"0", "1", "2", "3"}
        assert got["AAA_first"] == f"g{got['gpu']}"
        assert got["instance"].endswith(":9400")
        assert "pci_bus_id" not in got
    jobs_seen = {dict(k).get("hpc_job") for k in power if dict(k)["gpu"] == "0"}
    assert jobs_seen == {"slurm-4242", "slurm-4243"}
    # per-link series: relabelled like the others, each link once per GPU and job (the sim's
    # last link is down on GPU 1)
    links = links_by_gpu(receiver, NVLINK_TX)
    assert links == {"0": {str(k) for k in range(18)}, "1": {str(k) for k in range(17)}}
    for labels in receiver.series_named(NVLINK_TX):
        assert dict(labels)["AAA_first"] == f"g{dict(labels)['gpu']}"
    assert report["stale_markers"] > 0  # the ended job's series, then everything at shutdown
    assert "hfsampler_windows_total" in names_of(receiver)


def rx_tenant_header(flavor: str) -> str:
    return {"thanos": "THANOS-TENANT", "mimir": "X-Scope-OrgID"}[flavor]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conformance-replay") / "run.hfs"
    done = subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "--label",
         "run=conformance", "--fields", "all", "-o", str(path), "--", sys.executable, "-c",
         "import time; time.sleep(1.5)"],
        env=rx.hfsampler_env(), capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.parametrize("raw", [False, True], ids=["windows", "raw"])
def test_replay(recording: Path, raw: bool) -> None:
    with ConformanceReceiver() as receiver:
        args = ["replay", str(recording), "--remote-write", receiver.url, "--label", "dc=fra1"]
        rx.run_cli([*args, "--raw"] if raw else args, timeout_s=120).check()
    receiver.assert_conformant()
    names = names_of(receiver)
    if raw:
        assert "DCGM_FI_DEV_POWER_USAGE_INSTANT_raw" in names
        assert all(n.endswith("_raw") for n in names), names
    else:
        assert POWER_MAX in names
    # a recorded link keeps its label through replay, windows and raw samples alike
    links = links_by_gpu(receiver, NVLINK_TX + ("_raw" if raw else "_max"))
    assert links == {"0": {str(k) for k in range(18)}, "1": {str(k) for k in range(17)}}
    assert all(dict(k)["run"] == "conformance" for k in receiver.samples)


def test_spool_drained_after_an_outage(tmp_path: Path) -> None:
    port = rx.free_port()
    url = f"http://127.0.0.1:{port}/api/v1/write"
    queue = tmp_path / "queue"
    args = rx.sim_run_args([url], **SHORT, extra=["--queue-dir", str(queue)])
    rx.run_cli(args, timeout_s=60).check()  # the receiver is down: everything spools
    assert any(queue.rglob("*.seg"))
    with ConformanceReceiver(port=port) as receiver:
        started = time.time()
        rx.run_cli(args, timeout_s=60).check()
    receiver.assert_conformant()
    stamps = sorted(t for samples in receiver.series_named(POWER_MAX).values() for t, _ in samples)
    # the first run's windows (spooled) came too, before the second run's
    assert stamps[0] < started * 1000 - 2000
    assert stamps[-1] > started * 1000
    assert receiver.report()["stale_markers"] > 0


def test_413_receiver_gets_every_sample_in_more_requests(tmp_path: Path) -> None:
    """Bodies over 16 KiB decoded get 413: 8 GPUs' windows still arrive whole, split."""
    with ConformanceReceiver(limits=Limits(max_decoded_bytes=16 << 10)) as receiver:
        rx.run_cli(rx.sim_run_args([receiver.url], gpus=8, **SHORT), timeout_s=60).check()
    receiver.assert_conformant(ignore=["body-decoded-too-large"])
    report = receiver.report()
    assert report["statuses"].get(413, 0) > 0, report
    assert report["violations"].keys() == {"body-decoded-too-large"}, report
    power = receiver.series_named(POWER_MAX)
    assert {dict(k)["gpu"] for k in power} == {str(g) for g in range(8)}
    windows = {len(samples) for samples in power.values()}
    assert len(windows) == 1, windows  # every GPU's series has every window: nothing lost


def _rw2_config(tmp_path: Path, url: str) -> list[str]:
    config = {"remote_write": [{"url": url, "protobuf_message": "io.prometheus.write.v2.Request"}]}
    path = tmp_path / "rw2.yml"
    path.write_text(yaml.safe_dump(config))
    return ["--config", str(path)]


def test_run_as_rw2_metadata_on_every_series(tmp_path: Path) -> None:
    with ConformanceReceiver() as receiver:
        args = [*rx.sim_run_args([], **SHORT), *_rw2_config(tmp_path, receiver.url)]
        rx.run_cli(args, timeout_s=60).check()
    receiver.assert_conformant()  # v2-metadata-missing included: every series has its type
    report = receiver.report()
    assert report["protocols"] == {"1.0": 0, "2.0": report["requests"]}, report
    stored = sum(len(s) for s in receiver.samples.values())
    assert sum(w.samples for w in receiver.written if w is not None) == stored
    from hfsampler.fields import BY_NAME

    for labels in receiver.samples:
        name = dict(labels)["__name__"]
        metric_type, help_text, unit = receiver.metadata_of[labels]
        assert metric_type in ("gauge", "counter"), (name, metric_type)
        assert help_text, name
        field = BY_NAME.get(name.removesuffix("_min").removesuffix("_max").removesuffix("_p99"))
        if field is not None:
            assert unit == field.unit, name
            assert metric_type == field.prometheus_type, name
    counters = [k for k in receiver.samples if dict(k)["__name__"].startswith("hfsampler_")
                and receiver.metadata_of[k][0] == "counter"]  # fmt: skip
    assert counters
    assert all(receiver.start_timestamps.get(k) for k in counters)  # process start


@pytest.mark.parametrize("old", ["legacy", "415"])
def test_rw2_falls_back_to_1_0_and_loses_nothing(tmp_path: Path, old: str) -> None:
    options: dict[str, object] = (
        {"legacy_v1_only": True} if old == "legacy" else {"accept": ("prometheus.WriteRequest",)}
    )
    with ConformanceReceiver(**options) as receiver:  # type: ignore[arg-type]
        args = [*rx.sim_run_args([], **SHORT), *_rw2_config(tmp_path, receiver.url)]
        run = rx.run_cli(args, timeout_s=60).check()
    receiver.assert_conformant()
    lines = [ln for ln in run.stderr.splitlines() if "does not take Remote-Write 2.0" in ln]
    assert len(lines) == 1, run.stderr[-2000:]
    power = receiver.series_named(POWER_MAX)
    assert len(power) == 2
    assert len({len(s) for s in power.values()}) == 1  # every window of both GPUs
    assert min(len(s) for s in power.values()) >= 3

"""`run` with consumers, in this process on a virtual clock: the fake NVML's process lists, made-up
procfs trees (Slurm v1 and v2, Kubernetes systemd and cgroupfs drivers) and a fake container
runtime name each GPU's consumers; their memory and SM ratio are exact, their energy is the GPU's
energy counter's increase split by SM share, and a real push of them is conformant."""

from __future__ import annotations

import itertools
import logging
import math
import re
from pathlib import Path

import aiohttp
import procfs_trees as t
import pytest
import yaml
from conformance import ConformanceReceiver, is_stale_marker
from fake_nvml import COMPUTE, GRAPHICS, MPS, FakeNvml, FakeProcess, enable_mig, install, make_fake
from inprocess import free_port, reloaded, start_ns

from hfsampler.cli.main import build_parser
from hfsampler.config.flags import config_from_args
from hfsampler.export import consumer_series as cs
from hfsampler.export.service import Service
from hfsampler.sampling.plan import build_run
from hfsampler.sampling.stepping import VirtualClock

pytest.importorskip("grpc", reason="pip install 'hfsampler[k8s]' for the CRI client")

from fake_cri import FakeContainer, FakeRuntime, FakeSandbox, fake_runtime

__all__ = ["fake_runtime"]  # fixtures

S = 10**9
GIB = 1 << 30
COUNTER = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
Labels = tuple[tuple[str, str], ...]


def _service(
    tmp_path: Path, config: dict[str, object], duration: str, clock: VirtualClock
) -> Service:
    path = tmp_path / "hfsampler.yml"
    # the fast group every 10 ms: a tenth of the ticks, the same windows (energy is slow's)
    path.write_text(yaml.safe_dump({"intervals": {"fast": "10ms"}, **config}))
    parser, _ = build_parser()
    argv = ["run", "--source", "nvml", "--config", str(path), "--duration", duration]
    return Service(build_run(config_from_args(parser.parse_args(argv))), clock=clock)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return install(monkeypatch, make_fake(2))


def _last(series: dict[Labels, list[tuple[int, float]]], **match: str) -> dict[Labels, float]:
    """Each series' last value that is not a stale marker, of those carrying ``match``."""
    out = {}
    for labels, samples in series.items():
        if match.items() <= dict(labels).items():
            live = [v for _, v in samples if math.isfinite(v)]
            if live:
                out[labels] = live[-1]
    return out


def _by(values: dict[Labels, float], label: str) -> dict[str, float]:
    return {dict(k).get(label, ""): v for k, v in values.items()}


def _energy_by_window(rx: ConformanceReceiver, gpu: str) -> dict[int, float]:
    """Consumers and unattributed together, per window timestamp, for one GPU (a consumer's
    counter carried as it stood where it has no sample)."""
    names = (cs.ENERGY, cs.UNATTRIBUTED)
    series = [s for n in names for s in rx.series_named(n, gpu=gpu).values()]
    stamps = sorted({ts for s in series for ts, _ in s})
    out = {}
    for ts in stamps:
        total = 0.0
        for s in series:
            before = [v for tt, v in s if tt <= ts and math.isfinite(v)]
            total += before[-1] if before else 0.0
        out[ts] = total
    return out


async def test_consumers_of_two_shared_gpus_exact_and_their_energy_is_the_counters_increase(
    tmp_path: Path, fake: FakeNvml, fake_runtime: FakeRuntime
) -> None:
    # GPU 0: a pod's container (systemd driver, containerd) at 60 % of the SMs with 4 GiB, a
    # Slurm job (cgroup v1) at 20 % with 1 GiB in two processes, one in compute and graphics at
    # once. GPU 1: a pod (cgroupfs driver) at 50 % in the MPS list, a Slurm job (cgroup v2)
    # holding 3 GiB idle.
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.K8S_SYSTEMD_CONTAINERD)
    t.add_process(root, 20, t.SLURM_V1)
    t.add_process(root, 21, t.SLURM_V1)
    t.add_process(root, 30, t.K8S_CGROUPFS_V2)
    t.add_process(root, 40, t.SLURM_V2_BATCH)
    fake.gpus[0].processes = [
        FakeProcess(10, 4 * GIB, 60.0),
        FakeProcess(20, GIB // 2, 15.0, lists=(COMPUTE, GRAPHICS)),
        FakeProcess(21, GIB // 2, 5.0),
    ]
    fake.gpus[1].processes = [FakeProcess(30, 2 * GIB, 50.0, lists=(MPS,)),
                              FakeProcess(40, 3 * GIB, 0.0)]  # fmt: skip
    fake_runtime.sandboxes = [
        FakeSandbox("sb1", t.POD_UID, "trainer-0", "ml", {"team": "cv", "app": "x"}),
        FakeSandbox("sb2", t.POD_UID_2, "infer-0", "serve"),
    ]
    fake_runtime.containers = [FakeContainer(t.CONTAINER_ID, "sb1", "train"),
                               FakeContainer(t.CONTAINER_ID_2, "sb2", "infer")]  # fmt: skip
    started = start_ns()
    clock = VirtualClock(started)
    fake.clock_us = lambda: clock.now_ns() // 1000
    port = free_port()
    pages: list[str] = []

    async def scrape() -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            pages.append(await resp.text())

    clock.at(started + 4 * S + S // 2, scrape)
    async with ConformanceReceiver() as rx:
        config = {
            "procfs": str(root),
            "container_runtime_socket": str(fake_runtime.path),
            "consumers": {"pod_label_allowlist": "team"},
            "listen": f"127.0.0.1:{port}",
            "remote_write": [{"url": rx.url, "name": "rx"}],
        }
        service = _service(tmp_path, config, "6s", clock)
        assert await service.run() == 0
    rx.assert_conformant()
    assert service.windows == 6
    # on /metrics too, each family once with its type, beside the GPU's own
    (page,) = pages
    assert f"# TYPE {cs.ENERGY} counter" in page
    assert f"# TYPE {cs.SM_RATIO} gauge" in page
    assert re.search(rf'^{cs.SM_RATIO}{{.*hpc_job="{t.JOB}".*}} 0.2$', page, re.M)
    assert re.search(r"^DCGM_FI_DEV_POWER_USAGE\{", page, re.M)
    sm = rx.series_named(cs.SM_RATIO)
    mem = rx.series_named(cs.MEMORY_USED)
    pod = {"pod": "trainer-0", "namespace": "ml", "container": "train", "team": "cv",
           "pod_uid": t.POD_UID, "container_id": t.CONTAINER_ID}  # fmt: skip
    (labels,) = _last(sm, gpu="0", pod_uid=t.POD_UID)
    assert pod.items() <= dict(labels).items()
    assert "app" not in dict(labels)  # not in the allowlist
    assert _by(_last(sm, gpu="0"), "hpc_job") == {"": 0.6, t.JOB: 0.2}
    assert _by(_last(mem, gpu="0"), "hpc_job") == {"": 4 * GIB, t.JOB: GIB}
    assert _by(_last(sm, gpu="1"), "hpc_job") == {"": 0.5, t.JOB_2: 0.0}
    assert _by(_last(mem, gpu="1"), "pod") == {"infer-0": 2 * GIB, "": 3 * GIB}
    for gpu in ("0", "1"):
        (samples,) = rx.series_named(COUNTER, gpu=gpu).values()
        counter = {ts: v for ts, v in samples if math.isfinite(v)}  # the windows', not the end's
        energy = _energy_by_window(rx, gpu)
        stamps = sorted(set(counter) & set(energy))
        assert len(stamps) >= 5
        for a, b in itertools.pairwise(stamps):  # each window after the first
            increase_j = (counter[b] - counter[a]) / 1e3
            assert increase_j > 0
            assert energy[b] - energy[a] == pytest.approx(increase_j, rel=0.01)
        whole_j = (counter[stamps[-1]] - counter[stamps[0]]) / 1e3
        assert energy[stamps[-1]] - energy[stamps[0]] == pytest.approx(whole_j, rel=0.01)
    # split by SM share: 60 : 20 on GPU 0; on GPU 1 the idle job draws nothing
    e0 = _by(_last(rx.series_named(cs.ENERGY), gpu="0"), "hpc_job")
    assert e0[""] / e0[t.JOB] == pytest.approx(3.0, rel=1e-9)
    e1 = _by(_last(rx.series_named(cs.ENERGY), gpu="1"), "hpc_job")
    assert e1[t.JOB_2] == 0.0
    assert _by(_last(rx.series_named(cs.UNATTRIBUTED)), "gpu") == {"0": 0.0, "1": 0.0}
    # shutdown ends every consumer series
    for name in (cs.SM_RATIO, cs.MEMORY_USED, cs.ENERGY, cs.UNATTRIBUTED):
        for labels, samples in rx.series_named(name).items():
            assert is_stale_marker(samples[-1][1]), (name, labels)


async def test_a_mig_gpus_energy_is_split_over_its_instances_consumers(
    tmp_path: Path, fake: FakeNvml
) -> None:
    # a 3g and a 1g instance: a job at 50 % of the 3g's SMs, a unit at 100 % of the 1g's; of
    # the GPU's SMs, 3/7 * 0.5 against 1/7 * 1.0: energy 3 : 2
    enable_mig(fake.gpus[0], 0, [(1, "3g.40gb"), (9, "1g.10gb")])
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.SLURM_V2)
    t.add_process(root, 20, t.SYSTEMD_SERVICE)
    fake.gpus[0].mig[0].processes = [FakeProcess(10, 5 * GIB, 50.0)]
    fake.gpus[0].mig[1].processes = [FakeProcess(20, GIB, 100.0)]
    clock = VirtualClock(start_ns())
    fake.clock_us = lambda: clock.now_ns() // 1000
    async with ConformanceReceiver() as rx:
        config = {"procfs": str(root), "listen": "", "remote_write": [{"url": rx.url}]}
        assert await _service(tmp_path, config, "4s", clock).run() == 0
    rx.assert_conformant()
    energy = _last(rx.series_named(cs.ENERGY, gpu="0"))
    by_instance = {dict(k)["GPU_I_ID"]: (dict(k), v) for k, v in energy.items()}
    assert by_instance["1"][0]["hpc_job"] == t.JOB
    assert by_instance["9"][0]["systemd_unit"] == "inference-server.service"
    assert by_instance["1"][1] / by_instance["9"][1] == pytest.approx(1.5, rel=1e-9)
    unattributed = _last(rx.series_named(cs.UNATTRIBUTED, gpu="0"))
    assert {dict(k).get("GPU_I_ID", "GPU") for k in unattributed} == {"GPU", "1", "9"}
    counter = rx.series_named(COUNTER, gpu="0")
    (samples,) = [s for k, s in counter.items() if "GPU_I_ID" not in dict(k)]
    stamps = [ts for ts, v in samples if math.isfinite(v)]
    energy_at = _energy_by_window(rx, "0")
    whole_j = (samples[len(stamps) - 1][1] - samples[0][1]) / 1e3
    assert energy_at[stamps[-1]] - energy_at[stamps[0]] == pytest.approx(whole_j, rel=0.01)


async def test_dcgm_exporter_virtual_gpus_per_pod_util_and_memory(
    tmp_path: Path, fake: FakeNvml, fake_runtime: FakeRuntime
) -> None:
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.K8S_SYSTEMD_CONTAINERD)
    t.add_process(root, 20, t.SLURM_V2)
    fake.gpus[0].processes = [FakeProcess(10, 3 * GIB, 40.0), FakeProcess(20, GIB, 10.0)]
    fake_runtime.sandboxes = [FakeSandbox("sb1", t.POD_UID, "trainer-0", "ml")]
    fake_runtime.containers = [FakeContainer(t.CONTAINER_ID, "sb1", "train")]
    clock = VirtualClock(start_ns())
    fake.clock_us = lambda: clock.now_ns() // 1000
    async with ConformanceReceiver() as rx:
        config = {
            "procfs": str(root),
            "container_runtime_socket": str(fake_runtime.path),
            "consumers": {"dcgm_exporter_virtual_gpus": True},
            "listen": "",
            "remote_write": [{"url": rx.url}],
        }
        assert await _service(tmp_path, config, "3s", clock).run() == 0
    rx.assert_conformant()
    util = _last(rx.series_named("DCGM_FI_DEV_GPU_UTIL", gpu="0", pod="trainer-0"))
    ((labels, value),) = util.items()
    assert value == 40.0
    assert {"namespace": "ml", "container": "train"}.items() <= dict(labels).items()
    assert "pod_uid" not in dict(labels)  # as dcgm-exporter names them: pod, namespace, container
    fb = _last(rx.series_named("DCGM_FI_DEV_FB_USED", gpu="0", pod="trainer-0"))
    assert list(fb.values()) == [3 * 1024.0]
    # the job is no pod: only its hfsampler_consumer_* series
    assert not _last(rx.series_named("DCGM_FI_DEV_GPU_UTIL", gpu="0", hpc_job=t.JOB))


def _count(text: str, needle: str) -> int:
    return len(re.findall(re.escape(needle), text))


async def test_consumers_off_leaves_the_run_as_it_was(tmp_path: Path, fake: FakeNvml) -> None:
    fake.gpus[0].processes = [FakeProcess(10, GIB, 50.0)]
    clock = VirtualClock(start_ns())
    fake.clock_us = lambda: clock.now_ns() // 1000
    async with ConformanceReceiver() as rx:
        config = {"consumers": False, "listen": "", "remote_write": [{"url": rx.url}]}
        assert await _service(tmp_path, config, "2s", clock).run() == 0
    names = {dict(k)["__name__"] for k in rx.samples}
    assert not {n for n in names if n.startswith(("hfsampler_consumer_", "hfsampler_gpu_un"))}
    assert not math.isnan(rx.report()["samples"])


async def test_a_reload_of_max_per_gpu_ends_the_series_and_folds_the_rest(
    tmp_path: Path, fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.SLURM_V2)
    t.add_process(root, 20, t.SYSTEMD_SERVICE)
    fake.gpus[0].processes = [FakeProcess(10, 2 * GIB, 60.0), FakeProcess(20, GIB, 30.0)]
    started = start_ns()
    clock = VirtualClock(started)
    fake.clock_us = lambda: clock.now_ns() // 1000
    path = tmp_path / "hfsampler.yml"
    parser, _ = build_parser()
    argv = ["run", "--source", "nvml", "--config", str(path), "--duration", "6s"]
    async with ConformanceReceiver() as rx:
        config: dict[str, object] = {"intervals": {"fast": "10ms"}, "procfs": str(root),
                                     "listen": "", "remote_write": [{"url": rx.url}]}  # fmt: skip
        path.write_text(yaml.safe_dump(config))
        service = Service(build_run(config_from_args(parser.parse_args(argv))), clock=clock,
                          loader=lambda: config_from_args(parser.parse_args(argv)))  # fmt: skip

        def change() -> None:
            path.write_text(yaml.safe_dump({**config, "consumers": {"max_per_gpu": 1}}))
            service.request_reload()

        clock.at(started + 2 * S + S // 2, change)
        clock.at(started + 3 * S + S // 2, lambda: reloaded(caplog))
        assert await service.run() == 0
    rx.assert_conformant()
    assert service.windows == 6
    energy = rx.series_named(cs.ENERGY, gpu="0")
    job = [s for lb, s in energy.items() if dict(lb).get("hpc_job") == t.JOB]
    assert len(job) == 1
    (other,) = [s for lb, s in energy.items() if dict(lb).get("consumer") == "other"]
    unit = [s for lb, s in energy.items() if "systemd_unit" in dict(lb)]
    # before: both their own; after, the job goes on as the same series, its counter from where
    # it stood, and the unit's series ends in the window where "other" starts
    assert [is_stale_marker(v) for _, v in job[0]].count(True) == 1  # at shutdown only
    counts = [v for _, v in job[0][:-1]]
    assert all(b > a for a, b in itertools.pairwise(counts[1:])), counts  # no reset
    assert is_stale_marker(unit[0][-1][1])
    assert unit[0][-1][0] == other[0][0]
    folded = _last(rx.series_named(cs.FOLDED, gpu="0"))
    assert list(folded.values()) == [1.0]


async def test_a_reload_of_the_pod_label_allowlist_relabels_the_pods_series(
    tmp_path: Path, fake: FakeNvml, fake_runtime: FakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.K8S_SYSTEMD_CONTAINERD)
    fake.gpus[0].processes = [FakeProcess(10, 2 * GIB, 60.0)]
    fake_runtime.sandboxes = [
        FakeSandbox("sb1", t.POD_UID, "trainer-0", "ml", labels={"team": "vision", "app": "t"})
    ]
    fake_runtime.containers = [FakeContainer(t.CONTAINER_ID, "sb1", "train")]
    started = start_ns()
    clock = VirtualClock(started)
    fake.clock_us = lambda: clock.now_ns() // 1000
    path = tmp_path / "hfsampler.yml"
    parser, _ = build_parser()
    argv = ["run", "--source", "nvml", "--config", str(path), "--duration", "5s"]
    async with ConformanceReceiver() as rx:
        config: dict[str, object] = {
            "intervals": {"fast": "10ms"}, "procfs": str(root), "listen": "",
            "remote_write": [{"url": rx.url}], "container_runtime_socket": str(fake_runtime.path),
            "consumers": {"pod_label_allowlist": "team"},
        }  # fmt: skip
        path.write_text(yaml.safe_dump(config))
        service = Service(build_run(config_from_args(parser.parse_args(argv))), clock=clock,
                          loader=lambda: config_from_args(parser.parse_args(argv)))  # fmt: skip

        def change() -> None:
            path.write_text(yaml.safe_dump({**config, "consumers": {"pod_label_allowlist": "app"}}))
            service.request_reload()

        clock.at(started + 2 * S + S // 2, change)
        clock.at(started + 3 * S + S // 2, lambda: reloaded(caplog))
        assert await service.run() == 0
    rx.assert_conformant()
    energy = rx.series_named(cs.ENERGY, gpu="0")
    by_team = [s for lb, s in energy.items() if dict(lb).get("team") == "vision"]
    by_app = [s for lb, s in energy.items() if dict(lb).get("app") == "t"]
    assert len(by_team) == 1
    assert is_stale_marker(by_team[0][-1][1])  # ended at the reload
    assert len(by_app) == 1  # the new allowlist's label from the window after the reload
    assert by_app[0][0][0] == by_team[0][-1][0]  # one ends where the other starts


def test_the_queues_are_sized_for_the_consumers_series_too(tmp_path: Path, fake: FakeNvml) -> None:
    clock = VirtualClock(start_ns())
    url = "http://127.0.0.1:9/api/v1/write"
    bounds = {}
    for mode, extra in (("off", {"consumers": False}), ("on", {"consumers": {"max_per_gpu": 4}})):
        service = _service(tmp_path, {"remote_write": [{"url": url}], **extra}, "1s", clock)
        (writer,) = service._writers
        bounds[mode] = writer.bound.window_samples
    # per GPU: 4 consumers and "other", three series each, and unattributed and folded
    assert bounds["on"] - bounds["off"] == 2 * ((4 + 1) * 3 + 2)


async def test_without_the_energy_counter_a_window_is_its_mean_power_times_its_length(
    tmp_path: Path, fake: FakeNvml
) -> None:
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 10, t.SLURM_V2)
    fake.gpus[0].processes = [FakeProcess(10, GIB, 40.0)]
    clock = VirtualClock(start_ns())
    fake.clock_us = lambda: clock.now_ns() // 1000
    async with ConformanceReceiver() as rx:
        config = {"fields": ["DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL"],
                  "procfs": str(root), "listen": "", "remote_write": [{"url": rx.url}]}  # fmt: skip
        assert await _service(tmp_path, config, "4s", clock).run() == 0
    rx.assert_conformant()
    (power,) = rx.series_named("DCGM_FI_DEV_POWER_USAGE", gpu="0").values()
    mean_w = {ts: v for ts, v in power if math.isfinite(v)}
    energy = _energy_by_window(rx, "0")
    stamps = sorted(set(mean_w) & set(energy))
    assert len(stamps) >= 3
    for a, b in itertools.pairwise(stamps):  # the whole windows: 1 s each
        assert energy[b] - energy[a] == pytest.approx(mean_w[b] * (b - a) / 1e3, rel=1e-9)
        assert mean_w[b] > 100  # watts, not the fake counter's 1 W

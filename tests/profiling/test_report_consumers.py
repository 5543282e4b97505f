"""Consumers in `record`, `report` and `compare`: who drew each GPU's energy, overall and per
phase, adding up with the unattributed energy to the GPU's; pairs of consumers compared by
identity; and a recording written before `record` kept consumers, still read.

`record` runs in this process on a virtual clock over the fake NVML (two processes of two
consumers on one GPU, found in a made-up procfs); `report` through ``main``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import procfs_trees as t
import pytest
from fake_nvml import FakeProcess, install
from inprocess import hfsampler, record
from known_power import KnownPower
from sim_recordings import synthesize

from hfsampler.consumers.identity import Consumer, Kind
from hfsampler.consumers.split import WindowUse
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import ConsumerWindow, Marker
from hfsampler.sampling.stepping import VirtualClock

GIB = 1 << 30
START_NS = 1_780_000_000 * 10**9
OLD = Path(__file__).resolve().parents[1] / "support" / "recordings" / "before-consumers.hfs"
JOB = Consumer(Kind.HPC_JOB, hpc_job="4242")
POD = Consumer(Kind.POD, pod_uid=t.POD_UID, container_id=t.CONTAINER_ID)
JOB_KEY = "hpc_job=4242"
POD_KEY = f"container_id={t.CONTAINER_ID},pod_uid={t.POD_UID}"


def _report(*argv: str) -> dict[str, Any]:
    done = hfsampler("report", *argv, "--format", "json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def _by_key(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["consumer"]: e for e in entries}


def _adds_up(gpu: dict[str, Any]) -> None:
    """Consumers and unattributed together are the GPU's energy."""
    drawn = sum(c["energy_j"] for c in gpu["consumers"])
    assert drawn + gpu["unattributed_j"] == pytest.approx(gpu["energy_j"], abs=1e-5)
    assert gpu["unattributed_j"] >= -1e-5


# -- the split, overall and per phase, on a recording written offline -----------------------------


def _windows(t0: int, t1: int) -> ConsumerWindow | None:
    """Seconds 0-4: on GPU 0 the job at 30 % and the pod at 10 % (two looks each), on GPU 1 the
    job at 50 % until second 3; second 5: no process at all."""
    k = (t0 - START_NS) // 10**9
    if k >= 5:
        return None
    looks = [t0 // 1000 + 100_000, t0 // 1000 + 600_000]
    samples = [(10, ts, 30.0) for ts in looks] + [(11, ts, 10.0) for ts in looks]
    uses = {0: WindowUse.of(0.0, samples, [(10, 1, 4.0 * GIB), (11, 1, 1.0 * GIB)])}
    if k < 3:
        uses[1] = WindowUse.of(0.0, [(10, looks[0], 50.0)], [(10, 1, 2.0 * GIB)])
    return ConsumerWindow(t0, t1, uses, {10: JOB, 11: POD})


@pytest.fixture(scope="module")
def split_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sim GPUs for 6 s, consumers in seconds 0-4 (``_windows``), phases train (1.5 s to
    4.5 s) and idle (second 5)."""
    path = tmp_path_factory.mktemp("consumers") / "split.hfs"
    ms = 10**6
    markers = [Marker(START_NS + 1500 * ms, "begin", "train"),
               Marker(START_NS + 4500 * ms, "end", "train"),
               Marker(START_NS + 5000 * ms, "begin", "idle"),
               Marker(START_NS + 6000 * ms, "end", "idle")]  # fmt: skip
    synthesize(path, 2, 6, quantize=True, start_ns=START_NS, markers=markers, consumers=_windows)
    return path


@pytest.fixture(scope="module")
def split_run(split_path: Path) -> dict[str, Any]:
    return _report(str(split_path))


def test_each_gpus_energy_is_split_by_sm_share_and_adds_up(split_run: dict[str, Any]) -> None:
    found = split_run["consumers"]
    assert found["windows"] == 5
    gpu0, gpu1 = found["gpus"]
    for gpu, summary in zip(found["gpus"], split_run["gpus"], strict=True):
        assert gpu["energy_j"] == pytest.approx(summary["energy_integrated_j"], rel=1e-9)
        _adds_up(gpu)
    zero = _by_key(gpu0["consumers"])
    assert list(zero) == [JOB_KEY, POD_KEY]  # largest first
    assert zero[JOB_KEY]["energy_j"] == pytest.approx(3 * zero[POD_KEY]["energy_j"], rel=1e-6)
    assert zero[JOB_KEY]["mean_sm_ratio"] == 0.3
    assert zero[POD_KEY]["memory_high_water_bytes"] == GIB
    assert zero[JOB_KEY]["energy_wh"] == pytest.approx(zero[JOB_KEY]["energy_j"] / 3600)
    # second 5 had no process: its energy, and nothing else, is unattributed (about a sixth)
    assert 0.1 < gpu0["unattributed_j"] / gpu0["energy_j"] < 0.25
    one = _by_key(gpu1["consumers"])
    assert list(one) == [JOB_KEY]
    assert 0.4 < gpu1["unattributed_j"] / gpu1["energy_j"] < 0.6  # seconds 3-5
    # all GPUs: the job's energy on both; its peak the highest second of both together
    total = _by_key(found["consumers"])
    assert total[JOB_KEY]["energy_j"] == pytest.approx(
        zero[JOB_KEY]["energy_j"] + one[JOB_KEY]["energy_j"], rel=1e-6
    )
    assert total[JOB_KEY]["peak_power_w"] > max(
        zero[JOB_KEY]["peak_power_w"], one[JOB_KEY]["peak_power_w"]
    )
    assert zero[JOB_KEY]["peak_power_w"] * 5 > zero[JOB_KEY]["energy_j"]  # a peak, not a sum


def test_per_phase_the_split_adds_up_to_the_phases_energy(split_run: dict[str, Any]) -> None:
    phases = {p["label"]: p for p in split_run["phases"]}
    found = {p["label"]: p for p in split_run["consumers"]["phases"]}
    assert list(found) == ["train", "idle"]
    for label, phase in found.items():
        for gpu, whole in zip(phase["gpus"], phases[label]["gpus"], strict=True):
            assert gpu["energy_j"] == pytest.approx(whole["energy_j"], rel=1e-6)
            _adds_up(gpu)
    # train (1.5 s to 4.5 s) straddles windows: each side of an edge split by its window's shares
    zero, one = found["train"]["gpus"]
    shares = _by_key(zero["consumers"])
    assert shares[JOB_KEY]["energy_j"] == pytest.approx(3 * shares[POD_KEY]["energy_j"], rel=1e-6)
    assert zero["unattributed_j"] == pytest.approx(0, abs=1e-5)
    assert 0.4 < one["unattributed_j"] / one["energy_j"] < 0.6  # 3 s to 4.5 s: no job there
    overall = _by_key(split_run["consumers"]["gpus"][0]["consumers"])
    assert shares[JOB_KEY]["energy_j"] < overall[JOB_KEY]["energy_j"]
    # idle: no process, all its energy unattributed
    for gpu in found["idle"]["gpus"]:
        assert gpu["consumers"] == []
        assert gpu["unattributed_j"] == pytest.approx(gpu["energy_j"], rel=1e-9)


def test_a_recording_from_before_consumers_still_reads(tmp_path: Path) -> None:
    """Written by `record` before it kept consumers (no CONS chunk, processes without their
    consumer): reports as before, its consumers said to be unrecorded."""
    rec = Recording(OLD)
    assert rec.complete
    assert list(rec.consumer_windows()) == []
    found = _report(str(OLD))
    assert found["consumers"] is None
    assert [p["pid"] for p in found["processes"]["0"]] == [4001, 4002]
    page = tmp_path / "old.html"
    done = hfsampler("report", str(OLD), "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert "No consumers were recorded" in page.read_text()


# -- record, report, compare at the command line ------------------------------------------------


def _record(
    out: Path, procfs: Path, monkeypatch: pytest.MonkeyPatch, pod_sm_pct: float
) -> dict[str, Any]:
    """`record --source nvml` for 3 s of one fake GPU holding the job's process (60 % of the SMs)
    and the pod's (``pod_sm_pct``), then `report --format json` of it."""
    truth = KnownPower(START_NS, 5.0, gpus=1)
    fake = truth.fake()
    clock = VirtualClock(START_NS)
    fake.clock_us = lambda: clock.now_ns() // 1000
    fake.gpus[0].processes = [FakeProcess(4001, 2 * GIB, 60.0), FakeProcess(4002, GIB, pod_sm_pct)]
    install(monkeypatch, fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    status = record("--source", "nvml", "--quiet", "--duration", "3s", "--fields",
                    "DCGM_FI_DEV_POWER_USAGE_INSTANT", "--procfs", str(procfs), "-o", str(out),
                    clock=clock)  # fmt: skip
    assert status == 0
    return _report(str(out))


@pytest.fixture
def procfs(tmp_path: Path) -> Path:
    root = t.host_procfs(tmp_path / "proc")
    t.add_process(root, 4001, t.SLURM_V2, comm="train")
    t.add_process(root, 4002, t.K8S_SYSTEMD_CONTAINERD, comm="serve")
    return root


def test_record_report_and_compare_two_consumers_on_one_gpu(
    tmp_path: Path, procfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _record(tmp_path / "base.hfs", procfs, monkeypatch, pod_sm_pct=20.0)
    (gpu,) = base["consumers"]["gpus"]
    _adds_up(gpu)
    shares = _by_key(gpu["consumers"])
    assert set(shares) == {JOB_KEY, POD_KEY}
    assert shares[JOB_KEY]["labels"] == {"hpc_job": "4242"}
    assert shares[POD_KEY]["labels"] == {"pod_uid": t.POD_UID, "container_id": t.CONTAINER_ID}
    assert shares[JOB_KEY]["energy_j"] == pytest.approx(3 * shares[POD_KEY]["energy_j"], rel=1e-6)
    assert (shares[JOB_KEY]["mean_sm_ratio"], shares[POD_KEY]["mean_sm_ratio"]) == (0.6, 0.2)
    assert shares[JOB_KEY]["memory_high_water_bytes"] == 2 * GIB
    # every window had a look at the processes: the GPU's energy is all theirs
    assert gpu["unattributed_j"] == pytest.approx(0, abs=1e-5)
    snapshot = Recording(tmp_path / "base.hfs").processes()[0]["gpus"]["0"]
    assert [p["consumer"] for p in snapshot] == [{"kind": "hpc_job", "hpc_job": "4242"},
                                                 {"kind": "pod", "pod_uid": t.POD_UID,
                                                  "container_id": t.CONTAINER_ID}]  # fmt: skip

    new = _record(tmp_path / "new.hfs", procfs, monkeypatch, pod_sm_pct=60.0)
    done = hfsampler("report", str(tmp_path / "base.hfs"), str(tmp_path / "new.hfs"), "--format",
                     "json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    paired = _by_key(json.loads(done.stdout)["delta"]["consumers"])
    assert set(paired) == {JOB_KEY, POD_KEY}
    new_shares = _by_key(new["consumers"]["consumers"])
    for key, pair in paired.items():
        assert (pair["in_base"], pair["in_new"]) == (True, True)
        energy = pair["energy_j"]
        assert energy["base"] == shares[key]["energy_j"]
        assert energy["new"] == new_shares[key]["energy_j"]
        assert energy["delta"] == pytest.approx(energy["new"] - energy["base"], abs=1e-5)
    # the same power, the pod's share of it up from a quarter to a half
    assert paired[POD_KEY]["energy_j"]["change"] == pytest.approx(1.0, rel=1e-3)
    assert paired[JOB_KEY]["energy_j"]["change"] == pytest.approx(-1 / 3, rel=1e-3)
    page = tmp_path / "compare.html"
    done = hfsampler("report", str(tmp_path / "base.hfs"), str(tmp_path / "new.hfs"), "-o",
                     str(page))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Consumers, all GPUs" in page.read_text()


def test_the_page_tables_each_gpus_consumers(
    tmp_path: Path, procfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _record(tmp_path / "run.hfs", procfs, monkeypatch, pod_sm_pct=20.0)
    page = tmp_path / "run.html"
    done = hfsampler("report", str(tmp_path / "run.hfs"), "-o", str(page))
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    section = text[text.index("<h2>Consumers</h2>") : text.index("<h2>GPU processes</h2>")]
    pod = f"pod_uid={t.POD_UID} container_id={t.CONTAINER_ID[:12]}"
    for said in ("hpc_job=4242", pod, "75.0 %", "25.0 %", "unattributed"):
        assert said in section
    assert t.CONTAINER_ID not in section  # cut as docker ps shows it: the JSON keeps it whole


def test_a_consumer_s_name_is_escaped_once_on_the_report_s_and_the_compare_s_page(
    tmp_path: Path,
) -> None:
    # a process may name itself R&D<1>: the pages show that, not "R&amp;D&lt;1&gt;"
    named = Consumer(Kind.COMMAND, uid=1000, command="R&D<1>")

    def windows(t0: int, t1: int) -> ConsumerWindow:
        use = WindowUse.of(0.0, [(10, t0 // 1000, 50.0)], [(10, 1, 1.0 * GIB)])
        return ConsumerWindow(t0, t1, {0: use}, {10: named})

    path = tmp_path / "named.hfs"
    synthesize(path, 1, 3, quantize=True, start_ns=START_NS, consumers=windows)
    for argv, page in (([str(path)], tmp_path / "r.html"), ([str(path)] * 2, tmp_path / "c.html")):
        done = hfsampler("report", *argv, "-o", str(page))
        assert done.returncode == 0, done.stderr
        text = page.read_text()
        assert "R&amp;D&lt;1&gt;" in text
        assert "&amp;amp;" not in text
        assert "&amp;lt;" not in text


def test_a_procfs_that_cannot_be_read_leaves_the_consumers_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--procfs` naming no procfs: said once, both processes one unknown consumer that drew
    the energy, never a failed recording."""
    found = _record(tmp_path / "run.hfs", tmp_path / "no-proc", monkeypatch, pod_sm_pct=20.0)
    (gpu,) = found["consumers"]["gpus"]
    assert [c["consumer"] for c in gpu["consumers"]] == ["consumer=unknown"]
    assert gpu["consumers"][0]["mean_sm_ratio"] == pytest.approx(0.8)
    _adds_up(gpu)
    assert "not a procfs" in caplog.text


def test_the_page_tables_all_gpus_and_each_phase(split_path: Path, tmp_path: Path) -> None:
    """Two GPUs: a table of both together; and a table per phase with consumers in it."""
    page = tmp_path / "split.html"
    done = hfsampler("report", str(split_path), "-o", str(page))
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    section = text[text.index("<h2>Consumers</h2>") : text.index("<h2>GPU processes</h2>")]
    assert "<h3>All GPUs</h3>" in section
    assert "Consumers in train" in section
    idle = section[section.index("Consumers in idle") :]
    assert "No consumer: all its energy is unattributed" in idle

"""A GPU process's consumer from made-up procfs trees: Slurm, Kubernetes, Docker, systemd, users;
and the faults: hidden pids, processes gone, reused pids, another PID namespace, hostile files."""

from __future__ import annotations

import logging
from pathlib import Path

import procfs_trees as t
import pytest

from hfsampler.consumers import procfs
from hfsampler.consumers.identity import Consumer, Kind
from hfsampler.consumers.procfs import ProcfsReader, consumer_of_cgroup, parse_stat

POD = Consumer(Kind.POD, pod_uid=t.POD_UID, container_id=t.CONTAINER_ID)


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        (t.SLURM_V1, Consumer(Kind.HPC_JOB, hpc_job=t.JOB)),
        (t.SLURM_V1_NODE, Consumer(Kind.HPC_JOB, hpc_job=t.JOB_2)),
        (t.SLURM_V2, Consumer(Kind.HPC_JOB, hpc_job=t.JOB)),
        (t.SLURM_V2_BATCH, Consumer(Kind.HPC_JOB, hpc_job=t.JOB_2)),
        (t.SLURM_V2_NODE, Consumer(Kind.HPC_JOB, hpc_job=t.JOB)),
        (t.K8S_SYSTEMD_CONTAINERD, POD),
        (t.K8S_SYSTEMD_CRIO, POD),
        (t.K8S_SYSTEMD_DOCKER, POD),
        (t.K8S_CGROUPFS, POD),
        (t.K8S_CGROUPFS_V2,
         Consumer(Kind.POD, pod_uid=t.POD_UID_2, container_id=t.CONTAINER_ID_2)),
        (t.K8S_FROM_CGROUPNS, POD),
        (t.DOCKER_SYSTEMD, Consumer(Kind.CONTAINER, container_id=t.CONTAINER_ID_3)),
        (t.DOCKER_CGROUPFS, Consumer(Kind.CONTAINER, container_id=t.CONTAINER_ID_3)),
        (t.SYSTEMD_SERVICE, Consumer(Kind.UNIT, unit="inference-server.service")),
        (t.USER_SESSION, Consumer(Kind.UNIT, unit="user@1000.service")),
        (t.USER_MANAGER, Consumer(Kind.UNIT, unit="user@1000.service")),
        (t.HYBRID, Consumer(Kind.UNIT, unit="trainer.service")),
    ],
)  # fmt: skip
def test_consumer_of_each_environment(tmp_path: Path, cgroup: str, expected: Consumer) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 31337, cgroup)
    assert ProcfsReader(str(root)).consumer(31337) == expected


def test_labels_name_the_consumer_never_a_pid(tmp_path: Path) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 500, t.K8S_SYSTEMD_CONTAINERD)
    t.add_process(root, 501, t.SLURM_V2)
    t.add_process(root, 502, t.ROOT_CGROUP, comm="my (odd) job", uid=1234)
    t.add_process(root, 503, t.TRANSIENT, comm="train")
    reader = ProcfsReader(str(root))
    got = {pid: reader.consumer(pid).labels() for pid in (500, 501, 502, 503, 9999)}
    assert got == {
        500: {"pod_uid": t.POD_UID, "container_id": t.CONTAINER_ID},
        501: {"hpc_job": t.JOB},
        502: {"uid": "1234", "command": "my (odd) job"},
        503: {"uid": "1000", "command": "train"},
        9999: {"consumer": "unknown"},
    }
    assert not any(str(pid) in v for pid in got for labels in got.values() for v in labels.values())


def test_processes_of_one_job_are_one_consumer(tmp_path: Path) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 10, t.SLURM_V2)
    t.add_process(root, 11, t.SLURM_V2.replace("step_0/user/task_0", "step_0/user/task_1"))
    reader = ProcfsReader(str(root))
    found = reader.consumers([10, 11])
    assert found[10] == found[11]
    assert len({found[10], found[11]}) == 1  # hashable, equal: sums per consumer are dict keys


def test_stat_with_parentheses_and_spaces_in_the_command() -> None:
    comm, start = parse_stat(t.stat_line(7, "a) (b c", 98765))
    assert (comm, start) == ("a) (b c", 98765)
    with pytest.raises(ValueError, match="stat"):
        parse_stat(b"7 (x) S 1 2")


def test_hidden_pid_is_unknown_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reader = ProcfsReader(str(t.host_procfs(tmp_path)))
    with caplog.at_level(logging.WARNING, "hfsampler.consumers.procfs"):
        assert reader.consumer(4000) == Consumer.unknown()
        assert reader.consumer(4001) == Consumer.unknown()
    lines = [r for r in caplog.records if "not in procfs" in r.getMessage()]
    assert len(lines) == 1
    assert reader.faults["hidden"] == 2


def test_another_pid_namespace_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = t.child_procfs(tmp_path)
    # pid 7 exists in the container's namespace, but NVML's pid 7 is another (host) process
    t.add_process(root, 7, t.K8S_CGROUPFS)
    with caplog.at_level(logging.WARNING, "hfsampler.consumers.procfs"):
        reader = ProcfsReader(str(root))
        assert reader.consumer(7) == Consumer.unknown()
    assert reader.faults["namespace"] == 1
    assert sum("not the host's" in r.getMessage() for r in caplog.records) == 1


def test_no_procfs_at_all(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "hfsampler.consumers.procfs"):
        reader = ProcfsReader(str(tmp_path / "missing"))
        assert reader.consumer(1) == Consumer.unknown()
    assert reader.faults["procfs"] == 1


def test_reused_pid_is_not_the_old_process(tmp_path: Path) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 600, t.K8S_SYSTEMD_CONTAINERD, start_ticks=1000)
    reader = ProcfsReader(str(root))
    assert reader.consumer(600) == POD
    # the process left; a Slurm task got the same pid
    t.remove_process(root, 600)
    t.add_process(root, 600, t.SLURM_V2, start_ticks=2000)
    assert reader.consumer(600) == Consumer(Kind.HPC_JOB, hpc_job=t.JOB)


def test_cached_by_start_time(tmp_path: Path) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 601, t.SLURM_V1)
    reader = ProcfsReader(str(root))
    first = reader.consumer(601)
    (root / "601" / "cgroup").unlink()  # not read again while the start time is the same
    assert reader.consumer(601) == first
    assert not reader.faults


def test_pid_taken_between_two_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    root = t.host_procfs(tmp_path)
    t.add_process(root, 700, t.K8S_CGROUPFS, start_ticks=1)
    real_read = procfs._read

    def racing(path: Path, limit: int) -> bytes:
        data = real_read(path, limit)
        if path.name == "status":  # after the cgroup read: another process takes the pid
            t.add_process(root, 700, t.SLURM_V2, start_ticks=2)
        return data

    monkeypatch.setattr(procfs, "_read", racing)
    reader = ProcfsReader(str(root))
    with caplog.at_level(logging.WARNING, "hfsampler.consumers.procfs"):
        assert reader.consumer(700) == Consumer.unknown()
    assert reader.faults["reused"] == 1
    monkeypatch.setattr(procfs, "_read", real_read)
    assert reader.consumer(700) == Consumer(Kind.HPC_JOB, hpc_job=t.JOB)


def test_process_gone_between_two_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 800, t.K8S_CGROUPFS, comm="trainer")
    real_read = procfs._read

    def gone(path: Path, limit: int) -> bytes:
        if path.name == "cgroup":
            t.remove_process(root, 800)
        return real_read(path, limit)

    monkeypatch.setattr(procfs, "_read", gone)
    reader = ProcfsReader(str(root))
    assert reader.consumer(800) == Consumer(Kind.COMMAND, command="trainer")
    assert reader.faults["gone"] == 1


def test_gone_since_the_last_look_keeps_what_was_known(tmp_path: Path) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 801, t.SLURM_V2)
    reader = ProcfsReader(str(root))
    assert reader.consumer(801).hpc_job == t.JOB
    t.remove_process(root, 801)  # NVML may still list it for a moment
    assert reader.consumer(801).hpc_job == t.JOB


def test_forgets_pids_no_longer_asked_about(tmp_path: Path) -> None:
    root = t.host_procfs(tmp_path)
    for pid in (900, 901):
        t.add_process(root, pid, t.SLURM_V1)
    reader = ProcfsReader(str(root), max_cached=8)
    reader.consumers([900, 901])
    t.remove_process(root, 900)
    reader.consumers([901])
    assert reader.consumer(900) == Consumer.unknown()  # not kept once it left the lists


@pytest.mark.parametrize(
    "content",
    [
        b"0::/" + b"a" * 200_000 + b"\n",  # longer than any real file: read up to the bound
        b"0::/system.slice/\x1b[31mevil\x07.service\n",  # terminal escapes in a unit name
        b"0::/kubepods/burstable/pod\xff\xfe/\xc3\x28" + b"\n",  # not UTF-8
        b"garbage without colons\n\x00\x00\n",
        b"",
    ],
)
def test_hostile_cgroup_content_degrades_to_user_and_command(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 1000, content, comm="worker", uid=42)
    reader = ProcfsReader(str(root))
    with caplog.at_level(logging.WARNING, "hfsampler.consumers.procfs"):
        got = reader.consumer(1000)
    assert got == Consumer(Kind.COMMAND, uid=42, command="worker")
    for record in caplog.records:
        message = record.getMessage()
        assert "\n" not in message
        assert "\x1b" not in message
        assert len(message) < 1000


def test_odd_lines_beside_good_ones(tmp_path: Path) -> None:
    found, odd = consumer_of_cgroup("junk\n" + "9:x:/" + "y" * 5000 + "\n" + t.SLURM_V2)
    assert found == Consumer(Kind.HPC_JOB, hpc_job=t.JOB)
    assert odd == 2


def test_control_characters_in_the_command_are_escaped(tmp_path: Path) -> None:
    root = t.host_procfs(tmp_path)
    t.add_process(root, 1100, t.ROOT_CGROUP, comm="a\nb\x1b")
    labels = ProcfsReader(str(root)).consumer(1100).labels()
    assert labels["command"] == "a\\nb\\x1b"

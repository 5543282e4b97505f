"""Made-up procfs trees for the consumer tests: processes with the cgroups Slurm (cgroup v1 and
v2), Kubernetes (systemd and cgroupfs drivers; containerd, CRI-O, Docker), plain Docker and
systemd give them, as ``/proc/PID/{stat,status,cgroup}`` files under a temporary root.

``host_procfs`` makes a root whose pid 1 is in the initial PID namespace (its ``ns/pid`` link
reads ``pid:[4026531836]``, the kernel's fixed number), as the host's procfs is;
``add_process`` writes one process. The cgroup contents below are as the kernel writes them
(``ID:controllers:path`` per hierarchy; cgroup v2's single ``0::path`` line).
"""

from __future__ import annotations

import os
from pathlib import Path

INIT_PID_NS = "pid:[4026531836]"

POD_UID = "0f9a5b2c-1d3e-4f60-8a7b-9c0d1e2f3a4b"
POD_UID_2 = "5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9"
CONTAINER_ID = "3f" * 32
CONTAINER_ID_2 = "a1" * 32
CONTAINER_ID_3 = "c7" * 32
JOB = "4242"
JOB_2 = "4243"


def _v1(path: str) -> str:
    """A cgroup v1 process's file: the same path in each hierarchy (as Slurm and the kubelet
    make them), systemd's own named hierarchy first as the kernel lists it (highest id first)."""
    return "".join(
        f"{n}:{ctl}:{path}\n"
        for n, ctl in (
            (12, "memory"), (11, "devices"), (10, "cpuset"), (9, "pids"), (8, "freezer"),
            (4, "cpu,cpuacct"), (1, "name=systemd"),
        )
    )  # fmt: skip


def _v2(path: str) -> str:
    return f"0::{path}\n"


SLURM_V1 = _v1(f"/slurm/uid_1000/job_{JOB}/step_0/task_0")
SLURM_V1_NODE = _v1(f"/slurm_node07/uid_1000/job_{JOB_2}/step_batch/task_0")  # MULTIPLE_SLURMD
SLURM_V2 = _v2(f"/system.slice/slurmstepd.scope/job_{JOB}/step_0/user/task_0")
SLURM_V2_BATCH = _v2(f"/system.slice/slurmstepd.scope/job_{JOB_2}/step_batch/user/task_special")
SLURM_V2_NODE = _v2(f"/system.slice/node07_slurmstepd.scope/job_{JOB}/step_extern/user/task_0")

_UID_ = POD_UID.replace("-", "_")
K8S_SYSTEMD_CONTAINERD = _v2(
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_UID_}.slice/"
    f"cri-containerd-{CONTAINER_ID}.scope"
)
K8S_SYSTEMD_CRIO = _v2(
    f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{_UID_}.slice/"
    f"crio-{CONTAINER_ID}.scope"
)
K8S_SYSTEMD_DOCKER = _v1(  # cri-dockerd on a cgroup v1 node, Guaranteed QoS (no QoS slice)
    f"/kubepods.slice/kubepods-pod{_UID_}.slice/docker-{CONTAINER_ID}.scope"
)
K8S_CGROUPFS = _v1(f"/kubepods/burstable/pod{POD_UID}/{CONTAINER_ID}")
K8S_CGROUPFS_V2 = _v2(f"/kubepods/besteffort/pod{POD_UID_2}/{CONTAINER_ID_2}")
# seen from a container with its own cgroup namespace: the path climbs out of it first
K8S_FROM_CGROUPNS = _v2(
    f"/../../kubepods-burstable-pod{_UID_}.slice/cri-containerd-{CONTAINER_ID}.scope"
)
DOCKER_SYSTEMD = _v2(f"/system.slice/docker-{CONTAINER_ID_3}.scope")
DOCKER_CGROUPFS = _v1(f"/docker/{CONTAINER_ID_3}")
SYSTEMD_SERVICE = _v2("/system.slice/inference-server.service")
USER_SESSION = _v2("/user.slice/user-1000.slice/session-17.scope")
USER_MANAGER = _v2("/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service")
TRANSIENT = _v2("/system.slice/run-u4711.service")
ROOT_CGROUP = _v2("/")
HYBRID = "12:memory:/\n1:name=systemd:/system.slice/trainer.service\n" + _v2(
    "/system.slice/trainer.service"
)


def host_procfs(root: Path) -> Path:
    """An empty procfs root whose pid 1 is in the initial PID namespace."""
    add_process(root, 1, _v2("/init.scope"), comm="systemd", uid=0, start_ticks=1)
    return root


def child_procfs(root: Path) -> Path:
    """A procfs root of a container's own PID namespace (pid 1 is the container's entrypoint)."""
    add_process(root, 1, _v2("/"), comm="hfsampler", uid=0, start_ticks=5000, ns="pid:[4026532999]")
    return root


def stat_line(pid: int, comm: str, start_ticks: int) -> bytes:
    """``/proc/PID/stat`` as the kernel writes it: 52 fields, the 22nd the start time."""
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 12
    fields += [str(start_ticks)] + ["0"] * 30
    return f"{pid} ({comm}) ".encode() + " ".join(fields).encode() + b"\n"


def add_process(
    root: Path,
    pid: int,
    cgroup: str | bytes,
    *,
    comm: str = "python3",
    uid: int = 1000,
    start_ticks: int = 123_456,
    ns: str = INIT_PID_NS,
) -> Path:
    """Write one process's files; returns its directory."""
    d = root / str(pid)
    (d / "ns").mkdir(parents=True, exist_ok=True)
    (d / "stat").write_bytes(stat_line(pid, comm, start_ticks))
    (d / "status").write_text(
        f"Name:\t{comm}\nState:\tS (sleeping)\nTgid:\t{pid}\nPid:\t{pid}\n"
        f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
    )
    (d / "cgroup").write_bytes(cgroup if isinstance(cgroup, bytes) else cgroup.encode())
    link = d / "ns" / "pid"
    if link.is_symlink():
        link.unlink()
    os.symlink(ns, link)
    return d


def remove_process(root: Path, pid: int) -> None:
    d = root / str(pid)
    for f in ("stat", "status", "cgroup"):
        (d / f).unlink(missing_ok=True)
    (d / "ns" / "pid").unlink(missing_ok=True)
    (d / "ns").rmdir()
    d.rmdir()

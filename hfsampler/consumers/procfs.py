"""A GPU process's consumer, read from the host's procfs: its cgroup, start time, user, command.

NVML names processes by their pid in the host's PID namespace, so the procfs read must be the
host's: ``/proc`` on the host, the host's ``/proc`` mounted at ``/host/proc`` in a container (as
node_exporter's ``--path.procfs``). A procfs whose pid 1 is not in the initial PID namespace would
answer for other processes under the same numbers, so such a procfs is said once and not read.

From ``/proc/PID/cgroup`` (cgroup v1 lines and the v2 ``0::`` line): a Slurm job, a Kubernetes
pod's container (cgroupfs and systemd drivers; containerd, CRI-O, Docker), a container outside
Kubernetes, or a systemd unit; failing those, the user (``/proc/PID/status``) and the command
(``/proc/PID/stat``). ``/proc/PID/stat``'s start time (field 22) is read before and after, so a
pid taken by a new process between two reads, or reused since the last look, is never taken for
the old process.

Every read is bounded; every fault (procfs unreadable, a pid not visible, a process gone, a pid
reused, content that is not a cgroup line) is one log line per kind, counted in ``faults``, and
the answer degrades to what is known: never an exception to the caller.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from hfsampler.consumers.identity import Consumer, Kind, label_value

log = logging.getLogger(__name__)

MAX_CGROUP_BYTES = 64 * 1024  # a process is in one cgroup per v1 hierarchy: a few lines
MAX_CGROUP_LINE = 4096  # PATH_MAX; a longer line is not the kernel's
MAX_STAT_BYTES = 4096
MAX_STATUS_BYTES = 16 * 1024
MAX_CACHED = 4096  # pids remembered with their consumer
# The kernel's fixed inode number of the initial PID namespace (PROC_PID_INIT_INO).
INIT_PID_NS = "pid:[4026531836]"

# -- cgroup paths -------------------------------------------------------------------------------

_SLURM_ROOT = re.compile(r"slurm(_.+)?\Z|(.+_)?slurmstepd\.scope\Z")
_SLURM_JOB = re.compile(r"job_(\d{1,20})\Z")
_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_POD_CGROUPFS = re.compile(rf"pod({_UUID})\Z")
_POD_SYSTEMD = re.compile(rf"kubepods(?:-[a-z]+)?-pod({_UUID})\.slice\Z")
_CONTAINER_ID = r"[0-9a-f]{12,128}"
_CONTAINER_BARE = re.compile(rf"({_CONTAINER_ID})\Z")
# containerd, CRI-O (not its conmon), Docker and cri-dockerd, Podman: <runtime>-<id>.scope
_CONTAINER_SCOPE = re.compile(rf"(?:cri-containerd|crio|docker|libpod)-({_CONTAINER_ID})\.scope\Z")
_USER_SLICE = re.compile(r"user-(\d{1,10})\.slice\Z")
_UNIT = re.compile(r"[A-Za-z0-9:_.@\\-]{1,256}\.(?:service|scope)\Z")
# systemd-run's generated names (run-u123.service, run-r<hex>.scope): one per command, so they
# would make a series per run; the user and command say more.
_TRANSIENT_UNIT = re.compile(r"run-[a-z]?[0-9a-f]+\.(?:service|scope)\Z")


def _kubernetes(parts: list[str]) -> Consumer | None:
    if not any(p == "kubepods" or p.startswith("kubepods") for p in parts):
        return None
    for i, part in enumerate(parts):
        found = _POD_SYSTEMD.match(part) or _POD_CGROUPFS.match(part)
        if found is None:
            continue
        uid = found.group(1).replace("_", "-")
        container = ""
        if i + 1 < len(parts):
            nxt = parts[i + 1]
            got = _CONTAINER_SCOPE.match(nxt) or _CONTAINER_BARE.match(nxt)
            container = got.group(1) if got else ""
        return Consumer(Kind.POD, pod_uid=uid, container_id=container)
    return None


def _container(parts: list[str]) -> Consumer | None:
    """A container outside Kubernetes: ``docker-<id>.scope`` (systemd driver) or
    ``/docker/<id>`` (cgroupfs)."""
    for i, part in enumerate(parts):
        got = _CONTAINER_SCOPE.match(part)
        if got is None and i > 0 and parts[i - 1] in ("docker", "containerd", "libpod_parent"):
            got = _CONTAINER_BARE.match(part)
        if got is not None:
            return Consumer(Kind.CONTAINER, container_id=got.group(1))
    return None


def _slurm(parts: list[str]) -> Consumer | None:
    for i, part in enumerate(parts):
        if _SLURM_ROOT.match(part):
            for later in parts[i + 1 :]:
                job = _SLURM_JOB.match(later)
                if job is not None:
                    return Consumer(Kind.HPC_JOB, hpc_job=job.group(1))
    return None


def _unit(parts: list[str]) -> Consumer | None:
    for i, part in enumerate(parts):
        user = _USER_SLICE.match(part)
        if user is not None and i > 0 and parts[i - 1] == "user.slice":
            # A login's session-N.scope changes with every login: the user's unit stays.
            return Consumer(Kind.UNIT, unit=f"user@{user.group(1)}.service")
    for part in reversed(parts):
        if _UNIT.match(part):
            if _TRANSIENT_UNIT.match(part):
                return None
            return Consumer(Kind.UNIT, unit=part)
    return None


def consumer_of_path(path: str) -> Consumer | None:
    """The consumer a cgroup path names, None where it names none (the root, a bare slice).

    A path seen from another cgroup namespace starts with ``/..`` components; they are skipped
    like any other that names nothing."""
    parts = [p for p in path.split("/") if p]
    for find in (_slurm, _kubernetes, _container, _unit):
        found = find(parts)
        if found is not None:
            return found
    return None


_RANK = {Kind.HPC_JOB: 0, Kind.POD: 0, Kind.CONTAINER: 1, Kind.UNIT: 2}


def consumer_of_cgroup(text: str) -> tuple[Consumer | None, int]:
    """The most specific consumer the lines of a ``/proc/PID/cgroup`` name, and how many lines
    were not cgroup lines (too long, no ``ID:controllers:path`` shape)."""
    candidates: list[tuple[int, int, Consumer]] = []
    odd = 0
    for line in text.splitlines():
        if not line:
            continue
        fields = line.split(":", 2)
        if len(line) > MAX_CGROUP_LINE or len(fields) != 3 or not fields[0].isdigit():
            odd += 1
            continue
        found = consumer_of_path(fields[2])
        if found is not None:
            # the v2 line, then systemd's own v1 hierarchy, then the rest in file order
            where = 0 if fields[:2] == ["0", ""] else 1 if fields[1] == "name=systemd" else 2
            candidates.append((_RANK[found.kind], where, found))
    if not candidates:
        return None, odd
    return min(candidates, key=lambda c: (c[0], c[1]))[2], odd


# -- reading procfs -----------------------------------------------------------------------------


def _read(path: Path, limit: int) -> bytes:
    with path.open("rb", buffering=0) as f:
        return f.read(limit)


def parse_stat(data: bytes) -> tuple[str, int]:
    """(command, start time in clock ticks since boot) from ``/proc/PID/stat``. The command sits
    in parentheses and may itself hold spaces and parentheses, so the fields after it are found
    from the last ``)``. Raises ValueError on anything else."""
    open_at, close_at = data.find(b"("), data.rfind(b")")
    if open_at < 0 or close_at < open_at:
        raise ValueError("no (comm) in stat")
    rest = data[close_at + 1 :].split()
    if len(rest) < 20:
        raise ValueError("stat too short")
    comm = data[open_at + 1 : close_at].decode("utf-8", "replace")
    return comm, int(rest[19])  # field 22 of the line; rest[0] is field 3 (state)


def parse_uid(data: bytes) -> int | None:
    """The real uid from ``/proc/PID/status``, None where there is no well-formed Uid line."""
    for line in data.splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1])
            return None
    return None


class ProcfsReader:
    """Consumers of pids, from a procfs root; remembers each pid's consumer by its start time."""

    def __init__(self, root: str = "/proc", max_cached: int = MAX_CACHED) -> None:
        self.root = Path(root)
        self.max_cached = max_cached
        self.faults: Counter[str] = Counter()  # fault kind -> times seen
        self._said: set[str] = set()
        self._cache: dict[int, tuple[int, Consumer]] = {}  # pid -> (start time, consumer)
        self._usable = self._check_root()

    def _fault(self, kind: str, message: str, *args: object) -> None:
        self.faults[kind] += 1
        if kind not in self._said:
            self._said.add(kind)
            log.warning(message, *args)

    def _check_root(self) -> bool:
        """False where the procfs is of another PID namespace than NVML's (the host's)."""
        try:
            ns = os.readlink(self.root / "1" / "ns" / "pid")
        except FileNotFoundError:
            if not (self.root / "1").exists():
                self._fault("procfs", "procfs %s has no pid 1: not a procfs (set procfs: to the "
                            "host's, /host/proc in a container); consumers are unknown",
                            label_value(str(self.root)))  # fmt: skip
                return False
            return True
        except OSError:
            return True  # no right to read pid 1's namespace (no CAP_SYS_PTRACE): cannot tell
        if ns != INIT_PID_NS:
            self._fault("namespace", "procfs %s is of PID namespace %s, not the host's: NVML's "
                        "pids would name other processes there; mount the host's /proc (procfs: "
                        "/host/proc) or run with hostPID; consumers are unknown",
                        label_value(str(self.root)), label_value(ns))  # fmt: skip
            return False
        return True

    def consumers(self, pids: Iterable[int]) -> dict[int, Consumer]:
        """Each pid's consumer; pids not asked about are forgotten (a later pid of the same
        number is another process anyway, and is told apart by its start time regardless)."""
        out = {pid: self.consumer(pid) for pid in pids}
        for pid in [p for p in self._cache if p not in out]:
            del self._cache[pid]
        return out

    def consumer(self, pid: int) -> Consumer:
        if not self._usable or pid <= 0:
            return Consumer.unknown()
        base = self.root / str(pid)
        first = self._stat(pid, base)
        if first is None:
            cached = self._cache.get(pid)
            return cached[1] if cached is not None else Consumer.unknown()
        comm, start = first
        cached = self._cache.get(pid)
        if cached is not None and cached[0] == start:
            return cached[1]
        try:
            cgroup = _read(base / "cgroup", MAX_CGROUP_BYTES).decode("utf-8", "surrogateescape")
            uid = parse_uid(_read(base / "status", MAX_STATUS_BYTES))
        except (FileNotFoundError, ProcessLookupError):
            self._fault("gone", "pid %d left between two reads of %s; attributed by its command",
                        pid, label_value(str(self.root)))  # fmt: skip
            return Consumer(Kind.COMMAND, command=label_value(comm))
        except OSError as exc:
            self._fault("unreadable", "cannot read %s: %s; consumers by command only",
                        label_value(str(base)), label_value(str(exc)))  # fmt: skip
            return Consumer(Kind.COMMAND, command=label_value(comm))
        found, odd = consumer_of_cgroup(cgroup)
        if odd:
            where = label_value(str(base / "cgroup"))
            self._fault("odd", "%s holds %d lines that are not cgroup lines (first bytes: %s)",
                        where, odd, label_value(cgroup[:80]))  # fmt: skip
        if found is None:
            found = Consumer(Kind.COMMAND, uid=uid, command=label_value(comm))
        again = self._stat(pid, base, quiet=True)
        if again is None or again[1] != start:
            # Another process took the pid while we read: what we read may be either's.
            self._fault("reused", "pid %d was taken by another process while it was read; "
                        "its consumer is unknown for now", pid)  # fmt: skip
            return Consumer.unknown()
        if len(self._cache) >= self.max_cached:
            del self._cache[next(iter(self._cache))]
        self._cache[pid] = (start, found)
        return found

    def _stat(self, pid: int, base: Path, quiet: bool = False) -> tuple[str, int] | None:
        try:
            return parse_stat(_read(base / "stat", MAX_STAT_BYTES))
        except (FileNotFoundError, ProcessLookupError):
            if not quiet:
                self._fault("hidden", "pid %d is not in procfs %s: gone, in a PID namespace "
                            "this procfs does not show, or hidden by hidepid (procfs: should be "
                            "the host's, readable by hfsampler's user)",
                            pid, label_value(str(self.root)))  # fmt: skip
        except OSError as exc:
            if not quiet:
                self._fault("unreadable", "cannot read %s: %s", label_value(str(base / "stat")),
                            label_value(str(exc)))  # fmt: skip
        except ValueError as exc:
            if not quiet:
                self._fault("odd", "%s: %s", label_value(str(base / "stat")), exc)
        return None

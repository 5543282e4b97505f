"""The sim's consumers: deterministic GPU processes that start and leave every few seconds, and a
made-up procfs tree that names them, so `run --source sim --consumers on` shows consumer series
without a GPU (``ConsumerLists``).

Each simulated GPU has ``per_gpu`` process slots. Slot ``s`` runs one process after another: each
lives ``cycle - 1`` seconds (the cycle is 5 to 8 s, by slot), then the slot is idle for a second,
so consumers start and leave all the time. A process's SM utilisation is its GPU's
``DCGM_FI_DEV_GPU_UTIL`` times its slot's weight over all slots' (weights ``per_gpu - s``), its
memory ``DCGM_FI_DEV_FB_USED`` times the same: with every slot busy they add up to the GPU's own.
Utilisation is sampled every 100 ms, as the driver does. Who a process is rotates with the slot
and the process: a Slurm job (cgroup v2), a Kubernetes pod's container (systemd driver,
containerd), a systemd service, a user's command.

The tree is written under ``procfs`` (``/proc/PID/{stat,status,cgroup}`` and pid 1 in the host's
PID namespace) only where that directory is the sim's: missing, empty, or holding the marker file
``MARKER``; this user's, that no one else may write in (they could put links where it writes);
and not another run's (a run holds a ``flock`` on the marker while it runs: a second run on the
same directory would delete the first's processes and write its own over them); a real procfs
is never written to (its pids are looked up as they are, and the sim's,
above 3 000 000, are not there: their consumer is unknown). A process's files stay ``GRACE_S``
after it left, as a real procfs would not: a window's lookup then still finds a process that
started and left inside the window.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfsampler.consumers.procfs import INIT_PID_NS
from hfsampler.consumers.split import WindowUse
from hfsampler.fields import FB_USED, GPU_UTIL
from hfsampler.sources.base import DeviceInfo
from hfsampler.sources.sim.source import SimSource

log = logging.getLogger(__name__)

MARKER = ".hfsampler-sim-procfs"
PID_BASE = 3_000_000  # above what a default pid_max (4 194 304 at most) hands out soon
PID_SPAN = 1_000_000
DEFAULT_PER_GPU = 3
UTIL_PERIOD_NS = 100_000_000  # the driver's per-process samples come every 100 ms
GRACE_S = 5.0
TICKS_PER_S = 100  # USER_HZ: /proc/PID/stat's start time unit
MIB = float(1 << 20)
S = 1_000_000_000


@dataclass(frozen=True, slots=True)
class SimProcess:
    """One sim process: where it runs, when, and who it is (its cgroup line, command, user)."""

    pid: int
    gpu: int
    slot: int
    start_ns: int
    end_ns: int
    cgroup: str
    comm: str
    uid: int


class SimConsumerLists:
    """``ConsumerLists`` of the sim: see the module's docstring. ``clock_ns``: the run's clock
    (a test's virtual one)."""

    def __init__(
        self,
        gpus: int,
        seed: int,
        procfs: str,
        clock_ns: Callable[[], int],
        per_gpu: int = DEFAULT_PER_GPU,
    ) -> None:
        self.gpus = gpus
        self.seed = seed
        self.per_gpu = per_gpu
        self._clock_ns = clock_ns
        self._sim = SimSource(gpus=gpus, seed=seed)
        self._weights = np.arange(per_gpu, 0, -1, dtype=np.float64) / (per_gpu * (per_gpu + 1) / 2)
        self._root = Path(procfs)
        self._lock_fd = _claim(self._root)
        self._writable = self._lock_fd is not None
        self._written: dict[int, SimProcess] = {}
        self._rows: dict[tuple[int, int], int] = {}  # (gpu, slot) -> the row it runs on
        self._since_ns: int | None = None
        self._reads = 0
        self._samples: dict[int, list[tuple[int, int, float]]] = {}
        self._entries: dict[int, list[tuple[int, int, float | None]]] = {}

    def set_devices(self, devices: Sequence[DeviceInfo]) -> None:
        """A GPU's slots run on its own row, or round robin on its MIG instances' rows."""
        rows: dict[tuple[int, int], int] = {}
        for g in range(self.gpus):
            held = [r for r, d in enumerate(devices) if d.index == g and d.mig is not None]
            own = next((r for r, d in enumerate(devices) if d.index == g and d.is_gpu), None)
            for s in range(self.per_gpu):
                row = held[s % len(held)] if held else own
                if row is not None:
                    rows[(g, s)] = row
        self._rows = rows
        self._samples = {r: [] for r in set(rows.values())}
        self._entries = {r: [] for r in set(rows.values())}

    def process(self, gpu: int, slot: int, t_ns: int) -> SimProcess | None:
        """The process in a slot at ``t_ns``, None while it is idle."""
        cycle_ns = (5 + slot % 4) * S
        offset_ns = ((gpu * 7 + slot * 3) % 5) * S
        j, into = divmod(t_ns - offset_ns, cycle_ns)
        if into >= cycle_ns - S:
            return None
        start = t_ns - into
        number = gpu * self.per_gpu + slot
        span = max(PID_SPAN // max(self.gpus * self.per_gpu, 1), 1)
        pid = PID_BASE + number + (j % span) * self.gpus * self.per_gpu
        kind = (slot + j) % 4
        if kind == 0:
            job = 100_000 + (number * 7919 + j) % 900_000
            cgroup = f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0"
            comm = "train"
        elif kind == 1:
            uid = uuid.uuid5(uuid.NAMESPACE_OID, f"hfsampler-sim/{self.seed}/{number}/{j}")
            container = (uid.hex * 2)[:64]
            under = str(uid).replace("-", "_")
            cgroup = (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{under}"
                      f".slice/cri-containerd-{container}.scope")  # fmt: skip
            comm = "python3"
        elif kind == 2:
            cgroup, comm = f"0::/system.slice/sim-inference-{gpu}-{slot}.service", "server"
        else:
            cgroup, comm = "0::/", "notebook"
        return SimProcess(pid, gpu, slot, start, start + cycle_ns - S, cgroup + "\n", comm,
                          1000 + slot)  # fmt: skip

    def read(self) -> None:
        now = self._clock_ns()
        self._reads += 1
        since = self._since_ns if self._since_ns is not None else now - UTIL_PERIOD_NS
        instants = np.arange(since - since % UTIL_PERIOD_NS + UTIL_PERIOD_NS, now + 1,
                             UTIL_PERIOD_NS, dtype=np.int64)  # fmt: skip
        self._since_ns = now
        present: list[SimProcess] = []
        for (g, s), row in self._rows.items():
            for t in instants.tolist():
                p = self.process(g, s, t)
                if p is not None:
                    util = float(self._sim.value_at(GPU_UTIL.names[0], t, g))
                    self._samples[row].append((p.pid, t // 1000, util * self._weights[s]))
            p = self.process(g, s, now)
            if p is not None:
                present.append(p)
                used_mib = float(self._sim.value_at(FB_USED.names[0], now, g))
                self._entries[row].append((p.pid, self._reads, used_mib * MIB * self._weights[s]))
        if self._writable:
            self._write_tree(present, now)

    def take(self) -> dict[int, WindowUse]:
        out = {r: WindowUse.of(0.0, self._samples[r], self._entries[r]) for r in self._samples}
        self._samples = {r: [] for r in self._samples}
        self._entries = {r: [] for r in self._entries}
        return out

    def close(self) -> None:
        self._sim.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the flock goes with it: a later run may take the tree
            self._lock_fd = None

    def _write_tree(self, present: list[SimProcess], now_ns: int) -> None:
        for p in present:
            if p.pid in self._written and self._written[p.pid].start_ns == p.start_ns:
                continue
            _write_process(self._root, p)
            self._written[p.pid] = p
        gone = [p for p in self._written.values() if now_ns - p.end_ns > GRACE_S * S]
        for p in gone:
            shutil.rmtree(self._root / str(p.pid), ignore_errors=True)
            del self._written[p.pid]


def _lock(marker: Path) -> int | None:
    """The marker's descriptor with an exclusive flock on it; None where another run holds it."""
    fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _claim(root: Path) -> int | None:
    """The locked marker's descriptor where the sim may write its tree at ``root`` (its own, or
    nothing there yet); None where it may not."""
    fd: int | None = None
    try:
        if root.is_dir() and _not_ours(root):
            return None
        if root.is_dir() and (root / MARKER).exists():
            fd = _lock(root / MARKER)
            if fd is None:
                log.info("procfs %s is another run's made-up tree: its processes are looked up "
                         "there as they are; give this run a directory of its own",
                         root)  # fmt: skip
                return None
            for child in root.iterdir():  # a tree from an earlier run: its processes are gone
                if child.is_dir() and child.name.isdigit() and child.name != "1":
                    shutil.rmtree(child, ignore_errors=True)
            return fd
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            log.info("procfs %s is not the sim's (no %s): its processes are looked up there as "
                     "they are; give procfs: an empty directory to see the sim's consumers",
                     root, MARKER)  # fmt: skip
            return None
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        if _not_ours(root):  # made by someone else a moment ago
            return None
        fd = _lock(root / MARKER)
        if fd is None:  # another run made it a moment ago
            return None
        os.write(fd, b"a made-up procfs tree of hfsampler's sim source\n")
        _write_process(root, SimProcess(1, -1, -1, 0, 0, "0::/init.scope\n", "systemd", 0))
        return fd
    except OSError as exc:
        log.warning("cannot write the sim's procfs tree at %s: %s", root, exc.strerror)
        if fd is not None:
            os.close(fd)
        return None


def _not_ours(root: Path) -> bool:
    """Whether ``root`` is another user's, or others may write in it: they could put a link
    where the sim writes a process (its pids are predictable), and have it write, as this user,
    wherever the link points. Said once; the sim then writes nothing there."""
    st = root.stat()
    others_write = st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid())
    if st.st_uid == os.geteuid() and not others_write:
        return False
    log.warning("procfs %s is not the sim's to write: it belongs to uid %d or others may write "
                "in it (mode %o); its processes are looked up there as they are; give procfs: "
                "an empty directory of your own", root, st.st_uid, st.st_mode & 0o777)  # fmt: skip
    return True


def _write_process(root: Path, p: SimProcess) -> None:
    d = root / str(p.pid)
    (d / "ns").mkdir(parents=True, exist_ok=True)
    start_ticks = max(p.start_ns, 0) * TICKS_PER_S // S + 1
    fields = ["S", "1", str(p.pid), str(p.pid), "0", "-1", "4194560", *["0"] * 12,
              str(start_ticks), *["0"] * 30]  # fmt: skip
    (d / "stat").write_text(f"{p.pid} ({p.comm}) " + " ".join(fields) + "\n")
    (d / "status").write_text(f"Name:\t{p.comm}\nUid:\t{p.uid}\t{p.uid}\t{p.uid}\t{p.uid}\n")
    (d / "cgroup").write_text(p.cgroup)
    link = d / "ns" / "pid"
    if link.is_symlink():
        link.unlink()
    os.symlink(INIT_PID_NS, link)

"""The spool's faults, each on real files: a second process on one directory, a full disk
(a real, small tmpfs), damaged records, segment headers and ack files, a kill -9."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_rw_spool import Drops, decode, eventually, take_all, window

from hfsampler.remote_write import spool as spool_module
from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.segment import recover
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.series import SeriesRegistry

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops

REG = SeriesRegistry()
WIDE = [
    REG.series("DCGM_FI_DEV_FB_USED", {"gpu": str(i), "UUID": f"GPU-{i:08x}"}) for i in range(50)
]
LOGGER = "hfsampler.remote_write.spool"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def stamps_of(got: list[tuple[str, int, float]], gpu: str = "0") -> list[int]:
    return [ts for g, ts, _ in got if g == gpu]


def only_segment(root: Path) -> Path:
    (seg,) = root.glob("*.seg")
    return seg


def damage(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


async def fill_and_close(root: Path, windows: int, acked_windows: int = 0) -> None:
    """``windows`` windows of 10 samples spooled, the first ``acked_windows`` delivered."""
    q = SpoolQueue(root, 1000, 1 << 30, Drops())
    for t in range(1, windows + 1):
        q.put(window(1000 * t))
    for _ in range(acked_windows):
        batch = await q.get_batch(10, 0.0)
        assert batch.count == 10
        q.ack(batch)
    await q.close()


def warnings_about(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno >= logging.WARNING and word in r.getMessage()
    ]


# -- two processes on one directory ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, path.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no {text!r} in {path.read_text()}"
        time.sleep(0.05)


def test_second_process_on_one_queue_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    """Two ``hfsampler run`` on one ``--queue-dir``: the second stops before sampling."""
    qdir = tmp_path / "queue"
    dead = f"http://127.0.0.1:{_free_port()}/api/v1/write"
    args = [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--gpus", "1",
            "--listen", "", "--queue-dir", str(qdir), "--remote-write", dead]  # fmt: skip
    log_path = tmp_path / "first.log"
    with open(log_path, "wb") as log:
        first = subprocess.Popen([*args, "--duration", "60s"], stdout=log, stderr=log, env=ENV)
    try:
        _wait_for(log_path, "sampling", first, 30)
        second = subprocess.run(
            [*args, "--duration", "3s"], capture_output=True, text=True, timeout=60, env=ENV
        )
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=30) == 0, log_path.read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode == 2, second.stderr
    errors = [line for line in second.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, second.stderr
    assert str(qdir) in errors[0]
    assert f"pid {first.pid}" in errors[0]
    assert "sampling" not in second.stderr  # refused before the sampler started


CHILD_HOLDS = """
import asyncio, sys
from pathlib import Path
from hfsampler.remote_write.segment import recover
from hfsampler.remote_write.spool import SpoolQueue
q = SpoolQueue(Path(sys.argv[1]), 10, 1 << 20)
print("ready", flush=True)
sys.stdin.read()
asyncio.run(q.close())
"""


def test_spool_directory_is_held_by_one_process(tmp_path: Path) -> None:
    from hfsampler.errors import ConfigError, QueueDirLockedError

    with subprocess.Popen(
        [sys.executable, "-c", CHILD_HOLDS, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV,
    ) as holder:  # fmt: skip
        assert holder.stdin is not None
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(QueueDirLockedError, match=rf"{tmp_path}.*pid {holder.pid}") as info:
            SpoolQueue(tmp_path, 10, 1 << 20)
        assert isinstance(info.value, ConfigError)  # exit 2, one line, from the CLI
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    # Once the holder has gone, the directory is free again.
    asyncio.run(SpoolQueue(tmp_path, 10, 1 << 20).close())


CHILD_KILLED = """
import asyncio, os, signal, sys
from pathlib import Path
from hfsampler.remote_write.encoder import Encoder, QueuedSample
from hfsampler.remote_write.segment import recover
from hfsampler.remote_write.spool import SpoolQueue
from hfsampler.series import SeriesRegistry

series = [SeriesRegistry().series("DCGM_FI_DEV_POWER_USAGE", {"gpu": str(i)}) for i in range(10)]

async def main() -> None:
    q = SpoolQueue(Path(sys.argv[1]), 10, 1 << 20)
    for t in range(1, 11):
        samples = [QueuedSample(s, float(t), 1000 * t) for s in series]
        q.put(Encoder().block(samples))
    while q.memory_samples > 10:  # only written records leave memory
        await asyncio.sleep(0.005)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_kill_9_keeps_what_was_written_and_frees_the_directory(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD_KILLED, str(tmp_path)], env=ENV, timeout=60, check=False
    )
    assert child.returncode == -signal.SIGKILL

    async def scenario() -> None:
        q = SpoolQueue(tmp_path, 1000, 1 << 20)
        assert len(q) == 100
        assert sorted(set(stamps_of(await take_all(q)))) == [1000 * t for t in range(1, 11)]
        await q.close()

    asyncio.run(scenario())


# -- damage ------------------------------------------------------------------------------------


async def test_damaged_record_costs_that_record_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await fill_and_close(tmp_path, 20)
    seg = only_segment(tmp_path)
    tenth = recover(tmp_path).segments[0].offsets[9]
    at = tenth + 40  # in the tenth record's payload, past its header
    damage(seg, at, bytes([seg.read_bytes()[at] ^ 0xFF]))  # one flipped byte
    drops = Drops()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        q = SpoolQueue(tmp_path, 1000, 1 << 30, drops)
    got = await take_all(q)
    await q.close()
    stamps = stamps_of(got)
    assert stamps == [1000 * t for t in range(1, 21) if t != 10]
    assert drops.by_reason == {"corrupt": 10}  # the record's header held: its samples are known
    (said,) = warnings_about(caplog, "damaged")
    assert f"at {tenth}-" in said  # where, in bytes


async def test_damage_across_a_record_header_resynchronises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await fill_and_close(tmp_path, 20)
    seventh = recover(tmp_path).segments[0].offsets[6]
    # The end of the sixth record and the header of the seventh: zeroed.
    damage(only_segment(tmp_path), seventh - 20, b"\0" * 48)
    drops = Drops()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        q = SpoolQueue(tmp_path, 1000, 1 << 30, drops)
    stamps = stamps_of(await take_all(q))
    await q.close()
    assert stamps == [1000 * t for t in range(1, 21) if t not in (6, 7)]
    assert drops.by_reason == {"corrupt": 10}  # the sixth's header held; the seventh's did not
    (said,) = warnings_about(caplog, "damaged")
    assert "unknown" in said  # and the log says that what it held is not known


async def test_damaged_segment_header_keeps_its_records(tmp_path: Path) -> None:
    await fill_and_close(tmp_path, 20)
    damage(only_segment(tmp_path), 0, b"\0\0")  # two bytes at the head
    q = SpoolQueue(tmp_path, 1000, 1 << 30, Drops())
    stamps = stamps_of(await take_all(q))
    await q.close()
    assert stamps == [1000 * t for t in range(1, 21)]


@pytest.mark.parametrize("garble", [b"\xa5", b"\0"])
async def test_garbled_ack_file_replays_everything(
    tmp_path: Path, garble: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    await fill_and_close(tmp_path, 40, acked_windows=10)
    ack = tmp_path / "acked"
    ack.write_bytes(garble * ack.stat().st_size)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        q = SpoolQueue(tmp_path, 1000, 1 << 30, Drops())
    stamps = stamps_of(await take_all(q))
    await q.close()
    # At least once: the 30 undelivered windows all come, the 10 delivered ones may come again.
    assert set(range(11_000, 41_000, 1000)) <= set(stamps)
    assert stamps == sorted(set(stamps))
    assert warnings_about(caplog, "ack")


async def test_a_good_ack_file_is_kept(tmp_path: Path) -> None:
    await fill_and_close(tmp_path, 40, acked_windows=10)
    q = SpoolQueue(tmp_path, 1000, 1 << 30, Drops())
    assert len(q) == 300
    await q.close()


async def test_record_damaged_after_the_start_costs_that_record_only(tmp_path: Path) -> None:
    drops = Drops()
    q = SpoolQueue(tmp_path, 10, 1 << 30, drops)  # memory: one window; the rest read back
    for t in range(1, 21):
        q.put(window(1000 * t))
    await eventually(lambda: q.memory_samples <= 10)
    seg = only_segment(tmp_path)
    middle = seg.stat().st_size // 2
    damage(seg, middle, bytes([seg.read_bytes()[middle] ^ 0xFF]))
    stamps = stamps_of(await take_all(q))
    await q.close()
    assert len(stamps) == 19
    assert stamps[-1] == 20_000
    assert drops.by_reason == {"corrupt": 10}


# -- a full disk: a real file system of 256 KiB ------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "fs"
    mnt.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {mount.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(fs: Path) -> None:
    """Take every free byte of ``fs`` with one file."""
    with open(fs / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\xee" * chunk)
            except OSError:
                pass


def wide_window(ts: int) -> Block:
    from hfsampler.remote_write.encoder import Encoder, QueuedSample

    samples = [QueuedSample(s, float(ts % 977 + i), ts) for i, s in enumerate(WIDE)]
    return Encoder().block(samples)


async def deliver_all(q: SpoolQueue) -> list[tuple[str, int, float]]:
    """What a receiver that is back gets: every queued batch, acknowledged."""
    got = []
    while len(q):
        batch = await q.get_batch(500, 0.0)
        got.extend(decode(batch))
        q.ack(batch)
    return got


@pytest.mark.alone  # it measures time: no other test runs meanwhile
async def test_full_disk_is_a_state_not_a_loop(
    small_fs: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        spool_module, "RETRY_S", 0.01, raising=False
    )  # how often a full disk is tried again
    capacity = 2000  # samples: 40 windows
    root = small_fs / "shard-0"
    drops = Drops()
    put = t = 0
    with caplog.at_level(logging.INFO, logger=LOGGER):
        q = SpoolQueue(root, capacity, 1 << 30, drops)
        # Receiver down: windows are spooled until the file system is full, and long after.
        while not drops.by_reason.get("disk_full"):
            t += 1
            q.put(wide_window(1000 * t))
            put += 50
            await asyncio.sleep(0.001)
            assert t < 5000, "nothing was dropped on the full disk: memory only grew"
        for _ in range(300):
            t += 1
            q.put(wide_window(1000 * t))
            put += 50
            await asyncio.sleep(0.001)
            assert q.memory_samples <= capacity + 50
        errors = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        # Receiver back: everything is delivered, and every segment goes, the last one too.
        newest = 1000 * t
        got = await deliver_all(q)
        await eventually(lambda: not list(root.glob("*.seg")))
        assert q.disk_bytes == 0
        # Space is back: new windows are written again, said once.
        for _ in range(10):
            t += 1
            q.put(wide_window(1000 * t))
            put += 50
        await eventually(lambda: bool(list(root.glob("*.seg"))) and q.memory_samples <= 500)
        await q.close()
    resumed = [r for r in caplog.records if r.name == LOGGER and "writing again" in r.getMessage()]
    assert len(resumed) == 1, [r.getMessage() for r in caplog.records]
    stamps = stamps_of(got)
    assert stamps == sorted(set(stamps))  # in order, nothing twice
    assert stamps[0] == 1000  # what was on disk stayed there
    assert newest in stamps  # what was dropped in memory was the oldest, never the newest
    q2 = SpoolQueue(root, capacity, 1 << 30, Drops())
    left = len(q2)
    await q2.close()
    assert left == 500  # the ten new windows; nothing delivered comes back
    assert len(got) + drops.by_reason["disk_full"] + left == put


async def test_a_disk_with_room_for_one_record_is_one_episode(
    small_fs: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full tmpfs still has the slack of a segment's last page: the one record tried after a
    refusal fits there (about 1 KB here, three of them in 4 KiB), the append after it does not.
    That is one full disk, said once, not an error and a "writing again" each time."""
    monkeypatch.setattr(spool_module, "RETRY_S", 0.01)
    root = small_fs / "shard-0"
    drops = Drops()

    def said(word: str) -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name == LOGGER and word in r.getMessage()
        ]

    with caplog.at_level(logging.INFO, logger=LOGGER):
        q = SpoolQueue(root, 500, 1 << 30, drops)
        q.put(wide_window(1000))
        await eventually(lambda: q.disk_bytes > 0)  # a segment, its last page mostly free
        first = q.disk_bytes
        fill(small_fs)
        put = 50
        for t in range(2, 14):  # one append, too big for the slack
            q.put(wide_window(1000 * t))
            put += 50
        # a second record fitted: it was tried only after an append following the first failed
        await eventually(lambda: q.disk_bytes > first + 1900)
        assert len(said("cannot write")) == 1, said("")
        assert said("writing again") == []
        got = await deliver_all(q)
        (small_fs / "filler").unlink()
        for t in range(14, 17):  # the one record tried, then an append: the disk is back
            q.put(wide_window(1000 * t))
            put += 50
        await eventually(lambda: bool(said("writing again")))
        got += await deliver_all(q)
        await q.close()
    assert len(said("writing again")) == 1, said("")
    assert len(said("cannot write")) == 1, said("")
    assert len(got) + drops.by_reason.get("disk_full", 0) == put


async def test_acknowledgements_are_kept_on_a_full_disk(small_fs: Path) -> None:
    root = small_fs / "shard-0"
    q = SpoolQueue(root, 10, 1 << 30, Drops())
    for t in range(1, 41):
        q.put(window(1000 * t))
    await eventually(lambda: q.memory_samples <= 10)  # all 40 written
    fill(small_fs)
    for _ in range(29):  # the receiver takes 29 windows while nothing more fits on the disk
        batch = await q.get_batch(10, 0.0)
        assert batch.count == 10
        q.ack(batch)
    await q.close()
    q2 = SpoolQueue(root, 10, 1 << 30, Drops())
    left = stamps_of(await take_all(q2))
    await q2.close()
    assert left == [1000 * t for t in range(30, 41)]  # the 29 delivered are not sent again

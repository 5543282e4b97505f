"""``hfsampler.markers`` and the recorder's socket: the wire between them, garbage and all."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from hfsampler import markers
from hfsampler.errors import ConfigError
from hfsampler.profiling.job_markers import (
    MAX_LINE_BYTES,
    LineSplitter,
    MarkerSocket,
    compile_patterns,
    pattern_marker,
)
from hfsampler.profiling.recording_format import Marker

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def inbox(monkeypatch: pytest.MonkeyPatch) -> MarkerSocket:
    sock = MarkerSocket()
    monkeypatch.setenv(markers.ENV, str(sock.path))
    yield sock  # type: ignore[misc]
    sock.close()


def _arrived(inbox: MarkerSocket, n: int) -> list[Marker]:
    """What the socket's reading thread has taken once ``n`` datagrams arrived (30 s at most)."""
    deadline = time.monotonic() + 30
    while inbox.received + inbox.rejected < n and time.monotonic() < deadline:
        time.sleep(0.001)
    return inbox.drain()


def test_importable_without_numpy_and_silent_without_a_recorder(tmp_path: Path) -> None:
    """The training script imports only the stdlib; no recorder, or one gone: no error."""
    code = f"""
import sys
class NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ImportError("numpy is hidden")
sys.meta_path.insert(0, NoNumpy())
import os
from hfsampler import markers
assert "numpy" not in sys.modules
assert not markers.enabled()
assert markers.mark("x") is False and markers.dropped() == 0  # outside record: a no-op
os.environ[markers.ENV] = {str(tmp_path / "gone.sock")!r}
with markers.phase("p"):
    markers.step(3)
@markers.phase("decorated")
def f():
    return 7
assert f() == 7
print(markers.sent(), markers.dropped(), sorted(m for m in sys.modules if m.startswith("hfs")))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(markers.ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().split(maxsplit=2) == ["0", "5", "['hfsampler', 'hfsampler.markers']"]


def test_events_arrive_as_markers_in_order(inbox: MarkerSocket) -> None:
    before = time.time_ns()
    with markers.phase("epoch 3"):
        assert markers.step(12)
        markers.mark("eval\tloss")  # a control character becomes a space
    markers.mark("x" * 1000)  # cut to the longest name
    got = _arrived(inbox, 5)
    assert [(m.kind, m.name, m.step) for m in got] == [
        ("begin", "epoch 3", None), ("step", "step", 12), ("mark", "eval loss", None),
        ("end", "epoch 3", None), ("mark", "x" * markers.MAX_NAME_CHARS, None),
    ]  # fmt: skip
    assert all(m.pid == os.getpid() and m.source == "api" for m in got)
    times = [m.t_ns for m in got]
    assert times == sorted(times)
    assert before <= times[0] <= time.time_ns()
    assert inbox.rejected == 0


def test_phase_ends_on_an_exception(inbox: MarkerSocket) -> None:
    with pytest.raises(KeyError), markers.phase("load"):
        raise KeyError("boom")
    assert [(m.kind, m.name) for m in _arrived(inbox, 2)] == [("begin", "load"), ("end", "load")]


class _BadStr:
    def __str__(self) -> str:
        raise RuntimeError("boom")


def test_invalid_calls_never_raise_they_are_dropped_and_counted(inbox: MarkerSocket) -> None:
    """What the recorder would refuse is dropped in the client, counted, and said with the next
    event; the README promises the calls never raise."""
    dropped0 = markers.dropped()
    invalid = [
        lambda: markers.step(-1), lambda: markers.step(2**63), lambda: markers.step(2**70),
        lambda: markers.step("x"), lambda: markers.step(1.0), lambda: markers.step(True),  # type: ignore[arg-type]
        lambda: markers.mark(_BadStr()),  # type: ignore[arg-type]
    ]  # fmt: skip
    assert [call() for call in invalid] == [False] * len(invalid)
    with markers.phase(_BadStr()):  # type: ignore[arg-type]
        pass  # its begin and end: two more
    assert markers.dropped() - dropped0 == len(invalid) + 2
    assert markers.step(2**63 - 1)
    (got,) = _arrived(inbox, 1)
    assert got.step == 2**63 - 1
    assert inbox.rejected == 0
    assert inbox.job_dropped[os.getpid()] == markers.dropped()


def test_one_cleaning_rule_for_names() -> None:
    clean = markers.clean_name
    assert clean("\x1b[32mEpoch 1\x1b[0m\x07") == "Epoch 1"  # colours gone, BEL a space
    assert clean("\x1b]0;title\x07saving") == "saving"  # a terminal title
    assert clean("a\x9bb\u202ec\u2028d\x00e") == "a b c d e"  # C1, bidi, separator, NUL
    assert clean("   \t ") == ""
    assert clean("x" * 300 + "y") == "x" * markers.MAX_NAME_CHARS
    assert clean("x" * 255 + " y") == "x" * 255  # cut, then no trailing space
    assert clean("a\udcff") == "a"
    for text in ("\x1b[1;31mé\x1b", "a\u202e" * 200, " b " * 100):
        assert clean(clean(text)) == clean(text)  # the recorder checks names with it


def test_a_signal_handler_that_marks_while_a_call_sends_does_not_deadlock(
    inbox: MarkerSocket,
) -> None:
    """The handler runs inside the main thread's send (forced there); it hands its event over
    and returns, and the interrupted call sends it."""
    code = """
import os, signal
from hfsampler import markers
signal.signal(signal.SIGUSR1, lambda *_: print("handler", markers.mark("preempted")))
send = markers._sender._send
def send_interrupted(*args):
    if not getattr(send_interrupted, "done", False):
        send_interrupted.done = True
        signal.raise_signal(signal.SIGUSR1)  # the handler runs here, the lock held
    return send(*args)
markers._sender._send = send_interrupted
print("main", markers.step(7))
print(markers.sent(), markers.dropped(), markers.waiting())
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["handler True", "main True", "2 0 0"]
    assert sorted((m.kind, m.name) for m in _arrived(inbox, 2)) == [
        ("mark", "preempted"), ("step", "step")
    ]  # fmt: skip


def test_phase_decorates_coroutines_and_refuses_generators(inbox: MarkerSocket) -> None:
    @markers.phase("evaluate")
    async def evaluate() -> int:
        await asyncio.sleep(0.2)
        return 3

    assert asyncio.run(evaluate()) == 3
    begin, end = _arrived(inbox, 2)
    assert (begin.kind, end.kind) == ("begin", "end")
    assert end.t_ns - begin.t_ns >= 0.2e9  # the phase lasts as long as the coroutine
    with pytest.raises(TypeError, match="generator"):

        @markers.phase("batches")
        def batches() -> Iterator[int]:
            yield 1

    with pytest.raises(TypeError, match="generator"):

        @markers.phase("stream")
        async def stream() -> AsyncIterator[int]:
            yield 1


def test_drops_not_yet_told_are_sent_at_exit(inbox: MarkerSocket) -> None:
    code = """
from hfsampler import markers
assert markers.mark("first")
for n in (-1, -2, -3):
    markers.step(n)  # dropped, counted; no later event would carry the count
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [m.name for m in _arrived(inbox, 1)] == ["first"]
    inbox.close()  # reads what is still queued
    assert inbox.dropped_by_job == 3
    assert inbox.rejected == 0


def test_socket_is_private_and_removed_on_close() -> None:
    sock = MarkerSocket()
    assert stat.S_IMODE(sock.directory.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(sock.path.stat().st_mode)
    sock.close()
    sock.close()
    assert not sock.directory.exists()


def test_threads_lose_nothing_unaccounted(inbox: MarkerSocket) -> None:
    """Many threads at once: every event either reaches the recorder whole or is counted."""
    sent0, dropped0 = markers.sent(), markers.dropped()

    def sender(base: int) -> None:
        for i in range(300):
            markers.step(base + i)

    senders = [threading.Thread(target=sender, args=(k * 1000,)) for k in range(6)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    assert markers.flush(wait_s=10) == 0
    sent, dropped = markers.sent() - sent0, markers.dropped() - dropped0
    assert sent + dropped == 1800
    received = [m.step for m in _arrived(inbox, sent)]
    assert len(received) == sent
    assert len(set(received)) == sent
    assert inbox.rejected == 0
    assert inbox.dropped_by_job == markers.dropped()


def test_a_full_queue_or_a_gone_recorder_drops_never_blocks(inbox: MarkerSocket) -> None:
    sent0, dropped0 = markers.sent(), markers.dropped()
    results = [markers.mark("flood") for _ in range(50_000)]  # faster than any reader
    assert markers.waiting() <= markers.BACKLOG_EVENTS  # what waits is bounded
    assert markers.dropped() - dropped0 == results.count(False)
    markers.flush(wait_s=10)
    sent = markers.sent() - sent0
    assert sent + markers.dropped() - dropped0 == 50_000
    assert len(_arrived(inbox, sent)) == sent
    inbox.close()  # the recorder is gone
    assert markers.mark("late") is False


def test_a_batch_with_bad_events_keeps_the_good_ones(inbox: MarkerSocket) -> None:
    now = time.time_ns()
    good = {"t_ns": now, "kind": "mark", "name": "ok", "step": None}
    batch = {"v": 2, "pid": 9, "dropped": 4,
             "events": [good, {**good, "kind": "boom"}, {**good, "name": "\x1b[2J"}, 7,
                        {**good, "kind": "step", "name": "step", "step": 5}]}  # fmt: skip
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps(batch).encode(), str(inbox.path))
    got = _arrived(inbox, 5)
    assert [(m.kind, m.step, m.pid) for m in got] == [("mark", None, 9), ("step", 5, 9)]
    assert inbox.rejected == 3
    assert inbox.job_dropped == {9: 4}


def test_a_forked_child_sends_with_its_own_pid(inbox: MarkerSocket) -> None:
    markers.mark("parent")
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        ok = markers.mark("child") and markers.sent() == 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got = _arrived(inbox, 2)
    assert [(m.name, m.pid) for m in got] == [("parent", os.getpid()), ("child", pid)]


HOSTILE = [
    b"",
    b"\xff\xfe\x00garbage",
    b"[1, 2]",
    b'"just a string"',
    b"{" * 3000,
    json.dumps(
        {"v": 2, "t_ns": 1, "kind": "mark", "name": "a", "step": None, "pid": 1, "dropped": 0}
    ).encode(),
    b'{"v":1,"t_ns":1,"kind":"mark","name":"a","step":null,"pid":1,"dropped":0}',  # long ago
    b'{"v":1,"t_ns":NOW,"kind":"explode","name":"a","step":null,"pid":1,"dropped":0}',
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"\\u001b[2J","step":null,"pid":1,"dropped":0}',
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"","step":null,"pid":1,"dropped":0}',
    b'{"v":1,"t_ns":NOW,"kind":"step","name":"step","step":true,"pid":1,"dropped":0}',
    b'{"v":1,"t_ns":NOW,"kind":"step","name":"step","step":-4,"pid":1,"dropped":0}',
    b'{"v":1,"t_ns":NOW,"kind":"step","name":"step","step":9223372036854775808,"pid":1,"dropped":0}',
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"a","step":3,"pid":1,"dropped":0}',
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"a","step":null,"pid":"me"}',
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"a","step":null,"pid":1,"dropped":0,"extra":1}',
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"a","step":null,"pid":1,"dropped":-1}',
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"a","step":null,"pid":1}',  # no "dropped"
    b'{"v":1,"t_ns":NOW,"kind":"mark","name":"a","step":null,"pid":1,"dropped":0}' + b" " * 40_000,
]


def test_hostile_datagrams_are_counted_logged_once_escaped(
    inbox: MarkerSocket, caplog: pytest.LogCaptureFixture
) -> None:
    now = str(time.time_ns()).encode()
    ok = b'{"v":1,"t_ns":NOW,"kind":"mark","name":"ok","step":null,"pid":1,"dropped":0}'
    with (
        caplog.at_level(logging.WARNING, "hfsampler.profiling.job_markers"),
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s,
    ):
        for data in [*HOSTILE, ok]:
            s.sendto(data.replace(b"NOW", now), str(inbox.path))  # blocks while the queue is full
        got = _arrived(inbox, len(HOSTILE) + 1)
    assert [m.name for m in got] == ["ok"]
    assert inbox.rejected == len(HOSTILE)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "not a marker" in warnings[0]
    assert all(c.isprintable() for c in warnings[0])


def test_pattern_kinds() -> None:
    step, phase, mark, named, edge = compile_patterns([
        r"step (?P<step>\d+)", r"(?P<phase>Epoch \d+)", r"saving", r"ckpt (?P<name>\w+)",
        r"(?P<begin>eval) started|(?P<end>eval) done",
    ])  # fmt: skip

    def kinds(pattern: object, line: str, open_phase: str | None = None) -> list[tuple[str, str]]:
        m = pattern.search(line)  # type: ignore[attr-defined]
        return [(x.kind, x.name) for x in pattern_marker(m, 1, 7, open_phase)]

    assert kinds(step, "step 42 loss 1.0") == [("step", "step")]
    assert pattern_marker(step.search("step 42"), 1, 7, None)[0].step == 42  # type: ignore[arg-type]
    assert kinds(step, f"step {2**63 - 1}") == [("step", "step")]
    assert kinds(step, f"step {2**63}") == []  # more than the recording stores
    assert kinds(step, "step " + "9" * 5000) == []  # more digits than int() takes
    assert kinds(phase, "Epoch 2 of 9") == [("begin", "Epoch 2")]
    assert kinds(phase, "Epoch 3", "Epoch 2") == [("end", "Epoch 2"), ("begin", "Epoch 3")]
    assert kinds(phase, "Epoch 3: 45%|####", "Epoch 3") == []  # a progress bar redrawn
    assert kinds(mark, "saving model") == [("mark", "saving")]
    assert kinds(named, "ckpt best.pt") == [("mark", "best")]
    assert kinds(edge, "eval started") == [("begin", "eval")]
    assert kinds(edge, "eval done") == [("end", "eval")]
    with pytest.raises(ConfigError, match="--mark-pattern"):
        compile_patterns(["(unclosed"])


def test_output_names_take_the_api_rule() -> None:
    colour, empty = compile_patterns([r"(?P<phase>\x1b\[32mEpoch \d+\S*)", ""])
    line = "\x1b[32mEpoch 1\x1b[0m\x07 of 3"
    (began,) = pattern_marker(colour.search(line), 1, 7, None)  # type: ignore[arg-type]
    assert began.name == "Epoch 1"
    (mark,) = pattern_marker(empty.search("anything"), 1, 7, None)  # type: ignore[arg-type]
    assert mark.name == "mark"  # an empty match, an empty pattern: still a name


@pytest.mark.parametrize("seed", range(5))
def test_lines_split_as_a_whole_stream_would_whatever_the_chunks(seed: int) -> None:
    rng = random.Random(seed)
    long_line = b"z" * (MAX_LINE_BYTES * 2 + 5)
    stream = b"".join(
        rng.choice([b"step %d\n" % i, b"bar %d\r" % i, b"\r\n", long_line + b"\n", b"x"])
        for i in range(3000)
    )
    expected = [line[:MAX_LINE_BYTES] for line in stream.replace(b"\r", b"\n").split(b"\n") if line]
    splitter, got, at = LineSplitter(), [], 0
    while at < len(stream):
        size = rng.choice([1, 7, 4096, 65536, 300_000])
        got += splitter.feed(stream[at : at + size])
        at += size
    got += splitter.end()
    assert got == expected


def test_a_forged_drop_count_is_refused(inbox: MarkerSocket) -> None:
    now = time.time_ns()
    event = {"v": 1, "t_ns": now, "kind": "mark", "name": "x", "step": None, "pid": os.getpid()}
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps({**event, "dropped": 10**15}).encode(), str(inbox.path))
        s.sendto(json.dumps({**event, "dropped": 5}).encode(), str(inbox.path))
    got = _arrived(inbox, 2)
    assert len(got) == 1
    assert inbox.rejected == 1
    assert inbox.dropped_by_job == 5


def test_once_watching_a_job_only_its_tree_and_true_pids_are_taken(inbox: MarkerSocket) -> None:
    now = time.time_ns()
    event = {"v": 1, "t_ns": now, "kind": "mark", "name": "x", "step": None, "dropped": 0}
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        inbox.watch(stranger.pid)  # the job: we (the test) are not below it
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps({**event, "pid": os.getpid()}).encode(), str(inbox.path))
            s.sendto(json.dumps({**event, "pid": stranger.pid}).encode(), str(inbox.path))
        assert _arrived(inbox, 2) == []
        assert inbox.rejected == 2  # a foreign pid, and a pid that is not the sender's
    finally:
        stranger.kill()
        stranger.wait()
    inbox.watch(os.getppid())  # now the test is below the job
    markers.mark("mine")
    got = _arrived(inbox, 3)
    assert [(m.name, m.pid) for m in got] == [("mine", os.getpid())]


def _reaped_child() -> int:
    """The pid of a child of ours that has exited and been reaped: gone from /proc."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_reaped_sender_is_vouched_for_by_the_parent_it_names(inbox: MarkerSocket) -> None:
    """A forked child that sent and exited is often reaped before its datagram is read; the
    kernel's pid is then nobody's in /proc, and only the parent a version-3 datagram names can
    place it in the job's tree (taken here as the reader thread would, with the kernel's pid)."""
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    gone, stranger = _reaped_child(), os.getpid()  # we are the job's parent, not below it
    try:
        inbox.watch(job.pid)
        event = {"t_ns": time.time_ns(), "kind": "mark", "name": "x", "step": None}

        def datagram(v: int, pid: int, parent: object) -> bytes:
            if v == 1:
                return json.dumps({"v": 1, **event, "pid": pid, "dropped": 0}).encode()
            return json.dumps({"v": v, "pid": pid, "ppid": parent, "dropped": 0,
                               "events": [event]}).encode()  # fmt: skip

        now = time.time_ns()
        inbox.take(datagram(3, gone, job.pid), now, sender=gone)  # taken
        inbox.take(datagram(1, gone, None), now, sender=gone)  # gone, nobody vouches
        inbox.take(datagram(3, gone, stranger), now, sender=gone)  # its parent: not the job's
        inbox.take(datagram(3, gone, 1), now, sender=gone)  # reparented to init: not the job's
        inbox.take(datagram(3, gone, "me"), now, sender=gone)
        # a live sender is judged by its real parents, whatever it names
        inbox.take(datagram(3, stranger, job.pid), now, sender=stranger)
    finally:
        job.kill()
        job.wait()
    assert [(m.name, m.pid) for m in inbox.drain()] == [("x", gone)]
    assert inbox.rejected == 5


def test_the_parent_is_sent_only_to_a_recorder_that_reads_it(
    inbox: MarkerSocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 3 only when ``record`` says it reads it: an older recorder gets 1 and 2."""
    got: list[bytes] = []
    monkeypatch.setattr(markers._sender, "_send", lambda address, data: got.append(data))
    for newest in ("", "2", "x", "9" * 5000, "3", "4"):
        monkeypatch.setenv(markers.WIRE_ENV, newest)
        markers.mark("m")
    versions = [json.loads(d)["v"] for d in got]
    assert versions == [1, 1, 1, 1, 3, 3]
    last = json.loads(got[-1])
    assert (last["pid"], last["ppid"], len(last["events"])) == (os.getpid(), os.getppid(), 1)

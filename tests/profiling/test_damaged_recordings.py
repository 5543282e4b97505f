"""A recording with flipped bits: the damaged chunks are skipped and counted, reading goes on
from the next good frame, and report, replay and compare say so (replay's status too).

The recording is made and the commands run in this process (``inprocess``): what is checked is
what they read and say, not the process.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from inprocess import hfsampler, record_sim

from hfsampler.profiling.recording import Recording
from hfsampler.profiling.replay import EXIT_DAMAGED


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_sim(tmp_path_factory.mktemp("damaged") / "good.hfs", "--duration", "3s")


def _flip(src: Path, dst: Path, offsets: list[int]) -> Path:
    shutil.copy(src, dst)
    data = bytearray(dst.read_bytes())
    for at in offsets:
        data[at] ^= 0x10
    dst.write_bytes(bytes(data))
    return dst


def _mid_raw_frame(rec: Recording) -> tuple[int, int]:
    """A raw chunk in the middle of the file: a byte inside its payload, and its size."""
    raw = [f for f in rec.frames if f.tag == b"RAW_"]
    frame = raw[len(raw) // 2]
    return frame.offset + frame.length // 2, frame.length + 12


def _mid_raw_chunk(rec: Recording) -> int:
    return _mid_raw_frame(rec)[0]


def test_one_flipped_bit_costs_one_chunk(good: Path, tmp_path: Path) -> None:
    whole = Recording(good)
    at, size = _mid_raw_frame(whole)
    bad = Recording(_flip(good, tmp_path / "bad.hfs", [at]))
    assert bad.damaged_parts == 1
    assert bad.damaged_bytes == size  # that chunk, and nothing after it
    assert len(bad.frames) == len(whole.frames) - 1  # the rest, the end chunk included
    assert bad.end == whole.end
    assert not bad.torn
    assert bad.problem is not None
    assert bad.problem.startswith("damaged:")
    kept = sum(len(c.ts_us) for c in bad.raw_chunks())
    assert kept > 0.5 * sum(len(c.ts_us) for c in whole.raw_chunks())


def test_a_damaged_length_and_a_torn_tail(good: Path, tmp_path: Path) -> None:
    whole = Recording(good)
    frame = [f for f in whole.frames if f.tag == b"WIN_"][3]
    length_byte = frame.offset - 5  # the frame's length field: it now runs elsewhere
    bad = Recording(_flip(good, tmp_path / "len.hfs", [length_byte]))
    assert bad.damaged_parts == 1
    assert len(bad.frames) == len(whole.frames) - 1
    cut = tmp_path / "cut.hfs"
    cut.write_bytes(good.read_bytes()[:-7])  # a crash: the end chunk half written
    torn = Recording(cut)
    assert torn.torn
    assert not torn.damaged_parts
    assert torn.problem == "incomplete: the recorder did not finish"


def test_report_says_it_on_the_terminal_in_both_formats(good: Path, tmp_path: Path) -> None:
    bad = _flip(good, tmp_path / "bad.hfs", [_mid_raw_chunk(Recording(good))])
    for fmt in ("json", "html"):
        done = hfsampler("report", str(bad), "--format", fmt, "-o", str(tmp_path / f"r.{fmt}"))
        assert done.returncode == 0, done.stderr
        notes = [line for line in done.stderr.splitlines() if "damaged" in line]
        assert len(notes) == 1, done.stderr
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["damaged_parts"] == 1
    assert summary["file_problem"].startswith("damaged:")
    assert "DAMAGED:" in (tmp_path / "r.html").read_text()


def test_compare_marks_the_damaged_input(good: Path, tmp_path: Path) -> None:
    bad = _flip(good, tmp_path / "bad.hfs", [_mid_raw_chunk(Recording(good))])
    done = hfsampler("report", str(good), str(bad), "--format", "json")
    assert done.returncode == 0, done.stderr
    assert "damaged" in done.stderr
    data = json.loads(done.stdout)
    assert list(data["inputs_with_problems"]) == ["new"]
    page = tmp_path / "diff.html"
    done = hfsampler("report", str(good), str(bad), "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert "The new recording is damaged" in page.read_text()


class _Accept(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Accept)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/api/v1/write"
    server.shutdown()
    server.server_close()


def test_replay_exits_non_zero_on_damage_or_nothing(
    good: Path, tmp_path: Path, receiver: str
) -> None:
    done = hfsampler("replay", str(good), "--remote-write", receiver)
    assert done.returncode == 0, done.stdout + done.stderr
    whole = Recording(good)
    bad = _flip(good, tmp_path / "bad.hfs", [_mid_raw_chunk(whole)])
    done = hfsampler("replay", str(bad), "--remote-write", receiver, "--raw")
    assert done.returncode == EXIT_DAMAGED, done.stdout + done.stderr
    assert "damaged" in done.stdout
    # every window chunk damaged: nothing to replay is a failure, not "replayed 0 samples", 0
    wins = [f.offset + f.length // 2 for f in whole.frames if f.tag == b"WIN_"]
    none = _flip(good, tmp_path / "none.hfs", wins)
    done = hfsampler("replay", str(none), "--remote-write", receiver)
    assert "replayed 0 samples" in done.stdout
    assert done.returncode == 1, done.stdout + done.stderr

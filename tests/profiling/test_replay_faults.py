"""`hfsampler replay` against a dead receiver gives up at its deadline with a summary, and
Ctrl-C stops it with exit 130 after flushing what it can (it used to retry for minutes, and
exit 0 when interrupted)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/api/v1/write"  # nothing listens there once closed


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replay-faults") / "run.hfs"
    subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "-o",
         str(out), "--", sys.executable, "-c", "import time; time.sleep(2)"],
        env=_env(), check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return out


def test_dead_receiver_gives_up_at_the_deadline(recording: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "hfsampler", "replay", str(recording), "--remote-write",
         _dead_url(), "--timeout", "2s"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-2000:]
    assert took < 15, took
    assert "replayed 0 samples" in done.stdout
    assert "not sent" in done.stdout
    assert "gave up after 2 s" in done.stdout


def test_ctrl_c_flushes_and_exits_130(recording: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "replay", str(recording), "--remote-write",
         _dead_url(), "--timeout", "5m"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # once it is retrying: the warning names the connection failure
        deadline = time.monotonic() + 30
        assert proc.stderr is not None
        for line in proc.stderr:
            if "retrying in" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in out
    assert "replayed 0 samples" in out

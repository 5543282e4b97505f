"""The spool's faults, each on real files: a second process on one directory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


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

"""`hfsampler replay` against a dead receiver gives up at its deadline with a summary, and
Ctrl-C stops it with exit 130 after flushing what it can (it used to retry for minutes, and
exit 0 when interrupted); against one that echoes the request head it says no credential of
the URL (it used to log the ``Basic`` header aiohttp builds from it).

The recording is made and replayed in this process (``inprocess``), but for Ctrl-C: a signal
to a real process.
"""

from __future__ import annotations

import base64
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from inprocess import hfsampler, record_sim

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
    return record_sim(tmp_path_factory.mktemp("replay-faults") / "run.hfs", "--duration", "2s")


def test_dead_receiver_gives_up_at_the_deadline(recording: Path) -> None:
    # Not one of the timing tests: a 2 s deadline against a 15 s bound holds on a busy machine.
    started = time.monotonic()
    done = hfsampler("replay", str(recording), "--remote-write", _dead_url(), "--timeout", "2s")
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-2000:]
    assert took < 15, took
    assert "replayed 0 samples" in done.stdout
    assert "not sent" in done.stdout
    assert "gave up after 2 s" in done.stdout


def test_ctrl_c_flushes_and_exits_130(recording: Path) -> None:
    """A real process: SIGINT as a terminal sends it, and the exit status a shell sees."""
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


class _EchoHead(http.server.BaseHTTPRequestHandler):
    """Answers every POST 401 with the request head as its body, as some proxies do."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = f"POST {self.path}\n{self.headers}".encode()
        self.send_response(401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the test's output is the replay's


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoHead)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_url_credentials_a_receiver_echoes_stay_out_of_the_output(
    recording: Path, echo_port: int
) -> None:
    user, password = "replay-user", "Rep-Pa55-0b9d"
    url = f"http://{user}:{password}@127.0.0.1:{echo_port}/api/v1/write"
    done = hfsampler("replay", str(recording), "--remote-write", url, "--timeout", "10s")
    said = done.stdout + done.stderr
    assert "HTTP 401" in said, said[-2000:]
    assert "Authorization: <secret>" in said
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    for secret in (password, token, f"{user}:{password}"):
        assert secret not in said

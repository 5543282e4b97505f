"""The command line as a user drives it: exit codes, messages, /metrics while it runs.

A command whose status and output are what a test checks runs in this process
(``inprocess.hfsampler``, or ``main`` with capsys); a real process where only one shows it:
an exit status and stderr as a shell sees them, signals, the sampler process, a fresh
interpreter's imports.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import shm_dirs
from inprocess import hfsampler

from hfsampler.cli.main import main

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

small_shm = shm_dirs.small_shm
shm_dir = shm_dirs.shm_dir


def _scrape_until_exit(proc: subprocess.Popen[str], port: int) -> tuple[list[str], str]:
    """Every /metrics page served until ``run`` exits (30 s at most), and its stderr."""
    pages: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                    pages.append(r.read().decode())
            except OSError:
                pass
            time.sleep(0.5)
        _out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return pages, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hfsampler(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`hfsampler ARGS` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "hfsampler", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # as the test left it: HFSAMPLER_SHM_DIR
        check=False,
    )


def _exit_code(args: list[str]) -> int | str | None:
    """main()'s status, whether it returns it or argparse raises it."""
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


def _ring_names(log_text: str) -> list[str]:
    found = re.search(r"shared memory: (.+)", log_text)
    assert found, "the debug log names the rings"
    return found.group(1).split()


def test_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    """A real process: the exit status and stderr a shell sees (no traceback, one line)."""
    path = tmp_path / "bad.yml"
    path.write_text(
        "window: 1s\n"
        "remote_write:\n"
        "  - url: http://127.0.0.1:1/api/v1/write\n"
        "    queue_config: {max_shard: 2}\n"
    )
    result = _hfsampler("check-config", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "remote_write[0].queue_config.max_shard" in lines[0]


def test_check_config_ok(tmp_path: Path) -> None:
    path = tmp_path / "good.yml"
    path.write_text("source: sim\nwindow: 2s\nexternal_labels: {cluster: c1}\n")
    result = hfsampler("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    assert "cluster=c1" in result.stdout


def test_check_config_warns_when_a_capacity_cannot_hold_one_window(tmp_path: Path) -> None:
    """64 sim GPUs bring about 14,000 samples a window: an explicit capacity of 10,000 would
    lose part of every window; check-config says so in one line that names the key and the
    fix. Without capacity the queue is sized from the plan: nothing to say."""
    path = tmp_path / "big.yml"
    path.write_text(
        "source: sim\ngpus: 64\nremote_write:\n"
        "  - url: http://127.0.0.1:1/api/v1/write\n"
        "  - url: http://127.0.0.1:2/api/v1/write\n"
        "    queue_config: {capacity: 10000}\n"
    )
    result = hfsampler("check-config", str(path))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "warning:" in line]
    assert len(warnings) == 1
    assert "remote_write[1].queue_config.capacity is 10000 samples" in warnings[0]
    assert "less than one window" in warnings[0]
    assert "64 sim GPUs" in warnings[0]
    assert "leave capacity out" in warnings[0]
    path.write_text(path.read_text().replace("gpus: 64", "gpus: 8"))  # 1,800 a window: fits
    assert "warning:" not in hfsampler("check-config", str(path)).stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--window", "1"], "--window: '1' has no unit"),
        (["run", "--label", "nope"], "--label: 'nope' is not k=v"),
        (["run", "--fields", "powr"], "fields: unknown field 'powr'"),
        (["run", "--remote-write", "ftp://x"], "ftp"),
        (["run", "--source", "cuda"], "invalid choice"),
        (["run", "--interval", "2s"], "longer than the window"),
    ],
)
def test_bad_flags_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_fields_lists_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fields"]) == 0
    out = capsys.readouterr().out
    assert "DCGM_FI_DEV_POWER_USAGE_INSTANT" in out
    assert "NVML_FI_DEV_POWER_INSTANT" in out


def test_nvml_without_driver_fails_clearly() -> None:
    result = hfsampler("run", "--source", "nvml", "--duration", "1s", "--listen", "")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "NVML" in result.stderr or "driver" in result.stderr


def test_sigterm_stops_cleanly() -> None:
    """A real process: SIGTERM, and the exit status a shell sees."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--listen", ""],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        assert proc.stderr is not None
        seen = ""
        while "sampling" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err


def test_a_small_shm_exits_2_with_one_line(small_shm: Path) -> None:
    result = hfsampler("run", "--source", "sim", "--window", "10s", "--listen", "", "--duration",
                       "1s")  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"hfsampler: error: {small_shm}: the sample rings need ")
    assert "bytes), 1.0 MiB free (give it more room: " in lines[-1]
    assert "Traceback" not in result.stderr


def test_an_hour_window_exits_2_naming_max_ring_bytes(shm_dir: Path) -> None:
    result = hfsampler("run", "--source", "sim", "--window", "1h", "--listen", "")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hfsampler: error: max_ring_bytes: --window 3600s with intervals ")
    assert "Traceback" not in result.stderr
    assert list(shm_dir.iterdir()) == []


def test_a_dead_sampler_is_reported_with_its_reason(shm_dir: Path) -> None:
    """A real process: its sampler process killed, and the exit status a shell sees."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--listen", ""],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        assert proc.stderr is not None
        seen = ""
        while "sampling" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()
        os.kill(_sampler_pid(proc.pid), signal.SIGKILL)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    died = [line for line in (seen + err).splitlines() if "sampler process died" in line]
    assert len(died) == 1
    assert "the sampler process died (killed by SIGKILL" in died[0]
    assert died[0].endswith("; stopping")
    assert list(shm_dir.iterdir()) == []  # its rings freed all the same


def _sampler_pid(parent: int) -> int:
    # started from an executor thread: each thread lists its own children
    tasks = Path(f"/proc/{parent}/task").glob("*/children")
    children = [pid for task in tasks for pid in task.read_text().split()]
    for pid in children:
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError(f"no sampler among {children}")


_LEAN_COMMANDS = ("report", "record", "check-config", "fields")


@pytest.fixture(scope="module")
def http_stack_imported() -> dict[str, bool]:
    """Per command, whether building its parser imported aiohttp, in a fresh interpreter: one
    imports the parser's module, then a forked copy of it per command builds that command's
    parser (as `hfsampler COMMAND` starts), and says."""
    code = (
        "import os, sys\nfrom hfsampler.cli.main import build_parser\n"
        "for command in sys.argv[1:]:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        build_parser(command)\n"
        "        print(command, 'aiohttp' in sys.modules, flush=True)\n"
        "        os._exit(0)\n"
        "    assert os.waitpid(pid, 0)[1] == 0, command\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *_LEAN_COMMANDS], capture_output=True,
                         text=True, check=True)  # fmt: skip
    said = dict(line.split() for line in out.stdout.splitlines())
    assert list(said) == list(_LEAN_COMMANDS), out.stdout + out.stderr
    return {command: imported == "True" for command, imported in said.items()}


@pytest.mark.parametrize("command", _LEAN_COMMANDS)
def test_a_command_imports_no_http_stack_it_does_not_use(
    command: str, http_stack_imported: dict[str, bool]
) -> None:
    """A fresh interpreter (the one `hfsampler COMMAND` starts): what the parser imports for a
    command that pushes nothing leaves aiohttp out, half of every start's time."""
    assert http_stack_imported[command] is False


def test_a_line_break_in_a_counters_file_name_stays_on_its_own_log_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` as a real process: every line of its stderr as a terminal shows it, the sampler
    process's included."""
    # a quoted name may hold a line break (Go's csv allows it): in the warning it would forge a
    # log line of its own, and a terminal escape would reach the terminal
    forged = "2026-01-01 00:00:00,000 ERROR hfsampler: forged \x1b[2J"
    csv = tmp_path / "counters.csv"
    csv.write_text(f'DCGM_FI_DEV_GPU_TEMP, gauge, t\n"DCGM_FAKE\n{forged}", gauge, y\n')
    escaped = "DCGM_FAKE\\n2026-01-01 00:00:00,000 ERROR hfsampler: forged \\x1b[2J"
    assert main(["check-config", "--fields-csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert f"left out: {escaped}\n" in out
    assert not [line for line in out.splitlines() if not line.startswith(("  ", str(csv)))]
    proc = _hfsampler("run", "--source", "sim", "--gpus", "1", "--duration", "1s",
                      "--listen", "", "--fields-csv", str(csv))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"left out: {escaped}\n" in proc.stderr
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ hfsampler\.")
    assert [line for line in proc.stderr.splitlines() if not stamp.match(line)] == []


def test_check_config_takes_a_web_configuration_file_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # as --fields-csv: a file a user is about to mount, checked without a config file around it
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users:\n  prometheus: Sup3r-Secret-PW\n")
    assert _exit_code(["check-config", "--web-config-file", str(web)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hfsampler: error: web_config_file: basic_auth_users.prometheus: is not")
    assert "Sup3r" not in err
    web.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    assert _exit_code(["check-config", "--web-config-file", str(web)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{web}: OK\n")
    assert f"  web_config_file: {web}: no TLS; no basic auth; headers X-Frame-Options\n" in out
    assert _exit_code(["check-config", "--web-config-file", ""]) == 2
    assert "nothing to check" in capsys.readouterr().err


def test_a_reader_that_has_had_enough_ends_the_output_quietly() -> None:
    """`hfsampler fields | head -1` (a real pipe whose reader has left: only a process shows
    it): no error line, the status a process SIGPIPE ended has."""
    with subprocess.Popen([sys.executable, "-m", "hfsampler", "fields"], env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:  # fmt: skip
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()  # gone before the command has started: its first write meets EPIPE
        err = proc.stderr.read()
        assert proc.wait(timeout=30) == 128 + signal.SIGPIPE, err
    assert err == b""

"""The command line as a user drives it: exit codes, messages, /metrics while it runs."""

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

from hfsampler.cli.main import main
from hfsampler.sources.sim.source import SimSource

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
    result = _hfsampler("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    assert "cluster=c1" in result.stdout


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
    result = _hfsampler("run", "--source", "nvml", "--duration", "1s", "--listen", "")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "NVML" in result.stderr or "driver" in result.stderr


def test_run_serves_window_series_and_exits_cleanly() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "run", "--gpus", "2", "--duration", "5s",
         "--listen", f"127.0.0.1:{port}", "--label", "cluster=test", "--log-level", "debug"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    started = time.time_ns()
    pages, err = _scrape_until_exit(proc, port)
    assert proc.returncode == 0, err
    assert "SIMULATED" in err  # the fallback warning, since this machine has no driver
    assert "Traceback" not in err
    page = next(p for p in reversed(pages) if "DCGM_FI_DEV_POWER_USAGE_INSTANT_max" in p)
    expected = (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED_p99",
        "DCGM_FI_DEV_GPU_TEMP_min",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "hfsampler_ticks_total",
        "hfsampler_gpu_up",
    )
    for name in expected:
        assert re.search(rf"^{name}{{", page, re.M), name
    assert 'cluster="test"' in page
    assert 'gpu="1"' in page
    # every spike-sized window maximum seen on /metrics is a spike the sim really made
    sim = SimSource(2, seed=0)
    peaks = {g: {s.peak_w for s in sim.spikes(g, started - 10**9, time.time_ns())} for g in (0, 1)}
    for p in pages:
        for gpu, value in re.findall(
            r'^DCGM_FI_DEV_POWER_USAGE_INSTANT_max{.*gpu="(\d)".*} (\S+)$', p, re.M
        ):
            if float(value) > 650:
                assert float(value) in peaks[int(gpu)]
    rings = _ring_names(err)
    assert rings
    for name in rings:  # the rings are gone
        assert not os.path.exists(f"/dev/shm/{name}")


def test_sigterm_stops_cleanly() -> None:
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
    result = _hfsampler("run", "--source", "sim", "--window", "10s", "--listen", "", "--duration",
                        "1s")  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"hfsampler: error: {small_shm}: the sample rings need ")
    assert "bytes), 1.0 MiB free (give it more room: " in lines[-1]
    assert "Traceback" not in result.stderr


def test_an_hour_window_exits_2_naming_max_ring_bytes(shm_dir: Path) -> None:
    result = _hfsampler("run", "--source", "sim", "--window", "1h", "--listen", "")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hfsampler: error: max_ring_bytes: --window 3600s with intervals ")
    assert "Traceback" not in result.stderr
    assert list(shm_dir.iterdir()) == []


def test_a_dead_sampler_is_reported_with_its_reason(shm_dir: Path) -> None:
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


def test_metrics_page_has_nvlink_per_link_series_with_a_link_label() -> None:
    """`run` on the sim: every link's bandwidth (a gauge, with its window siblings) and error
    counters (counters) on /metrics, each series with its `link` label beside the GPU's; the
    link the sim has down on GPU 1 has no series there."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "run", "--gpus", "2", "--duration", "4s",
         "--fields", "slow,NVLINK_TX_THROUGHPUT_PER_LINK,NVLINK_RX_THROUGHPUT_PER_LINK,"
         "NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL,NVLINK_CRC_DATA_ERROR_PER_LINK_TOTAL,"
         "NVLINK_REPLAY_ERROR_PER_LINK_TOTAL,NVLINK_RECOVERY_ERROR_PER_LINK_TOTAL",
         "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    pages, err = _scrape_until_exit(proc, port)
    assert proc.returncode == 0, err
    tx = "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"
    page = next(p for p in reversed(pages) if f"{tx}_max{{" in p)
    assert f"# TYPE {tx} gauge" in page
    assert "# TYPE DCGM_FI_DEV_NVLINK_REPLAY_ERROR_PER_LINK_TOTAL counter" in page
    assert "# TYPE DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL counter" in page  # the total stays
    series = re.findall(rf"^{tx}{{(.*)}} (\S+)$", page, re.M)
    links = {(re.search(r'gpu="(\d)"', lb)[1], re.search(r'link="(\d+)"', lb)[1])  # type: ignore[index]
             for lb, _ in series}  # fmt: skip
    assert links == {(g, str(k)) for g in "01" for k in range(18)} - {("1", "17")}
    assert all(2.0e9 < float(v) < 3.6e9 for _, v in series)  # B/s
    for name in ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL",
                 "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_PER_LINK_TOTAL"):  # fmt: skip
        assert re.search(rf'^{name}{{.*gpu="0".*link="17".*}} ', page, re.M), name
        assert not re.search(rf"^{name}_max{{", page, re.M)  # a counter has no siblings


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


def _sampler_pid(parent: int) -> int:
    """The sampler process among ``parent``'s children (not multiprocessing's resource tracker)."""
    for task in Path(f"/proc/{parent}/task").iterdir():  # started from an executor thread
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return int(child)
    raise AssertionError(f"no sampler process under {parent}")


def _until(check: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def test_a_sampler_that_stops_ticking_is_said_once_and_fails_the_health_check() -> None:
    """The sampler process stopped (SIGSTOP: as a read stuck in the driver looks from outside):
    one warning per group, /healthz 503 while it lasts, 200 and one line when it ticks again."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--gpus", "1",
         "--duration", "40s", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        assert _until(lambda: _health(port) == 200, 30)
        sampler = _sampler_pid(proc.pid)
        os.kill(sampler, signal.SIGSTOP)
        try:
            assert _until(lambda: _health(port) == 503, 20)
        finally:
            os.kill(sampler, signal.SIGCONT)
        assert _until(lambda: _health(port) == 200, 20)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    stalled = [line for line in err.splitlines() if "has not ticked for" in line]
    assert sorted(re.search(r"group (\w+)", line)[1] for line in stalled) == [  # type: ignore[index]
        "fast", "gpm", "slow"
    ], err  # fmt: skip
    again = [line for line in err.splitlines() if "ticks again after" in line]
    assert len(again) == 3, err

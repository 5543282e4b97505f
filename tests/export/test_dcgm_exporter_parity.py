"""dcgm-exporter parity as a scrape and a receiver see it: `run --source nvml` on the fake NVML.

The violation counters carry the driver's nanoseconds; the enforced power limit is there when
selected and not by default; DCGM_EXP_XID_ERRORS_COUNT and DCGM_EXP_CLOCK_EVENTS_COUNT count a
burst over their trailing window as dcgm-exporter's collectors do (docs/dcgm-exporter-parity.md):
one series per code or reason while it is in the window, labelled ``window_size_in_ms``, and one
series at 0 without that label for a GPU with nothing in it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import aiohttp
import pynvml
import pytest
import yaml
from conformance import ConformanceReceiver
from fake_nvml import FakeNvml, FakeReading, install, make_fake, nvlink_gpu
from inprocess import free_port, start_ns

from hfsampler.cli.main import build_parser
from hfsampler.config.flags import config_from_args
from hfsampler.export.service import Service
from hfsampler.sampling.plan import build_run
from hfsampler.sampling.stepping import VirtualClock
from hfsampler.series import is_stale

S = 10**9
XID = "DCGM_EXP_XID_ERRORS_COUNT"
CLOCK = "DCGM_EXP_CLOCK_EVENTS_COUNT"
POWER_CAP, HW_THERMAL = 0x4, 0x40


async def _page(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


def _series(page: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s series on a /metrics page: labels (sorted) -> value."""
    out = {}
    for labels, value in re.findall(rf"^{name}{{(.*)}} (\S+)$", page, re.M):
        pairs = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))
        out[pairs] = float(value)
    return out


def _counts(page: str, name: str, gpu: str, label: str) -> dict[str | None, float]:
    """One GPU's counts on a page: its ``label`` value (None: the series without it) -> count."""
    got: dict[str | None, float] = {}
    for pairs, value in _series(page, name).items():
        lb = dict(pairs)
        if lb["gpu"] == gpu:
            assert lb["window_size_in_ms"] == "3000"
            got[lb.get(label)] = value
    return got


def _run(tmp_path: Path, config: dict[str, object], duration: str, clock: VirtualClock) -> Service:
    path = tmp_path / "hfsampler.yml"
    path.write_text(yaml.safe_dump(config))
    parser, _ = build_parser()
    argv = ["run", "--source", "nvml", "--config", str(path), "--duration", duration]
    return Service(build_run(config_from_args(parser.parse_args(argv))), clock=clock)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return install(monkeypatch, make_fake(2))


async def test_windowed_counts_of_an_xid_burst_and_clock_events_as_dcgm_exporter(
    tmp_path: Path, fake: FakeNvml
) -> None:
    started = start_ns()
    clock = VirtualClock(started)
    fake.clock_us = lambda: clock.now_ns() // 1000
    w0 = (started // S + 1) * S  # the first window's end
    # GPU 1 power-capped and thermally slowed from the middle of the second window to the
    # middle of the fourth: three windows in which the reasons were active
    on_us = ((w0 + S // 2) // 1000, (w0 + 2 * S + S // 2) // 1000)
    fake.gpus[1].readings["clocks_event_reasons"] = FakeReading(
        lambda ts: float(POWER_CAP | HW_THERMAL) if on_us[0] <= ts < on_us[1] else 0.0, 1000
    )

    def burst() -> None:  # three XID 79 and two of a code hfsampler has no series of
        fake.xid_burst(1, 79, 3)
        fake.xid_burst(1, 200, 2)

    clock.at(w0 + S // 2, burst)
    port = free_port()
    pages: dict[int, str] = {}

    def scrape_after(k: int) -> None:
        async def scrape() -> None:
            pages[k] = await _page(port)

        clock.at(w0 + k * S + S // 2, scrape)

    for k in range(1, 7):
        scrape_after(k)
    async with ConformanceReceiver() as rx:
        config = {
            "fields": [
                "DCGM_EXP_XID_ERRORS_COUNT",
                "DCGM_EXP_CLOCK_EVENTS_COUNT",
                "DCGM_EXP_XID_ERRORS_TOTAL",
                "DCGM_EXP_CLOCK_EVENTS_TOTAL",
            ],
            "xid_count_window": "3s",
            "clock_events_count_window": "3s",
            "listen": f"127.0.0.1:{port}",
            "remote_write": [{"url": rx.url, "name": "rx"}],
        }
        assert await _run(tmp_path, config, "8s", clock).run() == 0
    rx.assert_conformant()

    # a GPU without events: one series at 0, no xid label, the window in ms
    for k in range(1, 7):
        assert _counts(pages[k], XID, "0", "xid") == {None: 0.0}, k
        assert _counts(pages[k], CLOCK, "0", "clock_event") == {None: 0.0}, k
    # the burst: every event under its code (the untracked one too), while in the window
    for k in (1, 2, 3):
        assert _counts(pages[k], XID, "1", "xid") == {"79": 3.0, "200": 2.0}, k
    assert _counts(pages[4], XID, "1", "xid") == {None: 0.0}  # slid out, nothing reset
    assert "# TYPE DCGM_EXP_XID_ERRORS_COUNT gauge" in pages[1]
    # clock events: one per window a reason was active, named as DCGM names them
    expected = [
        {"power_cap": 1.0, "hw_thermal": 1.0},
        {"power_cap": 2.0, "hw_thermal": 2.0},
        {"power_cap": 3.0, "hw_thermal": 3.0},
        {"power_cap": 2.0, "hw_thermal": 2.0},  # the first window slid out
        {"power_cap": 1.0, "hw_thermal": 1.0},
        {None: 0.0},
    ]
    for k, want in enumerate(expected, start=1):
        assert _counts(pages[k], CLOCK, "1", "clock_event") == want, k

    # since start: a series per code or reason once seen, never at 0 before; the clock
    # reasons turned on once (edge-counted), however many windows they stayed on
    for k in range(1, 7):
        totals = _series(pages[k], "DCGM_EXP_XID_ERRORS_TOTAL")
        assert {(dict(lb)["gpu"], dict(lb)["xid"]): v for lb, v in totals.items()} == {
            ("1", "79"): 3.0,
            ("1", "200"): 2.0,
        }, k
        edges = _series(pages[k], "DCGM_EXP_CLOCK_EVENTS_TOTAL")
        assert {(dict(lb)["gpu"], dict(lb)["clock_event"]): v for lb, v in edges.items()} == {
            ("1", "power_cap"): 1.0,
            ("1", "hw_thermal"): 1.0,
        }, k
    assert "# TYPE DCGM_EXP_XID_ERRORS_TOTAL counter" in pages[1]
    assert "window_size_in_ms" not in "".join(
        ln for ln in pages[1].splitlines() if ln.startswith("DCGM_EXP_XID_ERRORS_TOTAL{")
    )

    # the receiver: the same values, and the code's series ended with a stale marker
    (labels, samples), *others = rx.series_named(XID, gpu="1", xid="79").items()
    assert not others
    assert dict(labels)["window_size_in_ms"] == "3000"
    values = [v for _, v in samples]
    assert [v for v in values if not math.isnan(v)] == [3.0, 3.0, 3.0]
    assert is_stale(values[-1])
    zero = rx.series_named(XID, gpu="0")
    assert len(zero) == 1
    assert "xid" not in dict(next(iter(zero)))
    assert all(v == 0.0 for _, v in next(iter(zero.values())) if not math.isnan(v))


async def test_violation_in_ns_and_the_enforced_limit_only_when_selected(
    tmp_path: Path, fake: FakeNvml
) -> None:
    started = start_ns()
    clock = VirtualClock(started)
    fake.clock_us = lambda: clock.now_ns() // 1000
    # GPU 1's limit enforced below the one set (an out-of-band cap), in mW as NVML gives it
    fake.gpus[1].fields[pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT] = FakeReading(
        650_000.0, 1_000_000, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    )
    port = free_port()
    pages: list[str] = []

    async def scrape() -> None:
        pages.append(await _page(port))

    clock.at(started + 2 * S + S // 2, scrape)
    config = {"listen": f"127.0.0.1:{port}"}
    assert await _run(tmp_path, config, "3s", clock).run() == 0
    default = pages[-1]
    # the driver's nanoseconds, unscaled: the fake's 1.5 ms power-capped so far
    power = _series(default, "DCGM_FI_DEV_POWER_VIOLATION")
    assert sorted(power.values()) == [1.5e6, 1.5e6]
    assert "# TYPE DCGM_FI_DEV_POWER_VIOLATION counter" in default
    assert "(in ns)" in default.split("# HELP DCGM_FI_DEV_POWER_VIOLATION ", 1)[1].split("\n")[0]
    # opt-in as in dcgm-exporter: the set limit stays (hfsampler's default), the enforced not
    assert not _series(default, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT")
    assert sorted(_series(default, "DCGM_FI_DEV_POWER_MGMT_LIMIT").values()) == [700.0, 700.0]

    pages.clear()
    clock = VirtualClock(start_ns())
    fake.clock_us = lambda: clock.now_ns() // 1000
    clock.at(clock.now_ns() + 2 * S + S // 2, scrape)
    config["fields"] = ["slow", "ENFORCED_POWER_LIMIT", "BOARD_LIMIT_VIOLATION"]
    assert await _run(tmp_path, config, "3s", clock).run() == 0
    chosen = pages[-1]
    enforced = {
        dict(k)["gpu"]: v for k, v in _series(chosen, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT").items()
    }
    assert enforced == {"0": 700.0, "1": 650.0}
    board = _series(chosen, "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION")
    assert sorted(board.values()) == [2.5e5, 2.5e5]


async def test_last_xid_labelled_with_its_code_and_message_as_dcgm_exporter(
    tmp_path: Path, fake: FakeNvml
) -> None:
    started = start_ns()
    clock = VirtualClock(started)
    fake.clock_us = lambda: clock.now_ns() // 1000
    w0 = (started // S + 1) * S

    def burst() -> None:  # two codes at once: the series shows the last, as DCGM's latest value
        fake.xid_burst(1, 79, 2)
        fake.xid_burst(1, 48, 1)

    clock.at(w0 + S // 2, burst)
    # then a code NVIDIA has no name for
    clock.at(w0 + 2 * S + S // 2, lambda: fake.xid_burst(1, 250, 1))
    port = free_port()
    pages: dict[int, str] = {}

    def scrape_after(k: int) -> None:
        async def scrape() -> None:
            pages[k] = await _page(port)

        clock.at(w0 + k * S + S // 2 - S // 4, scrape)

    for k in range(0, 5):
        scrape_after(k)
    async with ConformanceReceiver() as rx:
        config = {
            "fields": ["DCGM_FI_DEV_XID_ERRORS"],
            "listen": f"127.0.0.1:{port}",
            "remote_write": [{"url": rx.url, "name": "rx"}],
        }
        assert await _run(tmp_path, config, "6s", clock).run() == 0
    rx.assert_conformant()

    def last_xid(page: str, gpu: str) -> dict[tuple[str, str], float]:
        return {(dict(lb)["err_code"], dict(lb)["err_msg"]): v
                for lb, v in _series(page, "DCGM_FI_DEV_XID_ERRORS").items()
                if dict(lb)["gpu"] == gpu}  # fmt: skip

    no_error = {("0", "No Error"): 0.0}
    for k in range(0, 5):  # a GPU without XIDs: dcgm-exporter's 0 with "No Error"
        assert last_xid(pages[k], "0") == no_error, k
    assert last_xid(pages[0], "1") == no_error
    # one series per GPU: the old code's series is gone from the page, the new one there
    assert last_xid(pages[1], "1") == {("48", "Double Bit ECC Error"): 48.0}
    assert last_xid(pages[2], "1") == {("48", "Double Bit ECC Error"): 48.0}
    assert last_xid(pages[3], "1") == {("250", "Unknown Error"): 250.0}
    assert last_xid(pages[4], "1") == {("250", "Unknown Error"): 250.0}
    assert "# TYPE DCGM_FI_DEV_XID_ERRORS gauge" in pages[1]

    # the receiver: each code's series in turn, each earlier one ended with a stale marker
    got = rx.series_named("DCGM_FI_DEV_XID_ERRORS", gpu="1")
    by_code = {dict(lb)["err_code"]: [v for _, v in samples] for lb, samples in got.items()}
    assert set(by_code) == {"0", "48", "250"}
    for code in ("0", "48"):
        values = by_code[code]
        assert is_stale(values[-1]), code
        assert {v for v in values[:-1]} == {float(code)}, code
    assert {v for v in by_code["250"] if not math.isnan(v)} == {250.0}
    firsts = {code: min(t for t, _ in samples)
              for lb, samples in got.items() for code in [dict(lb)["err_code"]]}  # fmt: skip
    assert firsts["0"] < firsts["48"] < firsts["250"]


async def test_nvlink_bandwidth_total_reads_what_dcgm_reports_for_the_same_counters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPU 0: links 0-3 with link 2 down; GPU 1: 18 links. Link k of GPU i moves (10 + k + i)
    # MiB/s out and twice that in, in NVML's TX and RX data KiB counters.
    fake = install(monkeypatch, FakeNvml(gpus=[nvlink_gpu(0, 4, down=(2,)), nvlink_gpu(1, 18)]))
    started = start_ns()
    clock = VirtualClock(started)
    fake.clock_us = lambda: clock.now_ns() // 1000
    port = free_port()
    pages: list[tuple[int, str]] = []

    async def scrape() -> None:
        pages.append((clock.now_ns(), await _page(port)))

    clock.at(started + 2 * S + S // 2, scrape)
    async with ConformanceReceiver() as rx:
        config = {
            "fields": ["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "hfsampler_nvlink_data_bytes_total"],
            "listen": f"127.0.0.1:{port}",
            "remote_write": [{"url": rx.url, "name": "rx"}],
        }
        assert await _run(tmp_path, config, "3s", clock).run() == 0
    rx.assert_conformant()
    t_ns, page = pages[-1]
    # DCGM: the TX + RX KiB counters of every link, differenced, per second, / 1000 ("MB/s")
    kib_per_s = {
        "0": sum(3 * (10 + k) * 1024 for k in (0, 1, 3)),
        "1": sum(3 * (11 + k) * 1024 for k in range(18)),
    }
    dcgm = {gpu: v / 1000 for gpu, v in kib_per_s.items()}
    assert dcgm == {"0": 104.448, "1": 1078.272}
    total = {
        dict(lb)["gpu"]: v for lb, v in _series(page, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL").items()
    }
    assert total == pytest.approx(dcgm, rel=1e-3)
    assert "# TYPE DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL gauge" in page
    assert (
        "(in MB/s" in page.split("# HELP DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL ", 1)[1].split("\n")[0]
    )
    assert _series(page, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL_max")  # a gauge's peaks too
    # the counters themselves, in bytes: the fake's since its clock's zero, up to the last window
    moved = {
        dict(lb)["gpu"]: v for lb, v in _series(page, "hfsampler_nvlink_data_bytes_total").items()
    }
    assert "# TYPE hfsampler_nvlink_data_bytes_total counter" in page
    for gpu, rate in kib_per_s.items():
        assert 0 < t_ns / 1e9 - moved[gpu] / (rate * 1024) < 1.5, gpu
    # the receiver got the same values
    got = rx.series_named("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="1")
    ((_, samples),) = got.items()
    sent = [v for _, v in samples if not math.isnan(v)]
    assert len(sent) >= 2
    assert sent == pytest.approx([dcgm["1"]] * len(sent), rel=1e-3)

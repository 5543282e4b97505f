"""The service in this process on the sim and a virtual clock: /metrics, /healthz, reloads.

What only a real process shows (signals, exit codes, a killed sampler) is in tests/cli.
"""

from __future__ import annotations

import gzip
import logging
import math
import re
from pathlib import Path

import aiohttp
import pytest
import yaml
from conformance import ConformanceReceiver
from inprocess import free_port, reloaded, run_plan, start_ns

from hfsampler import selfmetrics as sm
from hfsampler.cli.main import build_parser
from hfsampler.config.flags import config_from_args
from hfsampler.config.settings import Config
from hfsampler.export.service import Service
from hfsampler.sampling.ring import shm_dir
from hfsampler.sampling.stepping import SteppingSampler, VirtualClock
from hfsampler.sources.sim.source import SimSource

S = 10**9
POWER_MAX = "DCGM_FI_DEV_POWER_USAGE_max"


async def _get(url: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, resp.headers["Content-Type"], await resp.text()


async def test_run_serves_window_series_and_exits_cleanly(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()
    plan = run_plan("--gpus", "2", "--duration", "5s", "--listen", f"127.0.0.1:{port}",
                    "--label", "cluster=test", "--log-level", "debug")  # fmt: skip
    started = start_ns()
    clock = VirtualClock(started)
    pages: list[str] = []

    async def scrape() -> None:
        status, kind, text = await _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        assert kind.startswith("text/plain; version=0.0.4")
        pages.append(text)

    for k in range(6):
        clock.at(started + k * S + S // 2, scrape)
    service = Service(plan, clock=clock)
    assert await service.run() == 0
    assert service.windows == 5
    err = caplog.text
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
    peaks = {g: {s.peak_w for s in sim.spikes(g, started - S, clock.now_ns())} for g in (0, 1)}
    seen = 0
    for p in pages:
        for gpu, value in re.findall(
            r'^DCGM_FI_DEV_POWER_USAGE_INSTANT_max{.*gpu="(\d)".*} (\S+)$', p, re.M
        ):
            if float(value) > 650:
                assert float(value) in peaks[int(gpu)]
                seen += 1
    found = re.search(r"shared memory: (.+)", err)
    assert found, "the debug log names the rings"
    for name in found.group(1).split():  # the rings are gone
        assert not (shm_dir() / name).exists()


async def test_metrics_page_has_nvlink_per_link_series_with_a_link_label() -> None:
    """`run` on the sim: every link's bandwidth (a gauge, with its window siblings) and error
    counters (counters) on /metrics, each series with its `link` label beside the GPU's; the
    link the sim has down on GPU 1 has no series there."""
    port = free_port()
    plan = run_plan("--gpus", "2", "--duration", "4s",
                    "--fields", "slow,NVLINK_TX_THROUGHPUT_PER_LINK,NVLINK_RX_THROUGHPUT_PER_LINK,"
                    "NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL,NVLINK_CRC_DATA_ERROR_PER_LINK_TOTAL,"
                    "NVLINK_REPLAY_ERROR_PER_LINK_TOTAL,NVLINK_RECOVERY_ERROR_PER_LINK_TOTAL",
                    "--listen", f"127.0.0.1:{port}")  # fmt: skip
    started = start_ns()
    clock = VirtualClock(started)
    pages: list[str] = []

    async def scrape() -> None:
        pages.append((await _get(f"http://127.0.0.1:{port}/metrics"))[2])

    clock.at(started + 3 * S + S // 2, scrape)
    assert await Service(plan, clock=clock).run() == 0
    tx = "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"
    page = next(p for p in reversed(pages) if f"{tx}_max{{" in p)
    assert f"# TYPE {tx} gauge" in page
    assert "# TYPE DCGM_FI_DEV_NVLINK_REPLAY_ERROR_PER_LINK_TOTAL counter" in page
    assert "# TYPE DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL gauge" in page  # the total stays
    series = re.findall(rf"^{tx}{{(.*)}} (\S+)$", page, re.M)
    links = {(re.search(r'gpu="(\d)"', lb)[1], re.search(r'link="(\d+)"', lb)[1])  # type: ignore[index]
             for lb, _ in series}  # fmt: skip
    assert links == {(g, str(k)) for g in "01" for k in range(18)} - {("1", "17")}
    assert all(2.0e9 < float(v) < 3.6e9 for _, v in series)  # B/s
    for name in ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL",
                 "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_PER_LINK_TOTAL"):  # fmt: skip
        assert re.search(rf'^{name}{{.*gpu="0".*link="17".*}} ', page, re.M), name
        assert not re.search(rf"^{name}_max{{", page, re.M)  # a counter has no siblings


async def test_metrics_is_rendered_once_per_window_however_often_it_is_asked() -> None:
    """Scrapes between two windows (an HA pair of Prometheus servers, a scrape interval shorter
    than the window) get the same bytes from one render; gzip when asked, of the same page."""
    port = free_port()
    plan = run_plan("--gpus", "2", "--duration", "5s", "--listen", f"127.0.0.1:{port}")
    started = start_ns()  # 0.3 s into a second: windows end on whole seconds
    clock = VirtualClock(started)
    service = Service(plan, clock=clock)
    # per scrape: the window it fell in, the page plain and gunzipped, and the renders so far
    scrapes: list[tuple[int, bytes, bytes, int]] = []

    async def scrape(window: int) -> None:
        bodies: dict[str, bytes] = {}
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            for coding in ("identity", "gzip"):
                async with session.get(f"http://127.0.0.1:{port}/metrics",
                                       headers={"Accept-Encoding": coding}) as resp:  # fmt: skip
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                    gzipped = resp.headers.get("Content-Encoding") == "gzip"
                    assert gzipped == (coding == "gzip")
                    body = await resp.read()
                    bodies[coding] = gzip.decompress(body) if gzipped else body
        scrapes.append((window, bodies["identity"], bodies["gzip"], service.page.renders))

    for k in range(1, 5):
        for at_s in (0.1, 0.5):  # both between the window ending at k + 0.7 s and the next
            clock.at(started + k * S + int(at_s * S), lambda k=k: scrape(k))
    assert await service.run() == 0
    assert len(scrapes) == 8
    for window, plain, gunzipped, renders in scrapes:
        assert plain == gunzipped
        assert plain.startswith(b"# HELP ")
        assert renders == window  # one render in each window scraped, however often
    for first, second in zip(scrapes[::2], scrapes[1::2], strict=True):
        assert first[1] == second[1]  # the same window: the same bytes
    pages = [s[1] for s in scrapes[::2]]
    assert len(set(pages)) == len(pages)  # a new window: a new page


async def test_a_sampler_that_stops_ticking_is_said_once_and_fails_the_health_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sampler stopped (as a read stuck in the driver, or a SIGSTOP, looks from outside):
    one warning per group, /healthz 503 while it lasts, 200 and one line when it ticks again."""
    caplog.set_level(logging.INFO)
    port = free_port()
    plan = run_plan("--source", "sim", "--gpus", "1", "--duration", "12s",
                    "--listen", f"127.0.0.1:{port}")  # fmt: skip
    started = start_ns()
    clock = VirtualClock(started)
    service = Service(plan, clock=clock)
    health: list[tuple[float, int]] = []

    def sampler() -> SteppingSampler:
        assert service.pipeline is not None
        assert isinstance(service.pipeline.sampler, SteppingSampler)
        return service.pipeline.sampler

    async def check() -> None:
        status = (await _get(f"http://127.0.0.1:{port}/healthz"))[0]
        health.append(((clock.now_ns() - started) / S, status))

    for at_s in (2.5, 7.5, 10.5):
        clock.at(started + int(at_s * S), check)
    clock.at(started + int(2.6 * S), lambda: sampler().pause())
    clock.at(started + int(8.6 * S), lambda: sampler().resume())
    assert await service.run() == 0
    assert health == [(2.5, 200), (7.5, 503), (10.5, 200)]
    err = caplog.text
    stalled = [line for line in err.splitlines() if "has not ticked for" in line]
    assert sorted(re.search(r"group (\w+)", line)[1] for line in stalled) == [  # type: ignore[index]
        "fast", "gpm", "slow"
    ], err  # fmt: skip
    again = [line for line in err.splitlines() if "ticks again after" in line]
    assert len(again) == 3, err


async def test_a_changed_endpoint_loses_no_window_while_it_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The windows made while a changed endpoint's writer is replaced go to the new one."""
    caplog.set_level(logging.INFO)
    path = tmp_path / "hfsampler.yml"
    parser, _ = build_parser()
    argv = ["run", "--source", "sim", "--config", str(path), "--listen", "", "--duration", "7s"]

    def load() -> Config:
        return config_from_args(parser.parse_args(argv))

    async with ConformanceReceiver() as a:
        config = {"remote_write": [{"url": a.url, "name": "a"}]}
        path.write_text(yaml.safe_dump(config))
        started = start_ns()
        clock = VirtualClock(started)
        service = Service(run_plan(*argv[1:]), clock=clock, loader=load)

        def change() -> None:
            for timeout in ("7s", "9s"):  # two changes in a row, the second during the first
                config["remote_write"][0]["remote_timeout"] = timeout
                path.write_text(yaml.safe_dump(config))
                service.request_reload()

        clock.at(started + 2 * S + S // 2, change)
        clock.at(started + 4 * S + S // 2, lambda: reloaded(caplog))
        assert await service.run() == 0
    err = caplog.text
    a.assert_conformant()
    stamps = [t for k, v in a.series_named(POWER_MAX, gpu="0").items() for t, x in v if x == x]
    assert stamps == list(range(stamps[0], stamps[-1] + 1, 1000)), "a window went missing"
    assert len(stamps) == 7
    assert "dropping" not in err
    assert err.count("configuration reloaded") >= 1
    # where it pushes is said once at start (what an operator asks first when data is missing)
    pushing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pushing to")]
    assert len(pushing) == 1
    assert re.fullmatch(rf"pushing to a at {a.url} \(Remote-Write 1\.0, queue [\d.]+ windows, \d+ "
                        r"samples per shard\); outages queued in memory", pushing[0])  # fmt: skip


@pytest.mark.parametrize(
    ("gpus", "fields"),
    [("64", ()), ("16", ("--fields", "all"))],  # about 14,000 and 9,200 samples a window
)
async def test_large_windows_are_pushed_whole_and_none_is_dropped(
    gpus: str, fields: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """64 sim GPUs at the default settings, 16 with every field: a window arrives whole, before
    the sender can take any of it, and the queue (sized from the plan) takes it whole; the
    strict receiver stores every window of every series, and nothing is dropped."""
    caplog.set_level(logging.INFO)
    async with ConformanceReceiver() as rx:
        plan = run_plan("--source", "sim", "--gpus", gpus, *fields, "--listen", "",
                        "--duration", "3s", "--remote-write", rx.url)  # fmt: skip
        started = start_ns()
        # the strict receiver parses in Python, a sample in about 0.2 ms: more than the end's
        # five seconds to take the last windows and the stale markers
        service = Service(plan, clock=VirtualClock(started), flush_deadline_s=120)
        assert await service.run() == 0
    rx.assert_conformant()
    assert service.metrics.total(sm.RW_DROPPED) == 0
    assert "queue is full" not in caplog.text
    assert "raised to" not in caplog.text
    assert service.metrics.total(sm.RW_SAMPLES) == rx.report()["samples"]
    # every window of every GPU's power series, the last GPU's too; then its stale marker
    for gpu in ("0", str(int(gpus) - 1)):
        (samples,) = rx.series_named(POWER_MAX, gpu=gpu).values()
        stamps = [t for t, v in samples if v == v]
        assert len(stamps) == service.windows == 3
        assert stamps == list(range(stamps[0], stamps[0] + 3000, 1000))
        assert math.isnan(samples[-1][1])  # and the stale marker at the end

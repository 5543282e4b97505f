"""SIGHUP reloads the configuration as Prometheus and vmagent do; a bad file changes nothing.

A reload in this process (no signal) is in tests/export/test_service.py.

It used to end the process at once (exit 129) without flushing or stale markers, leaving shared
memory behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conformance import ConformanceReceiver

from hfsampler.config.loader import from_mapping
from hfsampler.config.reload import plan_reload
from hfsampler.config.settings import Config

pytestmark = pytest.mark.long  # its tests take half a minute or more together

REPO = Path(__file__).resolve().parents[2]
POWER_MAX = "DCGM_FI_DEV_POWER_USAGE_max"


def test_plan_names_what_changes() -> None:
    old = from_mapping(
        {
            "external_labels": {"dc": "a"},
            "remote_write": [
                {"url": "http://a/w", "name": "a"},
                {"url": "http://b/w", "name": "b"},
            ],
        }
    )
    new = from_mapping(
        {
            "external_labels": {"dc": "b"},
            "window": "2s",
            "remote_write": [
                {"url": "http://b/w", "name": "b", "remote_timeout": "5s"},
                {"url": "http://c/w", "name": "c"},
            ],
        }
    )
    plan = plan_reload(old, new)
    assert [ep.remote_name for ep in plan.stop] == ["a", "b"]
    assert [ep.remote_name for ep in plan.start] == ["b", "c"]
    assert plan.labels_changed
    assert plan.needs_restart == ("window_s",)
    assert plan.config.window_s == old.window_s  # kept until a restart
    assert plan.config.external_labels == {"dc": "b"}
    same = plan_reload(old, old)
    assert (same.start, same.stop, same.labels_changed, same.needs_restart) == ((), (), False, ())


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
        return text


def _reload_ok(port: int) -> float | None:
    for line in _scrape(port).splitlines():
        if line.startswith("hfsampler_config_last_reload_successful"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _windows(receiver: ConformanceReceiver) -> int:
    return max((len(v) for v in receiver.series_named(POWER_MAX, dc="b").values()), default=0)


def _wait(check, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "not in time"
        time.sleep(0.1)


def test_giving_or_leaving_out_capacity_restarts_the_endpoint() -> None:
    """An explicit capacity bounds the queue and none sizes it from the plan (10 windows): the
    two differ even at Prometheus's 10000, so a reload that adds or removes it restarts the
    endpoint. The raised-capacity warning tells the user to leave capacity out; a SIGHUP after
    doing so used to change nothing, and the queue kept holding one window."""

    def config(queue: dict[str, object]) -> Config:
        return from_mapping({"remote_write": [{"url": "http://a/w", "name": "a", **queue}]})

    explicit, default = config({"queue_config": {"capacity": 10000}}), config({})
    for old, new in ((explicit, default), (default, explicit)):
        plan = plan_reload(old, new)
        assert [ep.remote_name for ep in plan.start] == ["a"]
        assert [ep.remote_name for ep in plan.stop] == ["a"]
    same = plan_reload(explicit, config({"queue_config": {"capacity": 10000}}))
    assert (same.start, same.stop) == ((), ())


def test_sighup_applies_a_new_file_and_refuses_a_bad_one(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "hfsampler.yml"
    with ConformanceReceiver() as a, ConformanceReceiver() as b:
        config = {"external_labels": {"dc": "a"}, "remote_write": [{"url": a.url, "name": "a"}]}
        path.write_text(yaml.safe_dump(config))
        proc = subprocess.Popen(
            [sys.executable, "-m", "hfsampler", "run", "--source", "sim", "--config", str(path),
             "--listen", f"127.0.0.1:{port}"],
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            a.wait(lambda r: len(r.series_named(POWER_MAX, dc="a")) == 2, 30)
            config["external_labels"] = {"dc": "b"}
            config["remote_write"].append({"url": b.url, "name": "b"})
            path.write_text(yaml.safe_dump(config))
            proc.send_signal(signal.SIGHUP)
            b.wait(lambda r: len(r.series_named(POWER_MAX, dc="b")) == 2, 30)
            a.wait(lambda r: len(r.series_named(POWER_MAX, dc="b")) == 2, 30)
            _wait(lambda: _reload_ok(port) == 1.0)
            path.write_text("remote_write: [{url: 'ftp://nope'}]\n")
            proc.send_signal(signal.SIGHUP)
            _wait(lambda: _reload_ok(port) == 0.0)
            assert proc.poll() is None  # still running, the old configuration in force
            seen = len(
                b.series_named(POWER_MAX, dc="b")[next(iter(b.series_named(POWER_MAX, dc="b")))]
            )
            b.wait(
                lambda r: max(len(v) for v in r.series_named(POWER_MAX, dc="b").values()) > seen, 10
            )
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err[-2000:]
    a.assert_conformant()
    b.assert_conformant()
    # the dc=a series ended with stale markers when the labels changed
    ended = a.series_named(POWER_MAX, dc="a")
    assert all(v[-1][1] != v[-1][1] for v in ended.values())  # NaN: the stale marker
    assert "configuration reload refused" in err
    assert err.count("configuration reloaded") == 1

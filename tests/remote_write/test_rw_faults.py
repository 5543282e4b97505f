"""Hostile receiver answers and bad input on the sending path: bounded, counted, never leaked.

Each case was reproduced against the sender before these rules existed: ``Retry-After: 0`` made
a hot loop, ``Retry-After: 999999`` stopped delivery, an answer with a newline forged a log line,
a receiver echoing request headers put the bearer token into a WARNING, a header value with
CR/LF passed ``check-config``, ``min_shards: 100000`` hung the process, and a connection closed
mid-answer was counted under two statuses.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from test_rw_sender import FAST, Receiver, Reply, eventually, labels_of, make_series, snap

from hfsampler import selfmetrics as sm
from hfsampler.cli.main import main
from hfsampler.errors import ConfigError
from hfsampler.remote_write.config import EndpointConfig, QueueConfig, parse_remote_write
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.retry import Backoff
from hfsampler.selfmetrics import SelfMetrics

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops

TOKEN = "tok-8f3a1c-SECRET"


def endpoint(text: str) -> EndpointConfig:
    (ep,) = parse_remote_write(yaml.safe_load(text))
    return ep


def test_retry_after_is_floored_at_the_backoff_and_capped() -> None:
    backoff = Backoff(0.5, 8.0, max_retry_after_s=60.0)
    first = backoff.next_delay(0.0)
    assert 0.375 <= first.seconds <= 0.5
    assert "raised to the backoff" in first.adjusted
    later = backoff.next_delay(999999.0)
    assert later.seconds == 60.0
    assert "capped at max_retry_after 60 s" in later.adjusted
    assert backoff.next_delay(5.0) == (5.0, "")  # within the bounds: honoured as given


async def test_retry_after_zero_is_no_hot_loop() -> None:
    """A receiver answering 429 with Retry-After: 0 for 1 s gets a handful of requests."""
    script = [Reply(429, headers={"Retry-After": "0"}) for _ in range(10_000)]
    async with Receiver(script) as rx:
        queue = replace(FAST, min_backoff_s=0.05, max_backoff_s=0.4)
        writer = RemoteWriter(EndpointConfig(rx.url, queue=queue), SelfMetrics())
        await writer.start()
        writer.push(snap(make_series(2), 1000))
        await asyncio.sleep(1.0)
        rx.script.clear()  # then it takes the samples
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    assert len(rx.received) <= 12, len(rx.received)  # 50, 100, 200, 400, 400 ms ...


async def test_huge_retry_after_is_capped() -> None:
    async with Receiver([Reply(503, headers={"Retry-After": "999999"})]) as rx:
        queue = replace(FAST, max_retry_after_s=0.3)
        metrics = SelfMetrics()
        writer = RemoteWriter(EndpointConfig(rx.url, queue=queue), metrics)
        await writer.start()
        started = time.monotonic()
        writer.push(snap(make_series(1), 1000))
        await eventually(lambda: len(rx.accepted()) == 1)
        waited = time.monotonic() - started
        await writer.close(5)
    assert 0.25 <= waited < 5
    assert metrics.total(sm.RW_RETRIES) == 1


async def test_receiver_text_is_one_escaped_line_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    echo = (
        f"bad request\nlevel=error msg=forged \x1b[31mred\x1b[0m "
        f"Authorization: Bearer {TOKEN} X-Api-Key: k3y-v4lue-77"
    )
    async with Receiver([Reply(400, echo), Reply(503, echo)]) as rx:
        cfg = endpoint(
            f"- url: {rx.url}\n  bearer_token: {TOKEN}\n  headers: {{X-Api-Key: k3y-v4lue-77}}\n"
        )
        metrics = SelfMetrics()
        writer = RemoteWriter(replace(cfg, queue=FAST), metrics)
        await writer.start()
        writer.push(snap(make_series(1), 1000))
        await eventually(lambda: len(rx.received) == 1)
        writer.push(snap(make_series(1), 2000))
        await eventually(lambda: len(rx.accepted()) == 1)
        await writer.close(5)
    lines = [r.getMessage() for r in caplog.records if "bad request" in r.getMessage()]
    assert len(lines) == 2  # the refusal, the retry
    for line in lines:
        assert "\n" not in line
        assert "\x1b" not in line
        assert TOKEN not in line
        assert "k3y-v4lue-77" not in line
        assert "\\nlevel=error msg=forged \\x1b[31mred" in line
        assert "Authorization: <secret> X-Api-Key: <secret>" in line
    assert TOKEN not in caplog.text


@pytest.mark.parametrize(
    "headers",
    ["{X-Tenant: \"a\\r\\nX-Evil: 1\"}", "{X-Tenant: \"a\\nb\"}", "{X-Tenant: \"a\\0b\"}",
     "{\"Bad Header\": x}", "{\"X-Ok:\": x}"],
)  # fmt: skip
def test_header_names_and_values_checked_at_load(tmp_path: Path, headers: str) -> None:
    with pytest.raises(ConfigError, match=r"remote_write\[0\]\.headers\."):
        parse_remote_write(yaml.safe_load(f"- url: http://a/\n  headers: {headers}\n"))
    path = tmp_path / "c.yml"
    path.write_text(f"remote_write:\n  - url: http://a/\n    headers: {headers}\n")
    assert main(["check-config", str(path)]) == 2


def test_shard_counts_are_bounded() -> None:
    with pytest.raises(ConfigError, match="min_shards: is 100000; at most 200"):
        QueueConfig(min_shards=100_000, max_shards=100_000)
    with pytest.raises(ConfigError, match="max_shards"):
        QueueConfig(max_shards=10**6)


async def test_connection_closed_mid_answer_counts_once() -> None:
    """Headers of a 200, then the connection drops: one "error", not also "200"."""

    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(half_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    metrics = SelfMetrics()
    cfg = EndpointConfig(f"http://127.0.0.1:{port}/w", queue=replace(FAST, max_backoff_s=0.05))
    writer = RemoteWriter(cfg, metrics)
    await writer.start()
    writer.push(snap(make_series(1), 1000))
    await eventually(lambda: metrics.total(sm.RW_REQUESTS) >= 2)
    await writer.close(0.1)
    server.close()
    await server.wait_closed()
    assert metrics.get(sm.RW_REQUESTS, labels_of(cfg, status="200")) == 0
    assert metrics.get(sm.RW_REQUESTS, labels_of(cfg, status="error")) >= 2
    assert metrics.total(sm.RW_SAMPLES) == 0

"""/metrics under abuse from clients that do not know the password: a flood of guesses, and
requests aiohttp cannot parse that carry credentials. In this process on the sim, against real
clients on loopback (aiohttp's client and raw sockets)."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from pathlib import Path

import bcrypt
import pytest
from test_web import PASSWORD, SECRETS, TOKEN, USER, get, serve, write_json

from hfsampler.export.web import CACHE_SIZE


async def test_a_flood_of_guesses_does_not_evict_a_scrapers_verified_password(
    tmp_path: Path,
) -> None:
    """The scraper's hash costs 12 (about 0.3 s a check); the guesses go to a second user whose
    hash costs 4, so that three cache-fulls of them take a second, not minutes. Evicted, the
    scraper's verdict would cost it another cost-12 check."""
    slow = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=12)).decode()
    cheap = bcrypt.hashpw(b"mallory's own", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    write_json(web, {"basic_auth_users": {USER: slow, "mallory": cheap}})
    took: dict[str, float] = {}
    statuses: dict[str, list[int]] = {}

    async def scenario(port: int) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        t0 = time.perf_counter()
        statuses["first"] = [(await get(url, None, USER, PASSWORD))[0]]
        took["first"] = time.perf_counter() - t0
        guesses = [f"guess-{i}" for i in range(3 * CACHE_SIZE)]
        for batch in range(0, len(guesses), 20):
            got = await asyncio.gather(*(get(url, None, "mallory", g)
                                         for g in guesses[batch : batch + 20]))  # fmt: skip
            statuses.setdefault("guesses", []).extend(g[0] for g in got)
        t0 = time.perf_counter()
        statuses["after"] = [(await get(url, None, USER, PASSWORD))[0]]
        took["after"] = time.perf_counter() - t0

    await serve(web, scenario, duration_s=30)
    assert statuses == {"first": [200], "guesses": [401] * 3 * CACHE_SIZE, "after": [200]}
    assert took["after"] < took["first"] / 2, took


@pytest.mark.parametrize(
    "request_bytes",
    [
        # an Authorization header over aiohttp's 8190-byte line limit
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {TOKEN}{'A' * 9000}\r\n\r\n",
        # a control character after the credentials
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {TOKEN}\x01\r\n\r\n",
        # a space before the colon
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization : Basic {TOKEN}\r\n\r\n",
    ],
    ids=["too long", "control character", "space before colon"],
)
async def test_a_request_aiohttp_cannot_parse_is_400_and_its_credentials_stay_out_of_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, request_bytes: str
) -> None:
    caplog.set_level(logging.DEBUG)
    web = tmp_path / "web.yml"
    cheap = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    write_json(web, {"basic_auth_users": {USER: cheap}})
    answers: list[bytes] = []

    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes.encode())
        await writer.drain()
        answers.append(await asyncio.wait_for(reader.read(), 10))
        writer.close()

    await serve(web, scenario)
    assert answers[0].startswith(b"HTTP/1.0 400 Bad Request"), answers
    logged = caplog.text
    assert "Error handling request from 127.0.0.1: 400 " in logged
    for secret in (*SECRETS, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()[:40]):
        assert secret not in logged
    assert "Traceback" not in logged
    assert not [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno > 10]

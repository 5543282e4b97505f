"""Secrets a receiver echoes, and redirects: no credential reaches a log line or another host.

Reproduced before these rules existed: with ``url: http://user:pass@host/...`` a receiver that
echoes the request head (a 401 or 500 body) put ``Authorization: Basic <base64 of user:pass>``
into the log as is, since aiohttp builds that header from the URL and only the header
hfsampler set itself was redacted; a 307 to another port was followed with ``X-Api-Key`` and
the tenant header, the log naming the configured URL.
"""

from __future__ import annotations

import base64
import logging
from collections import deque

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_rw_sender import FAST, Receiver, eventually, labels_of, make_series, snap

from hfsampler import selfmetrics as sm
from hfsampler.remote_write.config import EndpointConfig, parse_remote_write
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.remote_write.security import Redactor
from hfsampler.selfmetrics import SelfMetrics

USER = "edge-user"
PASSWORD = "Url-Pa55-77c1"
API_KEY = "k3y-v4lue-5150"


def basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


def endpoint(text: str) -> EndpointConfig:
    (ep,) = parse_remote_write(yaml.safe_load(text))
    return ep


class Echo:
    """A receiver that answers each request with the next status of ``statuses`` (then 204),
    its body the request's head, as some proxies and debug servers do."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = deque(statuses)
        self.heads: list[dict[str, str]] = []
        app = web.Application()
        app.router.add_post("/api/v1/write", self.handle)
        self.server = TestServer(app)

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.heads.append(dict(request.headers))
        status = self.statuses.popleft() if self.statuses else 204
        head = "\n".join(f"{k}: {v}" for k, v in request.headers.items())
        return web.Response(status=status, text=f"{request.method} {request.path_qs}\n{head}")

    def url(self, userinfo: str = "") -> str:
        return f"http://{userinfo}127.0.0.1:{self.server.port}/api/v1/write"


@pytest.mark.parametrize(
    ("userinfo", "user", "password"),
    [
        (f"{USER}:{PASSWORD}@", USER, PASSWORD),
        ("edge%40site:Pa%2Fss%3A-word-9@", "edge@site", "Pa/ss:-word-9"),  # percent-encoded
    ],
    ids=["plain", "percent-encoded"],
)
async def test_url_credentials_echoed_by_a_receiver_stay_out_of_the_log(
    caplog: pytest.LogCaptureFixture, userinfo: str, user: str, password: str
) -> None:
    """401 (refused) then 500 (retried) with the request head echoed, aiohttp's Basic header in
    it: every form of the credentials is ``<secret>`` in every line."""
    caplog.set_level(logging.DEBUG, logger="hfsampler")
    echo = Echo([401, 500])
    await echo.server.start_server()
    try:
        cfg = endpoint(f"- url: {echo.url(userinfo)}\n  headers: {{X-Api-Key: {API_KEY}}}\n")
        metrics = SelfMetrics()
        writer = RemoteWriter(EndpointConfig(cfg.url, headers=cfg.headers, queue=FAST), metrics)
        await writer.start()
        writer.push(snap(make_series(1), 1000))
        await eventually(lambda: len(echo.heads) == 1)
        writer.push(snap(make_series(1), 2000))
        await eventually(lambda: metrics.total(sm.RW_SAMPLES) == 1)
        await writer.close(5)
    finally:
        await echo.server.close()
    # the receiver did get the header aiohttp built from the URL
    assert echo.heads[0]["Authorization"] == f"Basic {basic(user, password)}"
    text = caplog.text
    assert "HTTP 401" in text
    assert "HTTP 500" in text
    assert "Authorization: <secret>" in text
    for secret in (password, basic(user, password), f"{user}:{password}", API_KEY):
        assert secret not in text, secret


def test_the_redactor_knows_every_form_of_a_secret() -> None:
    """URL userinfo as written, percent-decoded and as Basic credentials; a proxy's too; query
    values; secret headers; the auth block's secret and the header it makes."""
    cfg = endpoint(
        f"- url: http://u%40x:p%2Fw-1234@h:9/w?token=q-tok-99&x=1\n"
        f"  proxy_url: http://pxuser:px-pass-42@proxy:3128/\n"
        f"  headers: {{X-Api-Key: {API_KEY}, X-Scope-OrgID: tenant-a}}\n"
    )
    redact = Redactor(cfg.secrets())
    forms = [
        "p%2Fw-1234",
        "p/w-1234",
        "u@x:p/w-1234",
        basic("u@x", "p/w-1234"),
        "q-tok-99",
        API_KEY,
        "px-pass-42",
        basic("pxuser", "px-pass-42"),
    ]
    for form in forms:
        assert redact(f"echo [{form}]") == "echo [<secret>]", form
    assert redact("X-Scope-OrgID: tenant-a") == "X-Scope-OrgID: tenant-a"  # not a secret
    auth = endpoint(
        f"- url: http://h/w\n  basic_auth: {{username: {USER}, password: {PASSWORD}}}\n"
    )
    redact = Redactor(auth.secrets())
    assert redact(f"Basic {basic(USER, PASSWORD)} {PASSWORD}") == "<secret> <secret>"


class Redirecting:
    """Answers every POST with ``status`` and ``Location: location``."""

    def __init__(self, status: int, location: str) -> None:
        self.status = status
        self.location = location
        self.count = 0
        app = web.Application()
        app.router.add_post("/api/v1/write", self.handle)
        self.server = TestServer(app)

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.count += 1
        return web.Response(status=self.status, headers={"Location": self.location})


async def test_a_redirect_to_another_host_is_not_followed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 307 to another port: no request there (it would carry the API key, the tenant and the
    password), the samples dropped as refused, one line naming the Location without its
    credentials, whatever the number of batches."""
    async with Receiver() as other:
        other_port = other.server.port
        location = other.url.replace("http://", "http://intruder:loc-Pa55-3@")
        redirecting = Redirecting(307, location)
        await redirecting.server.start_server()
        try:
            url = f"http://{USER}:{PASSWORD}@127.0.0.1:{redirecting.server.port}/api/v1/write"
            cfg = endpoint(
                f"- url: {url}\n  name: r\n  flavor: mimir\n  tenant: team-a\n"
                f"  headers: {{X-Api-Key: {API_KEY}}}\n"
            )
            cfg = EndpointConfig(cfg.url, "r", headers=cfg.headers, queue=FAST)
            metrics = SelfMetrics()
            writer = RemoteWriter(cfg, metrics)
            await writer.start()
            for t in range(1, 4):
                writer.push(snap(make_series(2), 1000 * t))
                await eventually(lambda t=t: metrics.total(sm.RW_DROPPED) == 2 * t)  # type: ignore[misc]
            await writer.close(5)
        finally:
            await redirecting.server.close()
    assert other.received == []
    assert redirecting.count == 3
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 6
    assert metrics.get(sm.RW_REQUESTS, labels_of(cfg, status="307")) == 3
    said = [r.getMessage() for r in caplog.records if "307" in r.getMessage()]
    assert len(said) == 1, said
    assert f"@127.0.0.1:{other_port}/api/v1/write not followed" in said[0]
    assert "not followed" in said[0]
    for secret in ("loc-Pa55-3", PASSWORD, API_KEY):
        assert secret not in caplog.text


@pytest.mark.parametrize("status", [307, 308])
async def test_a_redirect_within_the_endpoint_is_followed(status: int) -> None:
    """Prometheus follows redirects by default: one to the same scheme, host and port (here a
    relative Location) keeps the body and the headers, since nothing leaves the host."""

    async def moved(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=status, headers={"Location": "/api/v1/write"})

    rx = Receiver()
    rx.server.app.router.add_post("/old", moved)
    async with rx:
        url = rx.url.replace("/api/v1/write", "/old")
        cfg = EndpointConfig(url, "s", headers={"X-Api-Key": API_KEY}, queue=FAST)
        metrics = SelfMetrics()
        writer = RemoteWriter(cfg, metrics)
        await writer.start()
        writer.push(snap(make_series(3), 1000))
        await eventually(lambda: len(rx.accepted()) == 3)
        await writer.close(5)
    assert rx.received[0].headers["X-Api-Key"] == API_KEY
    assert metrics.get(sm.RW_REQUESTS, labels_of(cfg, status=str(status))) == 1
    assert metrics.get(sm.RW_SAMPLES, labels_of(cfg)) == 3
    assert metrics.total(sm.RW_DROPPED) == 0


async def test_follow_redirects_false_follows_none() -> None:
    async with Receiver() as rx:
        redirecting = Redirecting(308, rx.url)
        await redirecting.server.start_server()
        try:
            url = f"http://127.0.0.1:{redirecting.server.port}/api/v1/write"
            cfg = EndpointConfig(url, "n", queue=FAST, follow_redirects=False)
            metrics = SelfMetrics()
            writer = RemoteWriter(cfg, metrics)
            await writer.start()
            writer.push(snap(make_series(2), 1000))
            await eventually(lambda: metrics.total(sm.RW_DROPPED) == 2)
            await writer.close(5)
        finally:
            await redirecting.server.close()
    assert rx.received == []
    assert metrics.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 2

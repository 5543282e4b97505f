"""/metrics behind the web configuration file, in this process on the sim and a virtual clock,
against real clients on loopback (aiohttp's client and asyncio's streams over Python's ``ssl``):
TLS, client certificates, basic auth, headers, and files changed while it runs.

The TLS tests run on both loops: the listener's context hands each connection to the context of
the moment through ``wrap_bio``, which asyncio and uvloop each call in their own code.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import bcrypt
import pytest
from certs import Pki, make_pki
from inprocess import free_port, run_plan, start_ns

from hfsampler.export.service import Service
from hfsampler.export.web import CACHE_SIZE, VerdictCache, basic_credentials
from hfsampler.sampling.stepping import VirtualClock

S = 10**9
USER, PASSWORD = "prometheus", "Scrape-Pa55word-3c1d"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
TOKEN = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
SECRETS = (PASSWORD, TOKEN, HASH, HASH[7:])  # HASH[7:]: the salt and hash without the cost


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("other"), name="other")


def write_json(path: Path, data: object) -> None:
    """Written beside and renamed over, as a Kubernetes Secret or certbot updates a file."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data))
    os.replace(part, path)


def client_ssl(pki: Pki, cert: Pki | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    if cert is not None:
        ctx.load_cert_chain(cert.client_cert, cert.client_key)
    return ctx


async def get(
    url: str, ctx: ssl.SSLContext | None = None, user: str = "", password: str = ""
) -> tuple[int, dict[str, str], str]:
    headers = {}
    if user:
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {pair}"
    connector = aiohttp.TCPConnector(ssl=ctx if ctx is not None else False)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(url, headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.text()


async def serve(web: Path, scenario: Callable[[int], Awaitable[None]], duration_s: int = 3) -> None:
    """`run` on one simulated GPU with ``--web-config-file web``; ``scenario(port)`` runs once
    the first window is on /metrics."""
    port = free_port()
    plan = run_plan("--source", "sim", "--gpus", "1", "--duration", f"{duration_s}s",
                    "--listen", f"127.0.0.1:{port}", "--web-config-file", str(web),
                    "--log-level", "debug")  # fmt: skip
    started = start_ns()
    clock = VirtualClock(started)
    clock.at(started + S + S // 2, lambda: scenario(port))
    assert await Service(plan, clock=clock).run() == 0


@pytest.mark.both_loops
async def test_tls_and_basic_auth_answer_200_401_and_nothing_in_clear(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    web = tmp_path / "web.yml"
    write_json(web, {
        "tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
        "basic_auth_users": {USER: HASH},
        "http_server_config": {"headers": {"X-Frame-Options": "deny",
                                           "X-Content-Type-Options": "nosniff"}},
    })  # fmt: skip
    seen: dict[str, tuple[int, dict[str, str], str]] = {}

    async def scenario(port: int) -> None:
        url = f"https://127.0.0.1:{port}"
        ctx = client_ssl(pki)
        seen["right"] = await get(f"{url}/metrics", ctx, USER, PASSWORD)
        seen["none"] = await get(f"{url}/metrics", ctx)
        seen["wrong"] = await get(f"{url}/metrics", ctx, USER, "not-the-password")
        seen["stranger"] = await get(f"{url}/metrics", ctx, "mallory", PASSWORD)
        seen["healthz"] = await get(f"{url}/healthz", ctx)  # every path, as the toolkit
        seen["healthz ok"] = await get(f"{url}/healthz", ctx, USER, PASSWORD)
        seen["missing"] = await get(f"{url}/nothing", ctx, USER, PASSWORD)
        # plain HTTP on the TLS port: the handshake fails on the request line, and the
        # connection closes without an answer
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {TOKEN}\r\n\r\n"
                     .encode())  # fmt: skip
        await writer.drain()
        seen["clear"] = (0, {}, (await asyncio.wait_for(reader.read(), 10)).decode("latin-1"))
        writer.close()
        with pytest.raises(aiohttp.ClientError):
            await get(f"http://127.0.0.1:{port}/metrics", None, USER, PASSWORD)

    await serve(web, scenario)
    status, headers, text = seen["right"]
    assert status == 200
    assert "DCGM_FI_DEV_POWER_USAGE{" in text
    assert headers["X-Frame-Options"] == "deny"
    assert headers["X-Content-Type-Options"] == "nosniff"
    for case in ("none", "wrong", "stranger", "healthz"):
        status, headers, text = seen[case]
        assert status == 401, case
        assert headers["WWW-Authenticate"] == "Basic", case
        assert headers["X-Frame-Options"] == "deny", case  # on a refusal too
        assert "DCGM" not in text
    assert seen["healthz ok"][0] == 200
    assert seen["missing"][0] == 404
    assert seen["missing"][1]["X-Frame-Options"] == "deny"
    assert seen["clear"][2] == ""
    logged = caplog.text
    assert "serving /metrics and /healthz on https://127.0.0.1:" in logged
    assert "basic auth for 1 user(s)" in logged
    for secret in SECRETS:
        assert secret not in logged
    assert "Traceback" not in logged


async def test_mutual_tls_serves_only_a_client_with_a_certificate_from_the_ca(
    tmp_path: Path, pki: Pki, other_pki: Pki
) -> None:
    web = tmp_path / "web.yml"
    write_json(web, {"tls_server_config": {
        "cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
        "client_ca_file": str(pki.ca_file),
        "client_auth_type": "RequireAndVerifyClientCert"}})  # fmt: skip
    seen: dict[str, int | str] = {}

    async def scenario(port: int) -> None:
        url = f"https://127.0.0.1:{port}/metrics"
        seen["with"] = (await get(url, client_ssl(pki, cert=pki)))[0]
        for case, ctx in (("without", client_ssl(pki)),
                          ("foreign", client_ssl(pki, cert=other_pki))):  # fmt: skip
            try:
                seen[case] = (await get(url, ctx))[0]
            except aiohttp.ClientError as exc:
                seen[case] = type(exc).__name__

    await serve(web, scenario)
    assert seen["with"] == 200
    # TLS 1.3: the client learns of the refusal on its first read, as a reset or a TLS alert
    assert isinstance(seen["without"], str), seen
    assert isinstance(seen["foreign"], str), seen


async def test_min_version_refuses_an_older_client(tmp_path: Path, pki: Pki) -> None:
    web = tmp_path / "web.yml"
    write_json(web, {"tls_server_config": {
        "cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
        "min_version": "TLS13"}})  # fmt: skip
    seen: dict[str, object] = {}

    async def scenario(port: int) -> None:
        url = f"https://127.0.0.1:{port}/metrics"
        seen["TLS 1.3"] = (await get(url, client_ssl(pki)))[0]
        old = client_ssl(pki)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(aiohttp.ClientError) as err:
            await get(url, old)
        seen["TLS 1.2"] = str(err.value)

    await serve(web, scenario)
    assert seen["TLS 1.3"] == 200
    # the handshake fails; asyncio closes it without sending its alert
    assert str(seen["TLS 1.2"]).startswith("Cannot connect to host"), seen


@pytest.mark.both_loops
async def test_a_rotated_certificate_and_a_changed_file_are_used_without_a_restart(
    tmp_path: Path, pki: Pki, other_pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cert, key, web = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "web.yml"
    shutil.copy(pki.server_cert, cert)
    shutil.copy(pki.server_key, key)
    tls = {"cert_file": "server.pem", "key_file": "server.key"}  # beside the file
    write_json(web, {"tls_server_config": tls})
    steps: list[tuple[str, object]] = []

    async def status(port: int, trust: Pki, user: str = "", password: str = "") -> object:
        try:
            return (await get(f"https://127.0.0.1:{port}/metrics", client_ssl(trust),
                              user, password))[0]  # fmt: skip
        except aiohttp.ClientConnectorCertificateError:
            return "untrusted"

    async def scenario(port: int) -> None:
        steps.append(("first", await status(port, pki)))
        for src, dst in ((other_pki.server_cert, cert), (other_pki.server_key, key)):
            part = dst.with_suffix(".part")
            shutil.copy(src, part)
            os.replace(part, dst)
        steps.append(("rotated, old CA", await status(port, pki)))
        steps.append(("rotated, new CA", await status(port, other_pki)))
        write_json(web, {"tls_server_config": tls, "basic_auth_users": {USER: HASH}})
        steps.append(("users added", await status(port, other_pki)))
        steps.append(("users added, password", await status(port, other_pki, USER, PASSWORD)))
        write_json(web, {"tls_server_config": tls, "basic_auth_users": {USER: HASH[:-2]}})
        steps.append(("broken", await status(port, other_pki, USER, PASSWORD)))
        steps.append(("still broken", await status(port, other_pki, USER, PASSWORD)))
        write_json(web, {"tls_server_config": tls, "basic_auth_users": {"other": HASH}})
        steps.append(("fixed, user removed", await status(port, other_pki, USER, PASSWORD)))

    await serve(web, scenario)
    assert steps == [
        ("first", 200),
        ("rotated, old CA", "untrusted"),
        ("rotated, new CA", 200),
        ("users added", 401),
        ("users added, password", 200),
        ("broken", 500),  # fails closed, as the toolkit does
        ("still broken", 500),
        ("fixed, user removed", 401),
    ]
    logged = caplog.text
    broken = [line for line in logged.splitlines() if "answered 500" in line]
    assert len(broken) == 1, logged  # said once, not per request
    assert f"basic_auth_users.{USER}: is not a bcrypt hash" in broken[0]
    assert logged.count(f"web_config_file {web} read again") == 3
    for secret in (*SECRETS, HASH[:-2], HASH[7:-2]):
        assert secret not in logged


async def test_a_verified_password_is_not_checked_again(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bcrypt is slow on purpose (cost 12: about 0.3 s here): one check per (user, password),
    whether the scrapes that share it come one after another or at once, a wrong one too.
    Counted at bcrypt's boundary, not timed: a loaded machine cannot make it fail."""
    slow = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=12)).decode()
    web = tmp_path / "web.yml"
    write_json(web, {"basic_auth_users": {USER: slow}})
    checked: list[bytes] = []
    check = bcrypt.checkpw

    def counted(password: bytes, hashed: bytes) -> bool:
        checked.append(password)
        return check(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counted)
    checks: dict[str, int] = {}
    statuses: dict[str, list[int]] = {}

    async def scenario(port: int) -> None:
        url = f"http://127.0.0.1:{port}/metrics"

        async def scrapes(case: str, password: str, n: int, together: bool = False) -> None:
            before = len(checked)
            if together:
                got = await asyncio.gather(*(get(url, None, USER, password) for _ in range(n)))
            else:
                got = [await get(url, None, USER, password) for _ in range(n)]
            checks[case] = len(checked) - before
            statuses[case] = [g[0] for g in got]

        await scrapes("one check", "guess", 1)
        await scrapes("wrong again", "guess", 5)
        await scrapes("five at once", PASSWORD, 5, together=True)
        await scrapes("right again", PASSWORD, 5)

    await serve(web, scenario)
    assert statuses == {"one check": [401], "wrong again": [401] * 5,
                        "five at once": [200] * 5, "right again": [200] * 5}  # fmt: skip
    assert checks == {"one check": 1, "wrong again": 0, "five at once": 1, "right again": 0}
    assert checked == [b"guess", PASSWORD.encode()]


def test_the_cache_is_bounded_and_keeps_no_password() -> None:
    cache = VerdictCache()
    for i in range(CACHE_SIZE * 3):
        cache.set(cache.key(b"u", HASH.encode(), f"guess{i}".encode()), False)
    assert len(cache._verdicts) <= CACHE_SIZE
    key = cache.key(USER.encode(), HASH.encode(), PASSWORD.encode())
    assert PASSWORD.encode() not in key
    assert len(key) == 64
    assert cache.key(USER.encode(), HASH.encode(), PASSWORD.encode()) == key
    assert VerdictCache().key(USER.encode(), HASH.encode(), PASSWORD.encode()) != key


def test_basic_credentials_are_read_as_go_reads_them() -> None:
    assert basic_credentials(f"Basic {TOKEN}") == (USER.encode(), PASSWORD.encode())
    assert basic_credentials(f"basic {TOKEN}") == (USER.encode(), PASSWORD.encode())
    colon = base64.b64encode(b"u:pass:word").decode()
    assert basic_credentials(f"Basic {colon}") == (b"u", b"pass:word")
    for bad in (None, f"Bearer {TOKEN}", "Basic !!!", "Basic " + base64.b64encode(b"u").decode()):
        assert basic_credentials(bad) is None, bad

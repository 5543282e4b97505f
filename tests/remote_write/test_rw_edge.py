"""Edge delivery through ``RemoteWriter``: spooled replay across restarts, tenants and flavours,
409/529, auth headers and rotated secret files, TLS (CA, mTLS, untrusted), relabelling, secrets."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from certs import make_pki
from test_rw_sender import FAST, Receiver, Reply, eventually, labels_of, make_series, snap

from hfsampler import selfmetrics as sm
from hfsampler.remote_write.config import EndpointConfig, parse_remote_write
from hfsampler.remote_write.intake import RemoteWriter
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import SeriesRegistry, Snapshot

# The sender, its queues and its client run on an event loop: both loops are tried.
pytestmark = pytest.mark.both_loops

SECRET = "s3cret-Pa55-e2e"


def segment_files(root: Path) -> list[Path]:
    return list(root.rglob("*.seg"))


def endpoint(text: str) -> EndpointConfig:
    (ep,) = parse_remote_write(yaml.safe_load(text))
    return ep


async def test_spooled_outage_replays_in_order_exactly_once(tmp_path: Path) -> None:
    """Receiver down: windows spool; a restarted writer sends them, then new ones, in order."""
    async with Receiver() as probe:
        url = probe.url  # a port that will be free once the probe closes
    cfg = EndpointConfig(url, name="edge", queue=replace(FAST, min_shards=2, max_shards=2))
    series = make_series(6)
    m = SelfMetrics()
    writer = RemoteWriter(cfg, m, tmp_path)
    await writer.start()
    for t in range(1, 31):
        writer.push(snap(series, 1000 * t, base=t))
    await eventually(lambda: m.get(sm.RW_REQUESTS, labels_of(cfg, status="error")) >= 2)
    await writer.close(0.2)
    assert m.total(sm.RW_DROPPED) == 0  # nothing lost: it is all on disk
    assert segment_files(tmp_path)
    port = int(url.split(":")[2].split("/")[0])
    async with Receiver(port=port) as rx:
        m2 = SelfMetrics()
        writer2 = RemoteWriter(cfg, m2, tmp_path)
        assert writer2.queued() == 6 * 30
        await writer2.start()
        writer2.push(snap(series, 31_000, base=31))
        await eventually(lambda: len(rx.accepted()) == 6 * 31)
        await writer2.close(5)
    per_series: dict[str, list[int]] = {}
    for key, ts, _ in rx.accepted():
        per_series.setdefault(key, []).append(ts)
    assert len(per_series) == 6
    for stamps in per_series.values():
        assert stamps == [1000 * t for t in range(1, 32)]
    assert m2.get(sm.RW_QUEUE_DISK_BYTES, labels_of(cfg)) >= 0
    assert m2.total(sm.RW_DROPPED) == 0


@pytest.mark.parametrize(
    ("flavor", "path", "header"),
    [
        ("mimir", "/api/v1/push", "X-Scope-OrgID"),
        ("thanos", "/api/v1/receive", "THANOS-TENANT"),
    ],
)
async def test_tenant_flavours_set_path_and_header(flavor: str, path: str, header: str) -> None:
    seen: list[tuple[str, str | None]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get(header)))
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post(path, handle)
    async with TestServer(app) as server:
        base = str(server.make_url("/"))
        cfg = endpoint(f"- url: {base}\n  flavor: {flavor}\n  tenant: team-a\n")
        assert cfg.url.endswith(path)
        m = SelfMetrics()
        writer = RemoteWriter(replace(cfg, queue=FAST), m)
        await writer.start()
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: m.total(sm.RW_SAMPLES) == 2)
        await writer.close(5)
    assert seen == [(path, "team-a")]


async def test_thanos_409_is_never_retried_mimir_529_is() -> None:
    async with Receiver([Reply(409, "out of order"), Reply(529), Reply(204)]) as rx:
        cfg = EndpointConfig(rx.url, queue=FAST)
        m = SelfMetrics()
        writer = RemoteWriter(cfg, m)
        await writer.start()
        writer.push(snap(make_series(2), 1000))
        await eventually(lambda: m.total(sm.RW_DROPPED) == 2)
        writer.push(snap(make_series(2), 2000))
        await eventually(lambda: m.total(sm.RW_SAMPLES) == 2)
        await writer.close(5)
    assert [r.status for r in rx.received] == [409, 529, 204]
    assert m.get(sm.RW_DROPPED, labels_of(cfg, reason="rejected")) == 2
    assert m.total(sm.RW_RETRIES) == 1


async def test_basic_auth_and_rotated_bearer_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "-1\n")
    async with Receiver([Reply(401, "bad credentials")]) as rx:
        basic = endpoint(
            f"- url: {rx.url}\n  name: b\n  basic_auth: {{username: edge, password: {SECRET}}}\n"
        )
        bearer = endpoint(f"- url: {rx.url}\n  name: t\n  bearer_token_file: {token_file}\n")
        assert SECRET not in repr(basic)
        assert SECRET not in repr(bearer)
        m = SelfMetrics()
        with caplog.at_level(logging.DEBUG):
            w1 = RemoteWriter(replace(basic, queue=FAST), m)
            w2 = RemoteWriter(replace(bearer, queue=FAST), m)
            await w1.start()
            w1.push(snap(make_series(1), 1000))
            await eventually(lambda: len(rx.received) == 1)  # 401: dropped, not retried
            await eventually(lambda: m.total(sm.RW_DROPPED) == 1)
            w1.push(snap(make_series(1), 2000))
            await eventually(lambda: len(rx.received) == 2)
            await w2.start()
            w2.push(snap(make_series(1), 1000))
            await eventually(lambda: len(rx.received) == 3)
            await asyncio.sleep(0.01)  # a new mtime even on coarse-timestamp file systems
            token_file.write_text(SECRET + "-2\n")
            w2.push(snap(make_series(1), 2000))
            await eventually(lambda: len(rx.received) == 4)
            await w1.close(5)
            await w2.close(5)
    auth = [r.headers["Authorization"] for r in rx.received]
    assert auth[0] == auth[1]
    assert auth[0].startswith("Basic ")
    assert auth[2:] == [f"Bearer {SECRET}-1", f"Bearer {SECRET}-2"]
    for record in caplog.records:
        assert SECRET not in record.getMessage()
    assert any("401" in r.getMessage() for r in caplog.records)
    for _, key, _ in m.samples():
        assert SECRET not in str(key)


async def test_write_relabel_keeps_only_max_and_rewrites_labels() -> None:
    reg = SeriesRegistry()
    names = ["DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_USAGE_max", "DCGM_FI_DEV_GPU_TEMP_max"]
    series = [reg.series(n, {"gpu": "0", "UUID": "GPU-1", "Hostname": "h"}) for n in names]
    async with Receiver() as rx:
        cfg = endpoint(
            f"""
- url: {rx.url}
  write_relabel_configs:
    - {{source_labels: [__name__], regex: '.*_max', action: keep}}
    - {{source_labels: [__name__], regex: '.*TEMP.*', action: drop}}
    - {{source_labels: [UUID], regex: 'GPU-(.*)', target_label: uuid_short, replacement: 'u$1'}}
    - {{regex: Hostname, action: labeldrop}}
    - {{target_label: dc, replacement: fra1}}
"""
        )
        m = SelfMetrics()
        writer = RemoteWriter(replace(cfg, queue=FAST), m)
        await writer.start()
        writer.push(Snapshot(1000, series, [1.0, 2.0, 3.0]))
        writer.push(Snapshot(2000, series, [1.5, 2.5, 3.5]))
        await eventually(lambda: len(rx.accepted()) == 2)
        await writer.close(5)
    keys = {k for k, _, _ in rx.accepted()}
    # in byte order as sent: the relabelled set is sorted again, __name__ in its place
    assert keys == {"UUID=GPU-1,__name__=DCGM_FI_DEV_POWER_USAGE_max,dc=fra1,gpu=0,uuid_short=u1"}
    assert [v for _, _, v in rx.accepted()] == [2.0, 2.5]


async def _tls_server(pki_dir: Path, require_client: bool) -> tuple[TestServer, list[str]]:
    pki = make_pki(pki_dir)
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.Response(status=204)

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    if require_client:
        ctx.load_verify_locations(pki.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    app = web.Application()
    app.router.add_post("/api/v1/write", handle)
    server = TestServer(app, scheme="https")
    await server.start_server(ssl=ctx)
    return server, seen


async def test_tls_ca_mtls_and_untrusted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server, seen = await _tls_server(tmp_path / "pki", require_client=True)
    other = make_pki(tmp_path / "other", "someone-else")
    pki = tmp_path / "pki"
    url = str(server.make_url("/api/v1/write"))
    fast = "queue_config: {batch_send_deadline: 20ms, min_backoff: 5ms, max_backoff: 300ms}"
    try:
        good = endpoint(
            f"- url: {url}\n  {fast}\n  tls_config: {{ca_file: {pki}/ca.pem, "
            f"cert_file: {pki}/client.pem, key_file: {pki}/client.key, server_name: localhost}}\n"
        )
        no_client = endpoint(
            f"- url: {url}\n  name: nc\n  {fast}\n  tls_config: {{ca_file: {pki}/ca.pem}}\n"
        )
        untrusted = endpoint(
            f"- url: {url}\n  name: ut\n  {fast}\n  tls_config: {{ca_file: {other.ca_file}, "
            f"cert_file: {pki}/client.pem, key_file: {pki}/client.key}}\n"
        )
        m = SelfMetrics()
        writers = [RemoteWriter(ep, m) for ep in (good, no_client, untrusted)]
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            for w in writers:
                await w.start()
                w.push(snap(make_series(2), 1000))
            await eventually(lambda: m.get(sm.RW_SAMPLES, labels_of(good)) == 2)
            await asyncio.sleep(1.0)
            for w in writers:
                await w.close(0.1)
        took_s = time.monotonic() - started
    finally:
        await server.close()
    assert len(seen) == 1
    # An untrusted server is retried, but no faster than max_backoff (0.3 s, less its jitter's
    # quarter at most): no retry storm, however long the good endpoint took to get through.
    errors = m.get(sm.RW_REQUESTS, labels_of(untrusted, status="error"))
    assert 1 <= errors <= 1 + took_s / (0.75 * 0.3), (errors, took_s)
    # Python's TLS server resets a client without a certificate (Go's sends an alert: see the
    # Prometheus test); either way nothing gets through.
    assert m.get(sm.RW_SAMPLES, labels_of(no_client)) == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "TLS certificate not trusted" in text


def test_insecure_skip_verify_and_bad_files_are_config_errors(tmp_path: Path) -> None:
    from hfsampler.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tls_config.ca_file: cannot read"):
        endpoint(f"- url: https://a/\n  tls_config: {{ca_file: {tmp_path}/none.pem}}\n")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot load the certificates"):
        endpoint(f"- url: https://a/\n  tls_config: {{ca_file: {tmp_path}/junk.pem}}\n")
    ep = endpoint("- url: https://a/\n  tls_config: {insecure_skip_verify: true}\n")
    assert ep.tls is not None
    assert ep.tls.insecure_skip_verify


def test_queue_dir_in_config_and_flag(tmp_path: Path) -> None:
    from hfsampler.cli.main import build_parser
    from hfsampler.config.flags import config_from_args
    from hfsampler.config.loader import from_mapping
    from hfsampler.errors import ConfigError

    assert from_mapping({"queue_dir": str(tmp_path / "q")}).queue_dir == str(tmp_path / "q")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="queue_dir"):
        from_mapping({"queue_dir": str(tmp_path / "file" / "q")})
    with pytest.raises(ConfigError, match="queue_dir"):
        from_mapping({"queue_dir": 5})
    parser, _ = build_parser()
    args = parser.parse_args(["run", "--queue-dir", str(tmp_path / "spool")])
    assert config_from_args(args).queue_dir == str(tmp_path / "spool")

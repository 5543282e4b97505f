"""Prometheus behind ``--web.config.file``: TLS with a test CA, client certificates and basic auth.

Pushes succeed with the right CA, client certificate and password; a wrong password is refused
once per batch (401, never retried); an untrusted server certificate or a missing client
certificate is reported as a TLS failure and retried only every ``max_backoff``. No secret
appears in any log line.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import receivers as rx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from certs import Pki, make_pki

pytestmark = pytest.mark.integration

USER = "edge"
PASSWORD = "Tls-Pa55word-91b2"
WRONG = "not-the-password"


@dataclass
class SecurePrometheus(rx.Prometheus):
    """The harness's Prometheus with a web config: HTTPS (mTLS required) and basic auth."""

    web_config: Path = field(default_factory=Path)

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [*super().command(), f"--web.config.file={self.web_config}"]


class _Auth(urllib.request.BaseHandler):
    """Adds basic auth to every request the harness's urllib helpers make."""

    def https_request(self, req: urllib.request.Request) -> urllib.request.Request:
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        req.add_unredirected_header("Authorization", f"Basic {token}")
        return req


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_prometheus(
    receivers_root: Path, pki: Pki, prometheus_build: rx.PrometheusBuild
) -> Iterator[SecurePrometheus]:
    import bcrypt

    root = receivers_root / f"secure-{prometheus_build.name}"
    root.mkdir(parents=True, exist_ok=True)
    web = root / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    web.write_text(
        json.dumps(
            {
                "tls_server_config": {
                    "cert_file": str(pki.server_cert),
                    "key_file": str(pki.server_key),
                    "client_auth_type": "RequireAndVerifyClientCert",
                    "client_ca_file": str(pki.ca_file),
                },
                "basic_auth_users": {USER: hashed},
            }
        )
    )
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    ctx.load_cert_chain(pki.client_cert, pki.client_key)
    # The harness queries with urllib: teach it the CA, the client certificate and the password.
    urllib.request.install_opener(
        urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx), _Auth())
    )
    prom = SecurePrometheus(
        name=f"secure-{prometheus_build.name}",
        port=rx.free_port(),
        data_dir=root,
        log_path=root / "prometheus.log",
        binary=prometheus_build.binary,
        web_config=web,
    )
    try:
        prom.start()
        yield prom
    finally:
        prom.stop()
        urllib.request.install_opener(None)  # type: ignore[arg-type]


def _endpoint(prom: SecurePrometheus, pki: Pki, name: str, **tls_and_auth: object):  # type: ignore[no-untyped-def]
    from hfsampler.remote_write.config import parse_remote_write

    entry = {
        "url": prom.write_url,
        "name": name,
        "queue_config": {"batch_send_deadline": "50ms", "min_backoff": "50ms", "max_backoff": "1s"},
        **tls_and_auth,
    }
    (ep,) = parse_remote_write([entry])
    return ep


async def _push(endpoints, seconds: float, metric: str):  # type: ignore[no-untyped-def]
    from hfsampler.remote_write.intake import RemoteWriter
    from hfsampler.selfmetrics import SelfMetrics
    from hfsampler.series import SeriesRegistry, Snapshot

    reg = SeriesRegistry()
    metrics = SelfMetrics()
    writers = []
    now_ms = int(time.time() * 1000)
    for ep in endpoints:
        series = [reg.series(metric, {"endpoint": ep.remote_name})]
        w = RemoteWriter(ep, metrics)
        await w.start()
        for i in range(3):
            w.push(Snapshot(now_ms - 3000 + 1000 * i, series, [float(i)]))
        writers.append(w)
    await asyncio.sleep(seconds)
    for w in writers:
        await w.close(0.1)
    return metrics


def _requests(metrics, ep, status: str) -> float:  # type: ignore[no-untyped-def]
    from hfsampler import selfmetrics as sm

    return metrics.get(
        sm.RW_REQUESTS, {"remote_name": ep.remote_name, "url": ep.display_url, "status": status}
    )


def test_tls_basic_auth_and_mtls(
    secure_prometheus: SecurePrometheus, pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = make_pki(tmp_path / "other", "untrusted")
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    client = {"cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}
    good = _endpoint(
        secure_prometheus,
        pki,
        "good",
        basic_auth={"username": USER, "password_file": str(password_file)},
        tls_config={"ca_file": str(pki.ca_file), **client},
    )
    wrong = _endpoint(
        secure_prometheus,
        pki,
        "wrong",
        basic_auth={"username": USER, "password": WRONG},
        tls_config={"ca_file": str(pki.ca_file), **client},
    )
    untrusted = _endpoint(
        secure_prometheus,
        pki,
        "untrusted",
        basic_auth={"username": USER, "password": PASSWORD},
        tls_config={"ca_file": str(other.ca_file), **client},
    )
    no_cert = _endpoint(
        secure_prometheus,
        pki,
        "nocert",
        basic_auth={"username": USER, "password": PASSWORD},
        tls_config={"ca_file": str(pki.ca_file)},
    )
    assert PASSWORD not in repr(good) + repr(untrusted)
    metric = "hfsampler_secure_push_test"
    with caplog.at_level(logging.DEBUG):
        metrics = asyncio.run(_push([good, wrong, untrusted, no_cert], 3.0, metric))
    result = secure_prometheus.query(f"count_over_time({metric}[1m])")
    by_endpoint = {r["metric"]["endpoint"]: float(r["value"][1]) for r in result}
    assert by_endpoint == {"good": 3.0}
    # Wrong password: 401 for the one batch, never retried.
    assert _requests(metrics, wrong, "401") == 1
    assert _requests(metrics, wrong, "error") == 0
    # TLS failures: retried, but no faster than max_backoff (1 s) after the first few.
    for ep in (untrusted, no_cert):
        errors = _requests(metrics, ep, "error")
        assert 1 <= errors <= 6, (ep.remote_name, errors)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "TLS certificate not trusted" in text
    assert "nocert" in text
    assert "TLS" in text.split("nocert", 1)[1].splitlines()[0]
    assert "401" in text
    for secret in (PASSWORD, WRONG):
        assert secret not in text
        assert secret not in secure_prometheus.log_text()
    for _, key, _ in metrics.samples():
        assert PASSWORD not in str(key)

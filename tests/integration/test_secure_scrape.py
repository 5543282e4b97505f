"""A real Prometheus scrapes hfsampler's /metrics behind ``--web-config-file``: mutual TLS with
a test CA and basic auth with a bcrypt hash, as dcgm-exporter's and node_exporter's endpoints.

These need real processes: Go's TLS client and Prometheus's ``basic_auth`` / ``tls_config``
are what a deployment scrapes with (Python's client is tested in tests/export/test_web.py), and
the exit status of a refused file is the process's. The scrape with the right credentials is
``up == 1``; without the password, with a wrong one, without a client certificate or in clear,
the target is down with the reason Prometheus gives; no secret reaches hfsampler's log.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import receivers as rx
from certs import Pki, make_pki

pytestmark = pytest.mark.integration

USER = "prometheus"
PASSWORD = "Scrape-Pa55word-e41b"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=6)).decode()
TOKEN = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_hfsampler(
    pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, Path]]:
    """`hfsampler run` on the sim, /metrics behind mutual TLS and basic auth: (port, log)."""
    root = tmp_path_factory.mktemp("hfsampler")
    web = root / "web.yml"
    web.write_text(json.dumps({
        "tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
                              "client_ca_file": str(pki.ca_file),
                              "client_auth_type": "RequireAndVerifyClientCert"},
        "basic_auth_users": {USER: HASH},
    }))  # fmt: skip
    port = rx.free_port()
    log = root / "hfsampler.log"
    extra = ["--web-config-file", str(web), "--log-level", "debug"]
    args = rx.sim_run_args([], listen=f"127.0.0.1:{port}", gpus=1, duration="300s", extra=extra)
    proc = rx.spawn_cli(args, log)
    try:
        deadline = time.monotonic() + 60
        while "serving /metrics" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield port, log
    finally:
        assert rx.stop_cli(proc) == 0, log.read_text()[-3000:]


def _job(name: str, port: int, scheme: str = "https", **extra: Any) -> dict[str, Any]:
    return {"job_name": name, "scheme": scheme, "scrape_interval": "1s", "scrape_timeout": "1s",
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}], **extra}  # fmt: skip


def test_prometheus_scrapes_only_with_its_certificate_and_password(
    secure_hfsampler: tuple[int, Path], pki: Pki, prometheus_build: rx.PrometheusBuild,
    tmp_path: Path,
) -> None:  # fmt: skip
    port, log = secure_hfsampler
    client = {"ca_file": str(pki.ca_file), "cert_file": str(pki.client_cert),
              "key_file": str(pki.client_key)}  # fmt: skip
    auth = {"username": USER, "password": PASSWORD}
    jobs = [
        _job("secure", port, basic_auth=auth, tls_config=client),
        _job("no-password", port, tls_config=client),
        _job("wrong-password", port, tls_config=client,
             basic_auth={"username": USER, "password": "not-the-password"}),
        _job("no-client-cert", port, basic_auth=auth, tls_config={"ca_file": str(pki.ca_file)}),
        _job("clear", port, scheme="http", basic_auth=auth),
    ]  # fmt: skip
    prom = rx.start_prometheus(tmp_path / "prom", jobs, name=prometheus_build.name,
                               binary=prometheus_build.binary)  # fmt: skip
    try:
        up = prom.wait_for('up{job="secure"} == 1', timeout_s=30)
        assert up, prom.query("up")
        assert prom.wait_for('DCGM_FI_DEV_POWER_USAGE{job="secure"}', timeout_s=10)
        deadline = time.monotonic() + 30
        while True:
            targets = {t["labels"]["job"]: t for t in
                       prom.api("/api/v1/targets")["data"]["activeTargets"]}  # fmt: skip
            if all(t["lastScrape"] != "0001-01-01T00:00:00Z" for t in targets.values()):
                break
            assert time.monotonic() < deadline, targets
            time.sleep(0.2)
        assert targets["secure"]["health"] == "up", targets["secure"]
        for job in ("no-password", "wrong-password"):
            assert targets[job]["health"] == "down", targets[job]
            assert "401" in targets[job]["lastError"], targets[job]
        # asyncio closes a failed handshake without its alert: Go reads EOF (or a reset)
        for job in ("no-client-cert", "clear"):
            assert targets[job]["health"] == "down", targets[job]
            assert targets[job]["lastError"], targets[job]
        for job in ("no-password", "wrong-password", "no-client-cert", "clear"):
            assert not prom.query(f'{{job="{job}", __name__=~"DCGM_.*|hfsampler_.*"}}'), job
    finally:
        prom.stop()
    logged = log.read_text()
    assert "serving /metrics and /healthz on https://" in logged
    assert "Traceback" not in logged
    for secret in (PASSWORD, TOKEN, HASH, HASH[7:]):
        assert secret not in logged


def test_a_bad_web_config_file_stops_the_start_with_exit_2(tmp_path: Path, pki: Pki) -> None:
    web = tmp_path / "web.yml"
    web.write_text(json.dumps({"tls_server_config": {
        "cert_file": str(pki.server_cert), "key_file": str(pki.client_key)},
        "basic_auth_users": {USER: HASH}}))  # fmt: skip
    done = rx.run_cli(["run", "--source", "sim", "--web-config-file", str(web), "--duration", "2s"])
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        "hfsampler: error: web_config_file: tls_server_config.cert_file: cannot load "
    ), line
    web.write_text(json.dumps({"basic_auth_users": {USER: PASSWORD}}))  # a clear password
    done = rx.run_cli(["run", "--source", "sim", "--web-config-file", str(web), "--duration", "2s"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        f"hfsampler: error: web_config_file: basic_auth_users.{USER}: is not a bcrypt hash"
    )
    assert PASSWORD not in done.stderr + done.stdout

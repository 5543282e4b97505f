"""Prometheus-style remote_write blocks parse; mistakes name the key path and the fix."""

from __future__ import annotations

import pytest
import yaml

from hfsampler.durations import parse_prometheus_duration as parse_duration
from hfsampler.errors import ConfigError
from hfsampler.remote_write.config import (
    EndpointConfig,
    QueueConfig,
    endpoint_from_url,
    parse_remote_write,
    redact_url,
)

PASTED = """
remote_write:
  - url: "https://mimir.example.com/api/v1/push"
    name: mimir-eu
    remote_timeout: 10s
    headers:
      X-Scope-OrgID: team-gpu
    queue_config:
      capacity: 20000
      max_shards: 10
      min_shards: 2
      max_samples_per_send: 5000
      batch_send_deadline: 1s
      min_backoff: 100ms
      max_backoff: 1m30s
      retry_on_http_429: false
  - url: http://prometheus:9090/api/v1/write
"""


def parse(text: str) -> tuple[EndpointConfig, ...]:
    return parse_remote_write(yaml.safe_load(text)["remote_write"])


def error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text)
    return info.value


def test_pasted_prometheus_block_parses() -> None:
    mimir, prom = parse(PASTED)
    assert mimir.url == "https://mimir.example.com/api/v1/push"
    assert mimir.name == "mimir-eu"
    assert mimir.remote_name == "mimir-eu"
    assert mimir.remote_timeout_s == 10.0
    assert dict(mimir.headers) == {"X-Scope-OrgID": "team-gpu"}
    assert mimir.queue == QueueConfig(
        capacity=20000,
        capacity_set=True,  # given: the user's bound, not sized from the plan
        max_shards=10,
        min_shards=2,
        max_samples_per_send=5000,
        batch_send_deadline_s=1.0,
        min_backoff_s=0.1,
        max_backoff_s=90.0,
        retry_on_http_429=False,
    )
    assert prom.queue == QueueConfig()
    assert prom.remote_timeout_s == 30.0
    assert len(prom.remote_name) == 6


def test_prometheus_defaults() -> None:
    q = QueueConfig()
    assert (q.capacity, q.max_shards, q.min_shards, q.max_samples_per_send) == (10000, 50, 1, 2000)
    # every window is sent as soon as it is queued; the backoffs are Prometheus's
    assert (q.batch_send_deadline_s, q.min_backoff_s, q.max_backoff_s) == (0.0, 0.03, 5.0)
    assert q.retry_on_http_429 is True


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("100ms", 0.1), ("5m", 300.0), ("1h30m", 5400.0), ("0", 0.0), ("1d", 86400.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "k") == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "30", "1.5s", "s", "5 m", "30sec", 30, True, None])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(bad, "remote_write[0].remote_timeout")
    assert info.value.key == "remote_write[0].remote_timeout"


def test_typo_in_queue_config_names_full_path_and_suggests() -> None:
    err = error(
        """
remote_write:
  - url: http://a/api/v1/write
    queue_config:
      max_shard: 3
"""
    )
    assert err.key == "remote_write[0].queue_config.max_shard"
    assert "max_shards" in err.fix
    assert str(err).startswith("remote_write[0].queue_config.max_shard: ")


def test_typo_in_endpoint_suggests() -> None:
    err = error("remote_write:\n  - url: http://a/\n  - url: http://b/\n    remote_timout: 5s\n")
    assert err.key == "remote_write[1].remote_timout"
    assert "remote_timeout" in err.fix


@pytest.mark.parametrize(
    "key",
    ["sigv4", "oauth2", "azuread", "google_iam"],
)
def test_unsupported_prometheus_keys(key: str) -> None:
    err = error(f"remote_write:\n  - url: http://a/\n    {key}: {{}}\n")
    assert err.key == f"remote_write[0].{key}"
    assert "not supported yet" in err.problem


def test_unsupported_queue_key() -> None:
    err = error(
        "remote_write:\n  - url: http://a/\n    queue_config:\n      sample_age_limit: 5m\n"
    )
    assert err.key == "remote_write[0].queue_config.sample_age_limit"
    assert "0s only" in err.problem  # Prometheus's default, no age limit, is what hfsampler does


@pytest.mark.parametrize(
    ("queue", "key"),
    [
        ("min_shards: 5\n      max_shards: 2", "min_shards"),
        ("capacity: 0", "capacity"),
        ("max_samples_per_send: -1", "max_samples_per_send"),
        ("max_shards: true", "max_shards"),
        ("batch_send_deadline: -1s", "batch_send_deadline"),
        ("min_backoff: 0s", "min_backoff"),
        ("min_backoff: 10s\n      max_backoff: 1s", "min_backoff"),
        ("retry_on_http_429: maybe", "retry_on_http_429"),
        ("capacity: 1.5", "capacity"),
    ],
)
def test_bad_queue_values(queue: str, key: str) -> None:
    err = error(f"remote_write:\n  - url: http://a/\n    queue_config:\n      {queue}\n")
    assert err.key == f"remote_write[0].queue_config.{key}"


@pytest.mark.parametrize(
    "url", ["ftp://a/", "http:///path", "prometheus:9090/api/v1/write", "", "http://a:notaport/"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_remote_write([{"url": url}])
    assert info.value.key == "remote_write[0].url"


def test_missing_url_and_bad_shapes() -> None:
    assert error("remote_write:\n  - name: x\n").key == "remote_write[0].url"
    with pytest.raises(ConfigError, match="list"):
        parse_remote_write({"url": "http://a/"})
    with pytest.raises(ConfigError, match=r"remote_write\[0\]"):
        parse_remote_write(["http://a/"])
    assert parse_remote_write(None) == ()


@pytest.mark.parametrize(
    "header",
    ["Content-Encoding", "content-type", "X-Prometheus-Remote-Write-Version", "User-Agent"],
)
def test_protocol_headers_cannot_be_overridden(header: str) -> None:
    err = error(f"remote_write:\n  - url: http://a/\n    headers:\n      {header}: x\n")
    assert err.key == f"remote_write[0].headers.{header}"


def test_duplicate_names_rejected() -> None:
    err = error("remote_write:\n  - url: http://a/\n    name: x\n  - url: http://b/\n    name: x\n")
    assert err.key == "remote_write[1].name"


def test_protobuf_message_takes_prometheus_values() -> None:
    (ep,) = parse_remote_write(
        yaml.safe_load("- url: http://a/\n  protobuf_message: io.prometheus.write.v2.Request\n")
    )
    assert ep.protobuf_message == "io.prometheus.write.v2.Request"
    (ep,) = parse_remote_write(yaml.safe_load("- url: http://a/\n"))
    assert ep.protobuf_message == "prometheus.WriteRequest"
    err = error("remote_write:\n  - url: http://a/\n    protobuf_message: v2\n")
    assert err.key == "remote_write[0].protobuf_message"
    assert "io.prometheus.write.v2.Request" in str(err)


SECRET_URL = "https://alice:hunter2@rw.example.com:8443/push?token=s3cr3t&tenant=t1#frag"


def test_redact_url_hides_credentials() -> None:
    shown = redact_url(SECRET_URL)
    assert "hunter2" not in shown
    assert "alice" not in shown
    assert "s3cr3t" not in shown
    assert "t1" not in shown
    assert shown.startswith("https://<redacted>@rw.example.com:8443/push?token=")
    assert redact_url("http://[::1]:9090/w") == "http://[::1]:9090/w"


def test_secrets_never_in_errors_or_repr() -> None:
    secret_header = {"Authorization": "Bearer topsecret"}
    cfg = EndpointConfig(url=SECRET_URL, headers=secret_header)
    for text in (repr(cfg), str(cfg), cfg.display_url):
        assert "hunter2" not in text
        assert "s3cr3t" not in text
        assert "topsecret" not in text
    for bad in (
        "ftp://alice:hunter2@host/?token=s3cr3t",
        "https://alice:hunter2@/?token=s3cr3t",
        "https://alice:hunter2@host:99999/?token=s3cr3t",
    ):
        with pytest.raises(ConfigError) as info:
            parse_remote_write([{"url": bad, "headers": {"User-Agent": "topsecret"}}])
        assert "hunter2" not in str(info.value)
        assert "s3cr3t" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_remote_write([{"url": "http://a/", "headers": {"X-Token": 12345}}])
    assert "12345" not in str(info.value)


def test_endpoint_from_url() -> None:
    cfg = endpoint_from_url("http://localhost:9090/api/v1/write")
    assert cfg.queue == QueueConfig()
    assert cfg.remote_timeout_s == 30.0
    with pytest.raises(ConfigError) as info:
        endpoint_from_url("localhost:9090")
    assert "--remote-write" in info.value.key


def test_configs_are_frozen() -> None:
    cfg = endpoint_from_url("http://a/")
    with pytest.raises(AttributeError):
        cfg.url = "http://b/"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.headers["X"] = "y"  # type: ignore[index]


# -- edge delivery: flavours, tenants, auth, proxy, disk bound -----------------------------------


@pytest.mark.parametrize(
    ("flavor", "url", "expected"),
    [
        ("mimir", "http://m:8080", "http://m:8080/api/v1/push"),
        ("thanos", "http://t:19291/", "http://t:19291/api/v1/receive"),
        ("prometheus", "http://p:9090", "http://p:9090/api/v1/write"),
        ("victoriametrics", "http://v:8428", "http://v:8428/api/v1/write"),
        ("mimir", "http://m/custom/push", "http://m/custom/push"),  # an explicit path stays
    ],
)
def test_flavor_default_paths(flavor: str, url: str, expected: str) -> None:
    (ep,) = parse(f"remote_write:\n  - url: {url}\n    flavor: {flavor}\n")
    assert ep.url == expected
    assert ep.flavor == flavor


def test_tenant_headers_and_conflicts() -> None:
    (ep,) = parse("remote_write:\n  - url: http://m/\n    flavor: mimir\n    tenant: gpu\n")
    assert dict(ep.headers) == {"X-Scope-OrgID": "gpu"}
    (ep,) = parse("remote_write:\n  - url: http://t/\n    flavor: thanos\n    tenant: gpu\n")
    assert dict(ep.headers) == {"THANOS-TENANT": "gpu"}
    err = error("remote_write:\n  - url: http://m/\n    tenant: gpu\n")
    assert err.key == "remote_write[0].tenant"
    assert "flavor" in err.problem
    err = error(
        "remote_write:\n  - url: http://m/\n    flavor: mimir\n    tenant: a\n"
        "    headers: {x-scope-orgid: b}\n"
    )
    assert "conflicts" in err.problem
    err = error("remote_write:\n  - url: http://m/\n    flavor: cortex\n")
    assert err.key == "remote_write[0].flavor"


def test_auth_methods_are_exclusive_and_secrets_hidden() -> None:
    (ep,) = parse(
        "remote_write:\n  - url: http://a/\n    basic_auth: {username: u, password: hunter22}\n"
    )
    assert ep.auth is not None
    assert ep.auth.username == "u"
    assert "hunter22" not in repr(ep)
    assert "hunter22" not in ep.auth.describe()
    err = error(
        "remote_write:\n  - url: http://a/\n    basic_auth: {username: u, password: p}\n"
        "    bearer_token: t\n"
    )
    assert "cannot be combined" in err.problem
    err = error(
        "remote_write:\n  - url: http://a/\n    authorization: {type: Basic, credentials: x}\n"
    )
    assert err.key == "remote_write[0].authorization.type"
    err = error("remote_write:\n  - url: http://a/\n    basic_auth: {username: u, password: 5}\n")
    assert "5" not in str(err).replace("[0]", "")  # the value is never echoed
    err = error(
        "remote_write:\n  - url: http://a/\n    bearer_token: t\n    headers: {Authorization: x}\n"
    )
    assert "conflicts" in err.problem


def test_proxy_and_max_disk_bytes() -> None:
    (ep,) = parse(
        "remote_write:\n  - url: http://a/\n    proxy_url: http://u:pw@proxy:3128\n"
        "    queue_config: {max_disk_bytes: 256MiB}\n"
    )
    assert ep.queue.max_disk_bytes == 256 << 20
    assert "pw" not in repr(ep)
    err = error("remote_write:\n  - url: http://a/\n    proxy_url: socks5://p:1080\n")
    assert err.key == "remote_write[0].proxy_url"
    err = error("remote_write:\n  - url: http://a/\n    queue_config: {max_disk_bytes: 10}\n")
    assert err.key == "remote_write[0].queue_config.max_disk_bytes"
    err = error("remote_write:\n  - url: http://a/\n    queue_config: {max_disk_bytes: lots}\n")
    assert "not a size" in err.problem


def test_endpoints_that_would_share_a_spool_or_an_authorization_are_refused() -> None:
    err = error(
        "remote_write:\n  - url: http://a/\n    name: a/b\n  - url: http://b/\n    name: a_b\n"
    )
    assert err.key == "remote_write[1].name"
    assert "spool directory 'a_b'" in str(err)
    err = error("remote_write:\n  - url: http://u:p@a/\n    bearer_token: t0k3n-xyz\n")
    assert err.key == "remote_write[0].url"
    assert "t0k3n-xyz" not in str(err)


HARMLESS = """
remote_write:
  - url: http://a/
    send_exemplars: false
    send_native_histograms: false
    follow_redirects: false
    enable_http2: true
    round_robin_dns: false
    proxy_from_environment: false
    no_proxy: ""
    metadata_config: {send: false}
    queue_config: {sample_age_limit: 0s}
"""


def test_a_pasted_block_with_values_that_mean_what_hfsampler_does_parses() -> None:
    (ep,) = parse(HARMLESS)
    assert ep.send_metadata is False
    assert ep.follow_redirects is False
    assert ep.send_native_histograms is False
    assert parse("remote_write:\n  - url: http://a/\n")[0].follow_redirects  # as Prometheus
    assert parse("remote_write:\n  - url: http://a/\n    metadata_config: {}\n")[0].send_metadata


def test_every_key_hfsampler_does_not_take_is_named_in_one_message() -> None:
    err = error(
        "remote_write:\n  - url: http://a/\n    round_robin_dns: true\n    sigv4: {}\n"
        "    metadata_config: {send_interval: 1m}\n  - url: http://b/\n    remote_timout: 5s\n"
        "    queue_config: {sample_age_limit: 5m}\n    tls_config: {min_version: TLS13}\n"
    )
    text = str(err)
    for key in (
        "remote_write[0].round_robin_dns: True: takes false only: hfsampler does not spread",
        "remote_write[0].sigv4: is not supported yet",
        "remote_write[0].metadata_config.send_interval: is not supported",
        "remote_write[1].remote_timout: is not a known key (did you mean 'remote_timeout'?)",
        "remote_write[1].queue_config.sample_age_limit",
        "remote_write[1].tls_config.min_version",
    ):
        assert key in text
    assert text.startswith("6 keys to fix: ")
    assert "\n" not in text


def test_a_value_that_asks_for_what_hfsampler_does_not_do_is_refused() -> None:
    err = error("remote_write:\n  - url: http://a/\n    proxy_from_environment: true\n")
    assert err.key == "remote_write[0].proxy_from_environment"
    assert "proxy_url" in err.fix


def test_send_native_histograms_is_off_unless_asked() -> None:
    assert parse("remote_write:\n  - url: http://a/\n")[0].send_native_histograms is False
    on = parse("remote_write:\n  - url: http://a/\n    send_native_histograms: true\n")
    assert on[0].send_native_histograms is True
    err = error("remote_write:\n  - url: http://a/\n    send_native_histograms: yes-please\n")
    assert err.key == "remote_write[0].send_native_histograms"

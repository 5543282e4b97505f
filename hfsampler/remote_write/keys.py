"""Which ``remote_write`` keys hfsampler takes: Prometheus's, documented for the reference, and
those taken only with the values that mean what hfsampler does anyway.

``unsupported_keys`` names every key of a block that hfsampler does not take, nested ones
included, so that one message lists them all and a pasted block is fixed in one edit.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hfsampler.durations import parse_prometheus_duration as parse_duration
from hfsampler.errors import ConfigError
from hfsampler.remote_write.security import TLS_KEYS, TLS_UNSUPPORTED


@dataclass(frozen=True, slots=True)
class KeyDoc:
    """A ``remote_write`` key as the configuration reference shows it."""

    type: str
    default: str
    doc: str


@dataclass(frozen=True, slots=True)
class Accepted:
    """A Prometheus key hfsampler takes only with values that mean what it does anyway."""

    accepts: Callable[[object], bool]
    doc: str  # what hfsampler does, and so which values it takes
    fix: str  # for any other value


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_empty(value: object) -> bool:
    return value is None or value == "" or value == {} or value == []


def _is_zero_duration(value: object) -> bool:
    try:
        return parse_duration(value, "") == 0
    except ConfigError:
        return False


ENDPOINT_KEYS: Mapping[str, KeyDoc] = MappingProxyType(
    {
        "url": KeyDoc("URL", "required", "the receiver's write URL"),
        "name": KeyDoc("string", "hash of url", "the remote_name label; unique per endpoint"),
        "remote_timeout": KeyDoc("duration", "30s", "how long one request may take"),
        "headers": KeyDoc("name: value", "none", "HTTP headers sent with every request"),
        "queue_config": KeyDoc("mapping", "see below", "batching, retries and the spool bound"),
        "metadata_config": KeyDoc("mapping", "send: true", "send: false sends no metadata"),
        "protobuf_message": KeyDoc(
            "string", "prometheus.WriteRequest", "io.prometheus.write.v2.Request: Remote-Write 2.0"
        ),
        "flavor": KeyDoc("string", "none", "the receiver: " + "prometheus, mimir, thanos, "
                         "victoriametrics; sets the default path and the tenant header"),
        "tenant": KeyDoc("string", "none", "the tenant header's value (flavor mimir or thanos)"),
        "basic_auth": KeyDoc("mapping", "none", "username with password or password_file"),
        "authorization": KeyDoc("mapping", "none", "type with credentials or credentials_file"),
        "bearer_token": KeyDoc("string", "none", "a Bearer token, inline"),
        "bearer_token_file": KeyDoc("path", "none", "a Bearer token, read from the file"),
        "tls_config": KeyDoc("mapping", "none", "ca_file, cert_file, key_file, server_name, "
                             "insecure_skip_verify"),
        "proxy_url": KeyDoc("URL", "none", "an HTTP proxy for this endpoint"),
        "follow_redirects": KeyDoc("bool", "true", "follow a 307 or 308 to the same scheme, host "
                                   "and port; any other 3xx is a refusal"),
        "write_relabel_configs": KeyDoc("list of rules", "none", "relabel series before sending"),
        "send_native_histograms": KeyDoc("bool", "false", "send the native histograms of "
                                         "`histograms:` here (Prometheus 2.40+ with the feature "
                                         "flag, 3, Mimir, Thanos); other endpoints get "
                                         "everything else"),
    }
)  # fmt: skip
QUEUE_KEYS: Mapping[str, KeyDoc] = MappingProxyType(
    {
        "capacity": KeyDoc("whole number", "10 windows", "samples queued in memory per shard; "
                           "default: 10 windows of the plan or 10000, the more; never below "
                           "one window"),
        "max_shards": KeyDoc("whole number", "50", "validated, not used: hfsampler does not "
                             "reshard"),
        "min_shards": KeyDoc("whole number", "1", "shards (connections) per endpoint"),
        "max_samples_per_send": KeyDoc("whole number", "2000", "samples per request at most"),
        "max_samples_per_drain_send": KeyDoc("whole number", "10000", "with queue_dir: samples "
                                             "per request at most while a backlog drains from "
                                             "the spool's files; default: 10000, or "
                                             "max_samples_per_send if not 2000 (hfsampler's)"),
        "batch_send_deadline": KeyDoc("duration", "0s", "wait to fill a batch; 0: send each "
                                      "window at once"),
        "min_backoff": KeyDoc("duration", "30ms", "the first retry's delay"),
        "max_backoff": KeyDoc("duration", "5s", "the longest retry delay"),
        "retry_on_http_429": KeyDoc("bool", "true", "retry a 429 answer"),
        "max_disk_bytes": KeyDoc("size", "1GiB", "with queue_dir: the spool's bound (hfsampler's)"),
        "max_request_bytes": KeyDoc("size", "8MiB", "a request's uncompressed size at most "
                                    "(hfsampler's)"),
        "max_retry_after": KeyDoc("duration", "5m", "the longest Retry-After honoured "
                                  "(hfsampler's)"),
    }
)  # fmt: skip
METADATA_KEYS: Mapping[str, KeyDoc] = MappingProxyType(
    {"send": KeyDoc("bool", "true", "send each family's type, help and unit")}
)
_QUEUE_KEYS = tuple(QUEUE_KEYS)
_ENDPOINT_KEYS = tuple(ENDPOINT_KEYS)
_METADATA_KEYS = tuple(METADATA_KEYS)
_REMOVE = "remove it or push through a Prometheus agent"
# Keys Prometheus takes whose every value asks for what hfsampler cannot do.
_ENDPOINT_UNSUPPORTED = ("sigv4", "azuread", "google_iam", "oauth2")
_QUEUE_UNSUPPORTED: tuple[str, ...] = ()
_METADATA_UNSUPPORTED = ("send_interval", "max_samples_per_send")
_METADATA_WHY = (
    "hfsampler sends a family's metadata once, with its first samples (2.0: on every series)"
)
ENDPOINT_ACCEPTED: Mapping[str, Accepted] = MappingProxyType(
    {
        "send_exemplars": Accepted(
            _is_bool, "true or false: hfsampler has no exemplars to send", "write true or false"
        ),
        "enable_http2": Accepted(
            _is_bool, "true or false: hfsampler speaks HTTP/1.1, which HTTP/2 receivers take too",
            "write true or false",
        ),
        "round_robin_dns": Accepted(
            lambda v: v is False, "false only: hfsampler does not spread requests over a name's "
            "addresses", "remove it",
        ),
        "proxy_from_environment": Accepted(
            lambda v: v is False, "false only: hfsampler does not read HTTP_PROXY",
            "give the proxy as proxy_url",
        ),
        "no_proxy": Accepted(_is_empty, "empty only: a proxy is set per endpoint (proxy_url)",
                             "leave proxy_url out of the endpoints the proxy is not for"),
        "proxy_connect_header": Accepted(_is_empty, "empty only", _REMOVE),
        "http_headers": Accepted(_is_empty, "empty only", "give the headers in headers"),
    }
)  # fmt: skip
QUEUE_ACCEPTED: Mapping[str, Accepted] = MappingProxyType(
    {
        "sample_age_limit": Accepted(
            _is_zero_duration, "0s only: hfsampler drops no sample for its age",
            "remove it: a window's samples are sent as soon as it ends",
        )
    }
)  # fmt: skip


def _key_problems(
    raw: Mapping[object, object],
    path: str,
    known: tuple[str, ...],
    unsupported: tuple[str, ...] = (),
    accepted: Mapping[str, Accepted] = MappingProxyType({}),
) -> list[ConfigError]:
    """Each key of ``raw`` hfsampler does not take, with why: unknown (and the likeliest meant),
    unsupported, or given a value that asks for what hfsampler does not do."""
    out = []
    for k, v in raw.items():
        if not isinstance(k, str):
            out.append(ConfigError(f"{path}", f"has a non-string key {k!r}"))
        elif k in known:
            continue
        elif k in accepted:
            if not accepted[k].accepts(v):
                out.append(ConfigError(f"{path}.{k}", f"{v!r}: takes {accepted[k].doc}",
                                       accepted[k].fix))  # fmt: skip
        elif k in unsupported:
            out.append(ConfigError(f"{path}.{k}", "is not supported yet", _REMOVE))
        else:
            close = difflib.get_close_matches(k, (*known, *accepted, *unsupported), n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            out.append(ConfigError(f"{path}.{k}", "is not a known key", fix))
    return out


def unsupported_keys(entries: object, key: str = "remote_write") -> list[ConfigError]:
    """Every key of a ``remote_write`` list hfsampler does not take, nested ones included, so
    that one message can name them all (a pasted block is fixed in one edit)."""
    out: list[ConfigError] = []
    for i, raw in enumerate(entries if isinstance(entries, list) else ()):
        if not isinstance(raw, Mapping):
            continue  # parsing names it
        path = f"{key}[{i}]"
        out += _key_problems(raw, path, _ENDPOINT_KEYS, _ENDPOINT_UNSUPPORTED, ENDPOINT_ACCEPTED)
        nested: tuple[tuple[str, tuple[str, ...], tuple[str, ...], Mapping[str, Accepted]], ...]
        nested = (
            ("queue_config", _QUEUE_KEYS, _QUEUE_UNSUPPORTED, QUEUE_ACCEPTED),
            ("metadata_config", _METADATA_KEYS, _METADATA_UNSUPPORTED, {}),
            ("tls_config", TLS_KEYS, TLS_UNSUPPORTED, {}),
        )
        for name, known, unsupported, accepted in nested:
            block = raw.get(name)
            if isinstance(block, Mapping):
                problems = _key_problems(block, f"{path}.{name}", known, unsupported, accepted)
                if name == "metadata_config":
                    problems = [_why(e, _METADATA_WHY) for e in problems]
                out += problems
    return out


def _why(err: ConfigError, why: str) -> ConfigError:
    if err.problem != "is not supported yet":
        return err
    return ConfigError(err.key, "is not supported", why)

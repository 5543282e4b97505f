"""Remote-Write endpoint settings: Prometheus's ``remote_write`` block, parsed and validated.

``parse_remote_write`` takes the already-loaded YAML value exactly as a Prometheus user would paste
it; every mistake becomes a ``ConfigError`` that names the full key path and the fix. URLs may
carry credentials (userinfo, a token in the query), so only ``redact_url`` output is ever shown.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# a pasted remote_write block keeps Prometheus's duration grammar
from hfsampler.durations import parse_prometheus_duration as parse_duration
from hfsampler.errors import ConfigError, one_error
from hfsampler.remote_write.keys import unsupported_keys
from hfsampler.remote_write.relabel import RelabelRule, parse_rules
from hfsampler.remote_write.security import (
    MIN_SECRET_CHARS,
    AuthConfig,
    TLSConfig,
    auth_forms,
    parse_auth,
    parse_tls,
    url_secrets,
)

# Headers the protocol sets itself or HTTP owns; a user value would break the request.
RESERVED_HEADERS = frozenset(
    h.lower()
    for h in (
        "Content-Encoding",
        "Content-Type",
        "Content-Length",
        "X-Prometheus-Remote-Write-Version",
        "User-Agent",
        "Host",
        "Connection",
        "Transfer-Encoding",
    )
)


# RFC 9110: a field name is a token; a value has no control characters but horizontal tab.
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_HEADER_VALUE_BAD_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# Header names whose values are secrets: kept out of every log line, like passwords.
SECRET_HEADER_RE = re.compile(r"auth|token|key|secret|password|cookie|session", re.IGNORECASE)

# Receiver flavours: (default path when the URL has none, tenant header or None).
FLAVORS: Mapping[str, tuple[str, str | None]] = MappingProxyType(
    {
        "prometheus": ("/api/v1/write", None),
        "mimir": ("/api/v1/push", "X-Scope-OrgID"),
        "thanos": ("/api/v1/receive", "THANOS-TENANT"),
        "victoriametrics": ("/api/v1/write", None),
    }
)
DEFAULT_MAX_DISK_BYTES = 1 << 30
# Prometheus's queue_config.capacity; hfsampler sizes its queues from the plan (``sizing``) and
# holds at least this many samples per shard when capacity is not set.
DEFAULT_CAPACITY = 10000
# Samples per request while a spooled backlog drains, unless the user sized requests
# (QueueConfig.drain_samples): vmagent's -remoteWrite.maxRowsPerBlock.
DRAIN_SAMPLES = 10000
PROMETHEUS_MAX_SAMPLES_PER_SEND = 2000
# Each shard is one connection and one request in flight; a window is sent at once. hfsampler
# runs min_shards shards and does not reshard: max_shards (Prometheus's resharding bound) is
# validated, so that a pasted block keeps working, and said to be unused (QueueConfig.notes).
MAX_SHARDS = 200
# Prometheus's values for protobuf_message: Remote-Write 1.0 and 2.0.
PROTOBUF_V1 = "prometheus.WriteRequest"
PROTOBUF_V2 = "io.prometheus.write.v2.Request"
PROTOBUF_MESSAGES = (PROTOBUF_V1, PROTOBUF_V2)
# Uncompressed bytes per request: vmagent's block size, a quarter of Prometheus 3's 32 MiB
# decoded-body limit, and under the gRPC message limits behind Thanos Receive and Mimir.
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
MIN_MAX_REQUEST_BYTES = 4 << 10
MAX_MAX_REQUEST_BYTES = 32 << 20  # Prometheus 3 answers 400 (not 413) to bodies decoding larger
# Prometheus's and Kubernetes' spellings: decimal K, M, G, T (k too) with or without B; binary
# Ki, Mi, Gi, Ti with or without B. A whole or decimal amount; whole bytes in the end.
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kKMGT]i?B?|B)?\Z")
_SIZE_POWERS = {"k": 1, "K": 1, "M": 2, "G": 3, "T": 4}
# Larger than any disk or memory hfsampler could bound: a number this size is a typo.
MAX_SIZE_BYTES = 1 << 50


def redact_url(url: str) -> str:
    """The URL as it may be shown: no userinfo, query values replaced, fragment dropped."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparsable url>"
    netloc = host if ":" not in host else f"[{host}]"
    if port is not None:
        netloc += f":{port}"
    if parts.username is not None or parts.password is not None:
        netloc = "<redacted>@" + netloc
    query = urlencode([(k, "<redacted>") for k, _ in parse_qsl(parts.query, True)], safe="<>")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def parse_size(value: object, key: str) -> int:
    """Bytes from a whole number or a string such as ``512MiB``, ``2GB``, ``10Ti`` or ``1.5G``."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value.strip())):
        unit = m.group(2) or "B"
        base = 1024 if unit[1:2] == "i" else 1000
        size = int(Decimal(m.group(1)) * base ** _SIZE_POWERS.get(unit[0], 0))
    else:
        raise ConfigError(
            key, f"{value!r} is not a size", "write bytes or e.g. '512MiB', '2GB', '10Ti'"
        )
    if size > MAX_SIZE_BYTES:
        raise ConfigError(key, f"{value!r} is more than the most, 1PiB", "give a smaller size")
    return size


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Prometheus's ``queue_config``, with its defaults; durations in seconds."""

    capacity: int = DEFAULT_CAPACITY
    # whether the user gave capacity: an explicit value bounds the queue (never below one
    # window), the default is sized from the plan (``sizing.queue_bound``). Compared: even at
    # 10000 the two bounds differ, so a reload that gives or leaves out capacity restarts the
    # endpoint with its new bound
    capacity_set: bool = False
    max_shards: int = 50
    min_shards: int = 1
    max_samples_per_send: int = PROMETHEUS_MAX_SAMPLES_PER_SEND
    # hfsampler's own: samples per request when a backlog is read back from the spool's files;
    # None: ``drain_samples`` says
    max_samples_per_drain_send: int | None = None
    # hfsampler's one departure from Prometheus's defaults (5s): its samples arrive a whole
    # window at a time, so waiting after a window only adds latency (measured by
    # benchmarks/e2e.py: p99 4.5 s at 5s, 94 ms when each window is sent at once). 0 sends each
    # window as soon as it is queued; a larger value batches windows, as in Prometheus.
    batch_send_deadline_s: float = 0.0
    min_backoff_s: float = 0.03
    max_backoff_s: float = 5.0
    retry_on_http_429: bool = True
    max_disk_bytes: int = DEFAULT_MAX_DISK_BYTES  # with a queue_dir: the spool's bound
    # hfsampler's own: a request's uncompressed size; a larger batch goes as several requests
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # hfsampler's own: the longest Retry-After honoured (a longer one is capped, and logged)
    max_retry_after_s: float = 300.0

    def __post_init__(self) -> None:
        for key in ("capacity", "max_shards", "min_shards", "max_samples_per_send"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, "must be a whole number of at least 1")
        drain = self.max_samples_per_drain_send
        if drain is not None and (
            isinstance(drain, bool) or not isinstance(drain, int) or drain < 1
        ):
            raise ConfigError("max_samples_per_drain_send", "must be a whole number of at least 1")
        for key in ("min_shards", "max_shards"):
            if getattr(self, key) > MAX_SHARDS:
                raise ConfigError(
                    key,
                    f"is {getattr(self, key)}; at most {MAX_SHARDS} (one connection each)",
                    "a window's samples go at once: a few shards are plenty",
                )
        if self.min_shards > self.max_shards:
            raise ConfigError(
                "min_shards",
                f"is {self.min_shards}, more than max_shards {self.max_shards}",
                "make min_shards <= max_shards",
            )
        for key in ("batch_send_deadline", "min_backoff", "max_backoff", "max_retry_after"):
            value = getattr(self, key + "_s")
            least = 0 if key == "batch_send_deadline" else 1e-9
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= least:
                what = "zero or a positive duration" if least == 0 else "a positive duration"
                raise ConfigError(key, f"must be {what}")
        if self.min_backoff_s > self.max_backoff_s:
            raise ConfigError(
                "min_backoff", "is longer than max_backoff", "make min_backoff <= max_backoff"
            )
        if not isinstance(self.retry_on_http_429, bool):
            raise ConfigError("retry_on_http_429", "must be true or false")
        if (
            isinstance(self.max_disk_bytes, bool)
            or not isinstance(self.max_disk_bytes, int)
            or self.max_disk_bytes < 1 << 16
        ):
            raise ConfigError("max_disk_bytes", "must be at least 64KiB", "e.g. '1GiB'")
        size = self.max_request_bytes
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not MIN_MAX_REQUEST_BYTES <= size <= MAX_MAX_REQUEST_BYTES
        ):
            raise ConfigError(
                "max_request_bytes",
                f"must be between 4KiB and 32MiB, got {size!r}",
                "e.g. '8MiB' (Prometheus 3 refuses bodies over 32MiB decoded)",
            )

    @property
    def drain_samples(self) -> int:
        """Samples per request at most while a backlog is read back from the spool's files:
        ``max_samples_per_drain_send``; unset, ``DRAIN_SAMPLES`` while ``max_samples_per_send``
        is Prometheus's default, else ``max_samples_per_send`` (requests sized for a receiver
        stay that size). A drain's requests are its records joined as stored, so their cost is
        mostly per request, not per sample (vmagent sends its backlog in blocks of 10,000
        rows); every other request keeps to ``max_samples_per_send``."""
        if self.max_samples_per_drain_send is not None:
            return self.max_samples_per_drain_send
        if self.max_samples_per_send == PROMETHEUS_MAX_SAMPLES_PER_SEND:
            return DRAIN_SAMPLES
        return self.max_samples_per_send


@dataclass(frozen=True, slots=True, repr=False)
class EndpointConfig:
    """One Remote-Write receiver. ``repr`` and every message show the URL redacted."""

    url: str
    name: str = ""
    remote_timeout_s: float = 30.0
    headers: Mapping[str, str] = field(default_factory=dict)
    queue: QueueConfig = field(default_factory=QueueConfig)
    send_metadata: bool = True
    flavor: str = ""
    auth: AuthConfig | None = None
    tls: TLSConfig | None = None
    proxy_url: str = ""
    relabel: tuple[RelabelRule, ...] = ()
    protobuf_message: str = PROTOBUF_V1
    # Prometheus's default; a redirect off the configured scheme, host and port is never
    # followed (client.py), so true means "307 and 308 within the endpoint", false "none"
    follow_redirects: bool = True
    # Prometheus's key and default: native histograms go only to a receiver said to take them
    send_native_histograms: bool = False

    def __post_init__(self) -> None:
        _check_url(self.url)
        if self.protobuf_message not in PROTOBUF_MESSAGES:
            raise ConfigError(
                "protobuf_message",
                f"unknown message {self.protobuf_message!r}",
                "one of " + ", ".join(PROTOBUF_MESSAGES),
            )
        if not isinstance(self.name, str):
            raise ConfigError("name", "must be a string")
        if isinstance(self.remote_timeout_s, bool) or not isinstance(
            self.remote_timeout_s, int | float
        ):
            raise ConfigError("remote_timeout", "must be a positive duration")
        if not self.remote_timeout_s > 0:
            raise ConfigError("remote_timeout", "must be a positive duration", "e.g. '30s'")
        if not isinstance(self.headers, Mapping):
            raise ConfigError("headers", "must be a mapping of header name to value")
        for hname, hvalue in self.headers.items():
            if not isinstance(hname, str) or not isinstance(hvalue, str):
                # The value may be a secret: say only which header is wrong.
                raise ConfigError(f"headers.{hname}", "name and value must both be strings")
            if not _HEADER_NAME_RE.match(hname):
                raise ConfigError(
                    f"headers.{hname!r}",
                    "is not a valid header name (RFC 9110 token)",
                    "use letters, digits and -",
                )
            if _HEADER_VALUE_BAD_RE.search(hvalue):
                # never the value itself: it may be a secret
                raise ConfigError(
                    f"headers.{hname}",
                    "has a control character (CR, LF, NUL, ...) in its value",
                    "put the value on one line, without control characters",
                )
            if hname.lower() in RESERVED_HEADERS:
                raise ConfigError(
                    f"headers.{hname}",
                    "is set by the Remote-Write protocol and cannot be overridden",
                    "remove it",
                )
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        if not isinstance(self.queue, QueueConfig):
            raise ConfigError("queue_config", "must be a QueueConfig")
        if self.flavor and self.flavor not in FLAVORS:
            raise ConfigError(
                "flavor", f"unknown flavor {self.flavor!r}", "one of " + ", ".join(FLAVORS)
            )
        userinfo = False
        with contextlib.suppress(ValueError):  # _check_url has said what is wrong with it
            userinfo = urlsplit(self.url).username is not None
        if userinfo and self.auth is not None:
            raise ConfigError(
                "url",
                f"carries a user and password and {self.auth.kind} is set too",
                "keep one: the URL's user:password or the auth block",
            )
        if self.proxy_url:
            try:
                _check_url(self.proxy_url)
            except ConfigError as err:
                raise ConfigError("proxy_url", err.problem, err.fix) from None

    def secrets(self) -> tuple[str, ...]:
        """Every configured string that must never reach a log line (inline ones: file-held
        secrets are added by whoever reads them)."""
        out: list[str] = []
        if self.auth is not None:
            out += auth_forms(self.auth, self.auth.secret)
        out += [v for k, v in self.headers.items() if SECRET_HEADER_RE.search(k)]
        out += url_secrets(self.url) + url_secrets(self.proxy_url)
        return tuple(s for s in out if len(s) >= MIN_SECRET_CHARS)

    @property
    def display_url(self) -> str:
        """The URL without credentials, for logs, errors and metric labels."""
        return redact_url(self.url)

    @property
    def spool_name(self) -> str:
        """The directory under ``queue_dir`` this endpoint's spool lives in (a file name)."""
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.remote_name)[:64]

    @property
    def remote_name(self) -> str:
        """The ``remote_name`` label: the configured name, else a short hash of the URL."""
        return self.name or hashlib.sha256(self.url.encode()).hexdigest()[:6]

    def __repr__(self) -> str:
        return (
            f"EndpointConfig(url={self.display_url!r}, name={self.name!r}, "
            f"remote_timeout_s={self.remote_timeout_s!r}, headers={sorted(self.headers)!r}, "
            f"queue={self.queue!r}, send_metadata={self.send_metadata!r}, "
            f"flavor={self.flavor!r}, auth={self.auth!r}, tls={self.tls!r}, "
            f"proxy_url={redact_url(self.proxy_url) if self.proxy_url else ''!r}, "
            f"relabel_rules={len(self.relabel)}, protobuf_message={self.protobuf_message!r}, "
            f"send_native_histograms={self.send_native_histograms!r})"
        )


def _check_url(url: object) -> None:
    if not isinstance(url, str) or not url:
        raise ConfigError("url", "is required", "e.g. 'http://prometheus:9090/api/v1/write'")
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - parsing the port is what validates it
    except ValueError:
        raise ConfigError("url", f"{shown} is not a valid URL") from None
    if parts.scheme not in ("http", "https"):
        fix = "write it as http://... or https://..."
        raise ConfigError("url", f"{shown} must use http or https", fix)
    if not host:
        raise ConfigError("url", f"{shown} has no host")


def endpoint_from_url(url: str) -> EndpointConfig:
    """The endpoint for ``--remote-write URL``: Prometheus's defaults for everything else."""
    try:
        return EndpointConfig(url=url)
    except ConfigError as err:
        raise ConfigError(f"--remote-write {err.key}", err.problem, err.fix) from None


def parse_remote_write(entries: object, key: str = "remote_write") -> tuple[EndpointConfig, ...]:
    """Every endpoint of a Prometheus-style ``remote_write`` list (already loaded from YAML)."""
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise ConfigError(key, "must be a list of endpoints", "start each endpoint with '- url:'")
    problems = unsupported_keys(entries, key)
    if problems:
        raise one_error(problems)
    out = [_parse_endpoint(entry, f"{key}[{i}]") for i, entry in enumerate(entries)]
    check_unique_names(out, key)
    return tuple(out)


def check_unique_names(endpoints: Sequence[EndpointConfig], key: str = "remote_write") -> None:
    """Every endpoint has its own name and its own spool directory (``a/b`` and ``a_b`` would
    share one)."""
    seen: dict[str, int] = {}
    spools: dict[str, int] = {}
    for i, ep in enumerate(endpoints):
        if ep.remote_name in seen:
            raise ConfigError(
                f"{key}[{i}].name",
                f"{ep.remote_name!r} is already used by {key}[{seen[ep.remote_name]}]",
                "give every endpoint a unique name",
            )
        if ep.spool_name in spools:
            raise ConfigError(
                f"{key}[{i}].name",
                f"{ep.remote_name!r} would share the spool directory {ep.spool_name!r} with "
                f"{key}[{spools[ep.spool_name]}]",
                "names differ in more than characters other than letters, digits, . _ -",
            )
        seen[ep.remote_name] = i
        spools[ep.spool_name] = i


def _parse_endpoint(raw: object, path: str) -> EndpointConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(path, "must be a mapping", "each endpoint needs at least 'url:'")
    if "url" not in raw:
        raise ConfigError(f"{path}.url", "is required")
    url = raw["url"]
    flavor = raw.get("flavor", "")
    if not isinstance(flavor, str) or (flavor and flavor not in FLAVORS):
        raise ConfigError(
            f"{path}.flavor", f"unknown flavor {flavor!r}", "one of " + ", ".join(FLAVORS)
        )
    if flavor and isinstance(url, str):
        with contextlib.suppress(ValueError):
            if urlsplit(url).path in ("", "/"):
                url = url.rstrip("/") + FLAVORS[flavor][0]
    kwargs: dict[str, object] = {"url": url, "flavor": flavor}
    if "protobuf_message" in raw:
        kwargs["protobuf_message"] = raw["protobuf_message"]
    if "name" in raw:
        kwargs["name"] = raw["name"]
    if "remote_timeout" in raw:
        kwargs["remote_timeout_s"] = parse_duration(raw["remote_timeout"], f"{path}.remote_timeout")
    if "headers" in raw:
        kwargs["headers"] = {} if raw["headers"] is None else raw["headers"]
    if "tenant" in raw:
        kwargs["headers"] = _tenant_headers(raw, flavor, kwargs.get("headers", {}), path)
    kwargs["auth"] = parse_auth(raw, path)
    if "tls_config" in raw:
        kwargs["tls"] = parse_tls(raw["tls_config"], f"{path}.tls_config")
    if raw.get("proxy_url") is not None:
        kwargs["proxy_url"] = raw["proxy_url"]
    if "follow_redirects" in raw:
        if not isinstance(raw["follow_redirects"], bool):
            raise ConfigError(f"{path}.follow_redirects", "must be true or false")
        kwargs["follow_redirects"] = raw["follow_redirects"]
    if "send_native_histograms" in raw:
        if not isinstance(raw["send_native_histograms"], bool):
            raise ConfigError(f"{path}.send_native_histograms", "must be true or false")
        kwargs["send_native_histograms"] = raw["send_native_histograms"]
    if "write_relabel_configs" in raw:
        kwargs["relabel"] = parse_rules(
            raw["write_relabel_configs"], f"{path}.write_relabel_configs"
        )
    if "queue_config" in raw:
        kwargs["queue"] = _parse_queue(raw["queue_config"], f"{path}.queue_config")
    if "metadata_config" in raw:
        kwargs["send_metadata"] = _parse_metadata(raw["metadata_config"], f"{path}.metadata_config")
    try:
        return EndpointConfig(**kwargs)  # type: ignore[arg-type]
    except ConfigError as err:
        raise ConfigError(f"{path}.{err.key}", err.problem, err.fix) from None


def _tenant_headers(
    raw: Mapping[object, object], flavor: str, headers: object, path: str
) -> object:
    tenant = raw["tenant"]
    header = FLAVORS.get(flavor, ("", None))[1]
    if header is None:
        raise ConfigError(
            f"{path}.tenant",
            "needs flavor: mimir or flavor: thanos",
            "VictoriaMetrics cluster takes the tenant in the URL: /insert/<id>/prometheus/...",
        )
    if not isinstance(tenant, str) or not tenant:
        raise ConfigError(f"{path}.tenant", "must be a non-empty string", "quote it")
    if not isinstance(headers, Mapping):
        return headers  # EndpointConfig names the problem
    if any(isinstance(h, str) and h.lower() == header.lower() for h in headers):
        raise ConfigError(f"{path}.tenant", f"conflicts with headers.{header}", "keep one")
    return {**headers, header: tenant}


def _parse_queue(raw: object, path: str) -> QueueConfig:
    if raw is None:
        return QueueConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError(path, "must be a mapping")
    kwargs: dict[str, object] = {}
    for k, v in raw.items():
        if k == "sample_age_limit":
            continue  # its value means what hfsampler does (unsupported_keys checked it)
        if k in ("batch_send_deadline", "min_backoff", "max_backoff", "max_retry_after"):
            kwargs[f"{k}_s"] = parse_duration(v, f"{path}.{k}")
        elif k in ("max_disk_bytes", "max_request_bytes"):
            kwargs[k] = parse_size(v, f"{path}.{k}")
        elif k == "capacity":
            kwargs.update(capacity=v, capacity_set=True)
        else:
            kwargs[str(k)] = v
    try:
        return QueueConfig(**kwargs)  # type: ignore[arg-type]
    except ConfigError as err:
        raise ConfigError(f"{path}.{err.key}", err.problem, err.fix) from None


def _parse_metadata(raw: object, path: str) -> bool:
    """``metadata_config``: whether to send metadata (its other keys are refused before)."""
    if raw is None:
        return True
    if not isinstance(raw, Mapping):
        raise ConfigError(path, "must be a mapping", "e.g. metadata_config: {send: false}")
    send = raw.get("send", True)
    if not isinstance(send, bool):
        raise ConfigError(f"{path}.send", "must be true or false")
    return send

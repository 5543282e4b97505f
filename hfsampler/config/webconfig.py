"""Prometheus's web configuration file (``web_config_file``), read and validated.

The format is the Prometheus exporter-toolkit's, as node_exporter's and dcgm-exporter's
``--web-config-file`` take it: ``tls_server_config`` (HTTPS, client certificates),
``basic_auth_users`` (bcrypt hashes) and ``http_server_config.headers``. A key the toolkit does
not know is refused as its strict YAML refuses it; one it knows and hfsampler cannot honour is
refused by name rather than ignored, since ignoring a security setting would weaken it silently.
Relative file names are taken from the web configuration file's directory, as the toolkit does.

Every mistake is one ``ConfigError`` whose key starts ``web_config_file: `` and names the key in
the file. No message ever quotes a value of ``basic_auth_users``: those are password hashes.
"""

from __future__ import annotations

import os
import re
import ssl
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hfsampler.config.yamlfile import read_yaml, unknown_key
from hfsampler.errors import ConfigError
from hfsampler.remote_write.security import check_file

KEY = "web_config_file"

# Go's crypto/tls ClientAuthType names; RequireClientCert is the toolkit's older spelling of
# RequireAnyClientCert. Python's ssl verifies every certificate it is sent, so the two that
# accept an unverified certificate in Go verify it here (stricter, never weaker).
CLIENT_AUTH: Mapping[str, ssl.VerifyMode] = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "RequireClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# The only response headers the toolkit lets a file set, and the values it allows where it
# names them ("to ensure consistency in the Prometheus ecosystem"); any other is refused.
HEADERS: Mapping[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}

_TOP = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
_TLS = (
    "cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version",
    "prefer_server_cipher_suites", "cert", "key", "client_ca", "cipher_suites",
    "curve_preferences", "client_allowed_sans",
)  # fmt: skip
_HTTP = ("http2", "headers")
# Keys of the toolkit's format that hfsampler refuses, and what to do instead.
_UNSUPPORTED = {
    "rate_limit": "hfsampler does not rate-limit /metrics; leave it out",
    "tls_server_config.cert": "give the certificate as a file, with cert_file",
    "tls_server_config.key": "give the key as a file, with key_file",
    "tls_server_config.client_ca": "give the CA as a file, with client_ca_file",
    "tls_server_config.cipher_suites": "OpenSSL's defaults are used; leave it out",
    "tls_server_config.curve_preferences": "OpenSSL's defaults are used; leave it out",
    "tls_server_config.client_allowed_sans": "hfsampler does not match client SANs: issue client "
    "certificates from a CA of their own and name it in client_ca_file",
}
# A bcrypt hash: version, cost, then 22 characters of salt and 31 of hash. Not $2$, bcrypt's
# first version: Python's bcrypt refuses to check it, so its user could never log in.
_BCRYPT = re.compile(rb"\$2[abxy]\$(\d\d)\$[./A-Za-z0-9]{53}")
HASH_FIX = "hash the password with bcrypt, e.g. htpasswd -nBC 10 \"\" | tr -d ':\\n'"


@dataclass(frozen=True, slots=True)
class TLSServerConfig:
    """``tls_server_config``: file names resolved against the web configuration's directory."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""
    client_auth_type: str = "NoClientCert"
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)


@dataclass(frozen=True, slots=True, repr=False)
class WebConfig:
    """One reading of the web configuration file: TLS or not, the users, the extra headers."""

    path: str
    tls: TLSServerConfig | None
    users: Mapping[str, bytes]  # user name -> bcrypt hash
    headers: Mapping[str, str]

    def __repr__(self) -> str:  # never the hashes
        return (
            f"WebConfig({self.path!r}, tls={self.tls!r}, users={sorted(self.users)!r}, "
            f"headers={dict(self.headers)!r})"
        )

    def files(self) -> tuple[str, ...]:
        """Every file this reading came from: a change to any of them calls for another."""
        return (self.path, *(self.tls.files() if self.tls is not None else ()))

    def describe(self) -> str:
        """What is in force, for the log and check-config: never a hash."""
        tls = self.tls
        parts = [
            f"TLS {tls.min_version} to {tls.max_version}, client certificates "
            f"{tls.client_auth_type}"
            if tls is not None
            else "no TLS",
            f"basic auth for {len(self.users)} user(s)" if self.users else "no basic auth",
        ]
        if self.headers:
            parts.append("headers " + ", ".join(self.headers))
        return "; ".join(parts)


def _fail(key: str, problem: str, fix: str = "") -> ConfigError:
    return ConfigError(f"{KEY}: {key}", problem, fix)


def _block(raw: object, key: str, known: tuple[str, ...]) -> Mapping[str, object]:
    """A mapping whose keys are all ``known``; a key the toolkit knows and hfsampler does not
    honour is refused by name."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise _fail(key or "the file", "must be a mapping", f"see {KEY} in docs/deployment.md")
    where = f"{key}." if key else ""
    for name in raw:
        if not isinstance(name, str) or name not in known:
            err = unknown_key(str(name), known, where)
            raise _fail(err.key, err.problem, err.fix)
        if f"{where}{name}" in _UNSUPPORTED:
            raise _fail(f"{where}{name}", "is not supported", _UNSUPPORTED[f"{where}{name}"])
    return raw


def _text(block: Mapping[str, object], name: str, key: str) -> str:
    value = block.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _fail(f"{key}.{name}", f"expected a string, got {value!r}", "quote it")
    return value


def _choice(block: Mapping[str, object], name: str, key: str, choices: Mapping[str, object],
            default: str) -> str:  # fmt: skip
    value = _text(block, name, key) or default
    if value not in choices:
        raise _fail(f"{key}.{name}", f"unknown value {value!r}", "one of " + ", ".join(choices))
    return value


def _resolve(name: str, directory: Path) -> str:
    return name if not name or os.path.isabs(name) else str(directory / name)


def _parse_tls(raw: object, directory: Path) -> TLSServerConfig | None:
    key = "tls_server_config"
    block = _block(raw, key, _TLS)
    files = {n: _resolve(_text(block, n, key), directory)
             for n in ("cert_file", "key_file", "client_ca_file")}  # fmt: skip
    auth = _text(block, "client_auth_type", key)
    if not any(files.values()) and not auth:
        return None  # the toolkit's rule: TLS only once a file or a client policy is given
    for name in ("cert_file", "key_file"):
        if not files[name]:
            raise _fail(f"{key}.{name}", "is missing", "TLS needs both cert_file and key_file")
    prefer = block.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise _fail(f"{key}.prefer_server_cipher_suites", "must be true or false")
    tls = TLSServerConfig(
        cert_file=files["cert_file"],
        key_file=files["key_file"],
        client_ca_file=files["client_ca_file"],
        client_auth_type=_choice(block, "client_auth_type", key, CLIENT_AUTH, "NoClientCert"),
        min_version=_choice(block, "min_version", key, TLS_VERSIONS, "TLS12"),
        max_version=_choice(block, "max_version", key, TLS_VERSIONS, "TLS13"),
        prefer_server_cipher_suites=prefer,
    )
    if TLS_VERSIONS[tls.min_version] > TLS_VERSIONS[tls.max_version]:
        raise _fail(f"{key}.min_version", f"{tls.min_version} is above max_version "
                    f"{tls.max_version}", "lower min_version or raise max_version")  # fmt: skip
    if tls.client_ca_file and CLIENT_AUTH[tls.client_auth_type] == ssl.CERT_NONE:
        raise _fail(f"{key}.client_ca_file", "is given but client_auth_type is NoClientCert",
                    "set client_auth_type: RequireAndVerifyClientCert")  # fmt: skip
    for name, path in files.items():
        if path:
            check_file(path, f"{KEY}: {key}.{name}", secret=False)
    server_context(tls)  # a bad certificate, key or CA fails here, at load
    return tls


def _parse_users(raw: object) -> dict[str, bytes]:
    key = "basic_auth_users"
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise _fail(key, "must be a mapping of user names to bcrypt hashes", HASH_FIX)
    users = {}
    for name, hashed in raw.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise _fail(f"{key}.{name}", "is not a user name", "a name without ':'")
        # the hash is never quoted: a leaked bcrypt hash can be attacked offline
        match = _BCRYPT.fullmatch(hashed.encode()) if isinstance(hashed, str) else None
        if match is None:
            raise _fail(f"{key}.{name}", "is not a bcrypt hash", HASH_FIX)
        if not 4 <= int(match[1]) <= 31:
            raise _fail(f"{key}.{name}", "has a bcrypt cost outside 4 to 31", HASH_FIX)
        users[name] = hashed.encode()
    return users


def _parse_headers(raw: object) -> dict[str, str]:
    key = "http_server_config"
    block = _block(raw, key, _HTTP)
    http2 = block.get("http2", True)
    if not isinstance(http2, bool):
        raise _fail(f"{key}.http2", "must be true or false")
    headers = block.get("headers")
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise _fail(f"{key}.headers", "must be a mapping of header names to values")
    out = {}
    for name, value in headers.items():
        where = f"{key}.headers.{name}"
        if name not in HEADERS:
            raise _fail(where, "cannot be configured",
                        "the toolkit allows only " + ", ".join(HEADERS))  # fmt: skip
        if not isinstance(value, str) or "\r" in value or "\n" in value:
            raise _fail(where, "must be one line of text", "quote it")
        if HEADERS[name] and value not in HEADERS[name]:
            raise _fail(where, f"unknown value {value!r}", "one of " + ", ".join(HEADERS[name]))
        if value:  # the toolkit: unset if blank
            out[str(name)] = value
    return out


def load_web_config(path: str) -> WebConfig:
    """Read, check and return the web configuration in ``path``: its certificates loaded and
    its hashes checked, so that a mistake stops the start (exit 2), not the first scrape."""
    try:
        data = read_yaml(path, KEY)
    except ConfigError as exc:
        if exc.key == KEY:
            raise
        raise ConfigError(KEY, str(exc), "") from None  # a mistake in the file's YAML
    top = _block(data, "", _TOP)
    directory = Path(path).parent
    return WebConfig(
        path=path,
        tls=_parse_tls(top.get("tls_server_config"), directory),
        users=_parse_users(top.get("basic_auth_users")),
        headers=_parse_headers(top.get("http_server_config")),
    )


def server_context(tls: TLSServerConfig) -> ssl.SSLContext:
    """The server's SSL context for ``tls``, its files read now."""
    key = "tls_server_config"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():  # TLS 1.0 and 1.1 are deprecated, yet the toolkit offers them
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = TLS_VERSIONS[tls.min_version]
        ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    if not tls.prefer_server_cipher_suites:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (ssl.SSLError, OSError) as exc:
        raise _fail(f"{key}.cert_file", f"cannot load {tls.cert_file} with {tls.key_file}: "
                    f"{_reason(exc)}", "give a PEM certificate and its own private key"
                    ) from None  # fmt: skip
    ctx.verify_mode = CLIENT_AUTH[tls.client_auth_type]
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise _fail(f"{key}.client_ca_file", f"cannot load {tls.client_ca_file}: "
                        f"{_reason(exc)}", "give PEM CA certificates") from None  # fmt: skip
    elif ctx.verify_mode != ssl.CERT_NONE:
        # as Go does without ClientCAs: the system's roots verify client certificates
        ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    return ctx


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__)

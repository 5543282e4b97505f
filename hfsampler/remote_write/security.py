"""Security: Prometheus's ``basic_auth``, ``authorization``, ``bearer_token(_file)`` and
``tls_config`` for one endpoint, parsed, validated and turned into headers and an SSL context.

Secrets live only in ``AuthConfig`` (whose ``repr`` hides them) and in the ``Authorization``
header built per request; no message here or in the sender ever includes them. A receiver may
echo the request's head, so every text a receiver sends passes one ``Redactor`` before it is
logged or put in an error: it knows each secret in every form it travels in (as configured,
percent-decoded from a URL, ``user:password`` and its base64 in a ``Basic`` header). Secret
files are re-read when their size, inode or modification time changes, so a rotated token is
used without a restart. Every file named is checked at load (a readable, non-empty regular
file), so a missing mount fails ``check-config`` rather than every send. Certificate
verification is on unless ``insecure_skip_verify: true``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import ssl
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from hfsampler.errors import ConfigError, RecoverableSendError

_BASIC_KEYS = ("username", "password", "password_file")
_AUTHZ_KEYS = ("type", "credentials", "credentials_file")
TLS_KEYS = ("ca_file", "cert_file", "key_file", "server_name", "insecure_skip_verify")
TLS_UNSUPPORTED = ("ca", "cert", "key", "min_version", "max_version")


@dataclass(frozen=True, slots=True, repr=False)
class AuthConfig:
    """How to build the ``Authorization`` header: a scheme plus a secret inline or in a file."""

    kind: str  # the config key it came from: basic_auth, authorization or bearer_token
    scheme: str  # Basic, Bearer, or the authorization type
    username: str = ""
    secret: str = ""
    secret_file: str = ""

    def __repr__(self) -> str:
        where = f"file {self.secret_file!r}" if self.secret_file else "<redacted>"
        user = f", username={self.username!r}" if self.username else ""
        return f"AuthConfig({self.kind}, scheme={self.scheme!r}{user}, secret={where})"

    def describe(self) -> str:
        """For ``check-config``: what is used, never the secret."""
        user = f" as {self.username}" if self.username else ""
        source = f" from {self.secret_file}" if self.secret_file else ""
        return f"{self.kind} ({self.scheme}{user}, secret{source or ' inline'})"


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """Prometheus's ``tls_config`` (file paths only)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    insecure_skip_verify: bool = False


def _string(raw: Mapping[object, object], key: str, path: str) -> str:
    value = raw.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        # Never echo the value: it may be a secret.
        raise ConfigError(f"{path}.{key}", "must be a string", "quote it")
    return value


_CHECK_LIMIT = 1 << 20  # a larger file is not read at load (no secret or PEM is that big)


def check_file(name: str, key: str, *, secret: bool) -> None:
    """A file the config names must be readable and not empty now, so that a typo or a missing
    mount fails ``check-config`` and start rather than every send for good. Only its path is
    ever shown, never what it holds; a secret file must also be UTF-8, as it is read at send.
    """
    try:
        regular = stat.S_ISREG(os.stat(name).st_mode)
        data = b""
        if regular:  # a FIFO would block the read
            with open(name, "rb") as f:
                data = f.read(_CHECK_LIMIT)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        reason = getattr(exc, "strerror", None) or "not a usable path"
        raise ConfigError(
            key, f"cannot read {name}: {reason}", "check the path and permissions"
        ) from None
    if not regular:
        raise ConfigError(key, f"{name} is not a regular file", "name the file itself")
    if not data.strip():
        what = "the secret" if secret else "the PEM data"
        raise ConfigError(key, f"{name} is empty", f"write {what} into it")
    if secret:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(
                key, f"{name} is not UTF-8 text", "save the secret as UTF-8"
            ) from None


def _mapping(raw: object, path: str, known: tuple[str, ...]) -> Mapping[object, object]:
    if not isinstance(raw, Mapping):
        raise ConfigError(path, "must be a mapping")
    for k in raw:
        if k not in known:
            raise ConfigError(f"{path}.{k}", "is not a known key", "known: " + ", ".join(known))
    return raw


def parse_auth(raw: Mapping[object, object], path: str) -> AuthConfig | None:
    """The endpoint's one authentication method, if any (Prometheus allows only one)."""
    given = [
        k for k in ("basic_auth", "authorization", "bearer_token", "bearer_token_file") if k in raw
    ]
    if len(given) > 1:
        raise ConfigError(f"{path}.{given[1]}", f"cannot be combined with {given[0]}", "keep one")
    headers = raw.get("headers")
    if (
        given
        and isinstance(headers, Mapping)
        and any(isinstance(h, str) and h.lower() == "authorization" for h in headers)
    ):
        raise ConfigError(f"{path}.headers.Authorization", f"conflicts with {given[0]}", "keep one")
    if not given:
        return None
    key = given[0]
    if key == "basic_auth":
        block = _mapping(raw[key], f"{path}.basic_auth", _BASIC_KEYS)
        username = _string(block, "username", f"{path}.basic_auth")
        secret = _string(block, "password", f"{path}.basic_auth")
        secret_file = _string(block, "password_file", f"{path}.basic_auth")
        if not username:
            raise ConfigError(f"{path}.basic_auth.username", "is required")
        if secret and secret_file:
            raise ConfigError(
                f"{path}.basic_auth.password", "cannot be combined with password_file", "keep one"
            )
        if secret_file:
            check_file(secret_file, f"{path}.basic_auth.password_file", secret=True)
        return AuthConfig("basic_auth", "Basic", username, secret, secret_file)
    if key == "authorization":
        block = _mapping(raw[key] or {}, f"{path}.authorization", _AUTHZ_KEYS)
        scheme = _string(block, "type", f"{path}.authorization") or "Bearer"
        if scheme.lower() == "basic":
            raise ConfigError(f"{path}.authorization.type", "cannot be Basic", "use basic_auth")
        if not scheme.isascii() or not scheme.replace("-", "").isalnum():
            raise ConfigError(f"{path}.authorization.type", "is not an HTTP auth scheme")
        secret = _string(block, "credentials", f"{path}.authorization")
        secret_file = _string(block, "credentials_file", f"{path}.authorization")
        if secret and secret_file:
            raise ConfigError(
                f"{path}.authorization.credentials",
                "cannot be combined with credentials_file",
                "keep one",
            )
        if not secret and not secret_file:
            raise ConfigError(f"{path}.authorization", "needs credentials or credentials_file")
        if secret_file:
            check_file(secret_file, f"{path}.authorization.credentials_file", secret=True)
        return AuthConfig("authorization", scheme, "", secret, secret_file)
    value = _string(raw, key, path)
    if not value:
        raise ConfigError(f"{path}.{key}", "is empty")
    if key == "bearer_token":
        return AuthConfig("bearer_token", "Bearer", "", value, "")
    check_file(value, f"{path}.{key}", secret=True)
    return AuthConfig("bearer_token_file", "Bearer", "", "", value)


def parse_tls(raw: object, path: str) -> TLSConfig:
    """``tls_config``; the files must be readable now so a typo fails at start."""
    if raw is None:
        return TLSConfig()
    if isinstance(raw, Mapping):
        for k in raw:
            if k in TLS_UNSUPPORTED:
                raise ConfigError(f"{path}.{k}", "is not supported yet", "use the *_file keys")
    block = _mapping(raw, path, TLS_KEYS + TLS_UNSUPPORTED)
    files = {k: _string(block, k, path) for k in ("ca_file", "cert_file", "key_file")}
    server_name = _string(block, "server_name", path)
    skip = block.get("insecure_skip_verify", False)
    if not isinstance(skip, bool):
        raise ConfigError(f"{path}.insecure_skip_verify", "must be true or false")
    if bool(files["cert_file"]) != bool(files["key_file"]):
        raise ConfigError(f"{path}.cert_file", "and key_file must be given together")
    for k, f in files.items():
        if f:
            check_file(f, f"{path}.{k}", secret=False)
    tls = TLSConfig(files["ca_file"], files["cert_file"], files["key_file"], server_name, skip)
    ssl_context(tls, path)  # a bad certificate or key fails here, at load time
    return tls


def ssl_context(tls: TLSConfig, path: str = "tls_config") -> ssl.SSLContext:
    """An SSL context that verifies the server (unless told not to) and may present a cert."""
    try:
        ctx = ssl.create_default_context(cafile=tls.ca_file or None)
        if tls.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if tls.cert_file:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (ssl.SSLError, OSError) as exc:
        reason = (
            getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__
        )
        raise ConfigError(
            path, f"cannot load the certificates: {reason}", "check the files"
        ) from None
    return ctx


class TLSSendError(RecoverableSendError):
    """The TLS handshake failed (untrusted certificate, refused client certificate): retried,
    but only every ``max_backoff``, since it will not fix itself in milliseconds."""


class _SecretFile:
    """A secret file's stripped content, re-read only when the file changed."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._value = ""

    def read(self) -> str:
        try:
            st = self._path.stat()
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self._stamp:
                self._value = self._path.read_text(encoding="utf-8").strip()
                self._stamp = stamp
        except (OSError, UnicodeDecodeError) as exc:
            self._stamp = None
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            raise RecoverableSendError(f"cannot read secret file {self._path}: {reason}") from None
        return self._value


# Shorter strings are not redacted: "ab" would blank every "ab" in a receiver's text.
MIN_SECRET_CHARS = 3
REDACTED = "<secret>"


def basic_forms(username: str, password: str) -> tuple[str, ...]:
    """How ``username:password`` travels in a ``Basic`` header: the pair, its base64 (in UTF-8,
    as hfsampler's basic_auth encodes it, and in latin-1, as aiohttp encodes a URL's) and the
    header value."""
    pair = f"{username}:{password}"
    tokens = [base64.b64encode(pair.encode()).decode()]
    with contextlib.suppress(UnicodeEncodeError):
        tokens.append(base64.b64encode(pair.encode("latin-1")).decode())
    return (pair, *tokens, *(f"Basic {t}" for t in tokens))


def auth_forms(auth: AuthConfig, secret: str) -> tuple[str, ...]:
    """``secret`` (``auth``'s, inline or read from its file) in every form it is sent in."""
    if not secret:
        return ()
    if auth.scheme == "Basic":
        return (secret, *basic_forms(auth.username, secret))
    return (secret, f"{auth.scheme} {secret}")


def url_secrets(url: str) -> tuple[str, ...]:
    """The secrets a URL carries: its userinfo (as written and percent-decoded, alone and in
    the ``Basic`` header an HTTP client builds from it) and its query values."""
    try:
        parts = urlsplit(url)
        username, password = parts.username, parts.password
    except ValueError:
        return ()
    out: list[str] = []
    if username is not None or password is not None:
        user, pw = unquote(username or ""), unquote(password or "")
        out += [s for s in (password, pw, username, user) if s]
        out += basic_forms(user, pw)
    for _, value in parse_qsl(parts.query, keep_blank_values=True):
        out += [value, unquote(value)]  # parse_qsl decodes once; a value may be encoded twice
    return tuple(out)


class Redactor:
    """Replaces every known secret in a text by ``<secret>``: the one place a receiver's text
    passes before it is logged or put in an error. Longest secrets first, so that a secret
    containing another one is replaced whole."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self._secrets = _longest_first(secrets)

    def __call__(self, text: str, extra: Iterable[str] = ()) -> str:
        """``text`` without secrets; ``extra``: ones known only now (a secret file's)."""
        secrets = self._secrets if not extra else _longest_first([*self._secrets, *extra])
        for secret in secrets:
            text = text.replace(secret, REDACTED)
        return text


def _longest_first(secrets: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted({s for s in secrets if len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True))


class AuthHeader:
    """Builds the ``Authorization`` header value for each request."""

    def __init__(self, auth: AuthConfig) -> None:
        self._auth = auth
        self._file = _SecretFile(auth.secret_file) if auth.secret_file else None
        self._sent = auth.secret  # the secret in the last header built

    def __repr__(self) -> str:
        return f"AuthHeader({self._auth!r})"

    def value(self) -> str:
        secret = self._sent = self._file.read() if self._file is not None else self._auth.secret
        if self._auth.scheme == "Basic":
            token = base64.b64encode(f"{self._auth.username}:{secret}".encode()).decode()
            return f"Basic {token}"
        return f"{self._auth.scheme} {secret}"

    def secrets(self) -> tuple[str, ...]:
        """The secret of the last header built, in every form it is sent in (a file's is
        known only once read), for the ``Redactor``."""
        return auth_forms(self._auth, self._sent)

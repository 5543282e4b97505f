"""The web configuration in force on /metrics: TLS per connection, basic auth and headers per
request, both re-read when the file or a certificate it names changes.

As the Prometheus exporter-toolkit does, every path is protected (/healthz too), a missing or
wrong password is answered 401 with ``WWW-Authenticate: Basic``, an unknown user costs a bcrypt
check as a known one does (no user enumeration by timing), and verified (user, hash, password)
triples are cached, since bcrypt is slow on purpose; the cache holds a keyed hash of each, never
the password. A change that does not load fails closed, as the toolkit does: each request is
answered 500 until the file is fixed (said once in the log), while TLS keeps the last good
certificate so that the 500 can be read.

The listening socket keeps one ``SSLContext``; asyncio and uvloop call its ``wrap_bio`` once per
connection, which here hands out the context built from the files as they are now.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import os
import secrets
import ssl
from collections.abc import Awaitable, Callable, Mapping

import bcrypt
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from hfsampler.config.webconfig import KEY, load_web_config, server_context
from hfsampler.errors import ConfigError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Stamp = tuple[tuple[int, int, int] | None, ...]

# Checked for an unknown user, so that it takes as long as a known one's wrong password.
_NO_USER_HASH = b"$2b$10$vYF4.jPQ3LgJtlCwp6JztevGSOXPCLPz3xgZxiHkEH0h7GXx9JECu"
CACHE_SIZE = 100  # the toolkit's


def _stamp(files: tuple[str, ...]) -> Stamp:
    """Each file's (inode, size, mtime): a rename over it (a Kubernetes Secret's update, a
    certificate renewal) changes it as a write does."""
    out: list[tuple[int, int, int] | None] = []
    for name in files:
        try:
            st = os.stat(name)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def basic_credentials(header: str | None) -> tuple[bytes, bytes] | None:
    """(user, password) from an ``Authorization: Basic`` header, as Go's ``Request.BasicAuth``
    reads it: the scheme in any case, standard base64, split at the first colon."""
    if header is None or header[:6].lower() != "basic ":
        return None
    try:
        pair = base64.b64decode(header[6:].encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        return None
    user, sep, password = pair.partition(b":")
    return (user, password) if sep else None


class VerdictCache:
    """bcrypt verdicts by a keyed hash of (user, hash, password); the oldest tenth of the wrong
    ones dropped when full (the toolkit drops a random tenth: either keeps the cost of a flood
    bounded). A right one is dropped only when there is no wrong one left: a flood of guesses
    would otherwise evict a scraper's verdict, and its next scrape wait behind every queued
    guess, one bcrypt at a time, past its timeout. Only who knows a password adds a right one.
    """

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)
        self._verdicts: dict[bytes, bool] = {}

    def key(self, user: bytes, hashed: bytes, password: bytes) -> bytes:
        # the user name holds no colon and the hash none: the triple is unambiguous
        return hashlib.blake2b(b":".join((user, hashed, password)), key=self._key).digest()

    def get(self, key: bytes) -> bool | None:
        return self._verdicts.get(key)

    def set(self, key: bytes, verdict: bool) -> None:
        if len(self._verdicts) >= CACHE_SIZE:
            wrong = [k for k, right in self._verdicts.items() if not right]
            for old in (wrong or list(self._verdicts))[: max(1, CACHE_SIZE // 10)]:
                del self._verdicts[old]
        self._verdicts[key] = verdict


def _check(password: bytes, hashed: bytes) -> bool:
    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:  # bcrypt refuses passwords over 72 bytes, as Go's does
        return False


class BadRequestFilter(logging.Filter):
    """aiohttp's log of a request it could not parse, cut to one debug line without the request.

    aiohttp logs it with a traceback whose message quotes the offending line, at error level
    (an over-long header, a control character in one): an ``Authorization`` header's
    credentials went to the log, and any client could fill it. The client is answered 400.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        record.msg = f"{record.msg}: {exc.code} {type(exc).__name__}"
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


BAD_REQUEST_FILTER = BadRequestFilter()


class _CurrentContext(ssl.SSLContext):
    """The listener's context: each connection is wrapped by the gate's context of the moment."""

    gate: WebGate

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        ctx = self.gate.current_ssl()
        return ctx.wrap_bio(incoming, outgoing, server_side, server_hostname, session)


class WebGate:
    """The web configuration file in force: TLS, users and headers, re-read on change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.config = load_web_config(path)
        self._stamp = _stamp(self.config.files())
        self._ssl = server_context(self.config.tls) if self.config.tls is not None else None
        self._broken: str | None = None  # why the file on disk is not in force
        self._verified = VerdictCache()
        self._bcrypt_lock = asyncio.Lock()  # one bcrypt at a time: ~70 ms of a core at cost 10

    def ssl_context(self) -> ssl.SSLContext | None:
        """The context to listen with (None: plain HTTP): it follows the files as they change."""
        if self._ssl is None:
            return None
        ctx = _CurrentContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.gate = self
        return ctx

    def refresh(self) -> None:
        """Read the file and its certificates again if any changed since the last reading."""
        stamp = _stamp(self.config.files())
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            config = load_web_config(self.path)
            if (config.tls is None) != (self.config.tls is None):
                raise ConfigError(KEY, "turns TLS on or off, which takes a restart", "restart")
            tls = server_context(config.tls) if config.tls is not None else None
        except ConfigError as err:
            if self._broken != str(err):
                log.error("%s; every request is answered 500 until it is fixed", err)
            self._broken = str(err)
            return
        # the new reading's files (a certificate may now be another path) from now on
        self.config, self._ssl, self._broken = config, tls, None
        self._stamp = _stamp(config.files())
        log.info("%s %s read again: %s", KEY, self.path, config.describe())

    def current_ssl(self) -> ssl.SSLContext:
        self.refresh()
        assert self._ssl is not None, "a TLS listener always has a context"
        return self._ssl

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every path: 500 while the file is broken, else basic auth when users are given."""
        self.refresh()
        if self._broken is not None:
            raise web.HTTPInternalServerError()
        users = self.config.users
        if not users:
            return await handler(request)
        credentials = basic_credentials(request.headers.get(hdrs.AUTHORIZATION))
        if credentials is not None and await self._verify(*credentials, users):
            return await handler(request)
        raise web.HTTPUnauthorized(headers={hdrs.WWW_AUTHENTICATE: "Basic"})

    async def _verify(self, user: bytes, password: bytes, users: Mapping[str, bytes]) -> bool:
        try:
            hashed = users.get(user.decode())
        except UnicodeDecodeError:
            hashed = None
        checked = hashed if hashed is not None else _NO_USER_HASH
        key = self._verified.key(user, checked, password)
        verdict = self._verified.get(key)
        if verdict is not None:
            return verdict
        async with self._bcrypt_lock:  # blocking work, and CPU: off the loop, one at a time
            verdict = self._verified.get(key)  # a scrape waiting behind its twin's check
            if verdict is None:
                loop = asyncio.get_running_loop()
                matched = await loop.run_in_executor(None, _check, password, checked)
                verdict = matched and hashed is not None
                self._verified.set(key, verdict)
        return verdict

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """The file's ``http_server_config.headers`` on every response, 401 and 404 too."""
        for name, value in self.config.headers.items():
            response.headers[name] = value

"""Client: posts one compressed request to one endpoint and says what came of it.

It owns the HTTP side of an endpoint: the aiohttp session, the protocol headers (which a user
header can never replace), auth, TLS and proxy settings, and the translation of every failure
into hfsampler's errors: network errors, timeouts, TLS problems and retryable statuses become
``RecoverableSendError``, 413 ``RequestTooLargeError``, other refusals
``NonRecoverableSendError``. Secrets never reach a log line or an error message: aiohttp's own
texts may quote the URL with its credentials, so only error classes and OS reasons are kept, and
every text a receiver sends passes the endpoint's ``Redactor``. A redirect is followed as
Prometheus follows it (``follow_redirects``, on by default) only where the request keeps its
body and stays on the configured scheme, host and port; any other is a refusal naming the
Location, so that no credential, API key or tenant ever goes to a host that was not configured.
"""

from __future__ import annotations

import logging
import re
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import aiohttp

import hfsampler
from hfsampler import selfmetrics as sm
from hfsampler.errors import (
    NonRecoverableSendError,
    ReceiverDownError,
    RecoverableSendError,
    RequestTooLargeError,
)
from hfsampler.logs import one_line
from hfsampler.remote_write.config import EndpointConfig, redact_url
from hfsampler.remote_write.encoder_v2 import CONTENT_TYPE as CONTENT_TYPE_V2
from hfsampler.remote_write.encoder_v2 import VERSION as VERSION_V2
from hfsampler.remote_write.retry import Outcome, classify, parse_retry_after
from hfsampler.remote_write.security import AuthHeader, Redactor, TLSSendError, ssl_context
from hfsampler.selfmetrics import SelfMetrics

log = logging.getLogger(__name__)

# How much of a receiver's error body is read, and how much of it goes into the log.
BODY_READ_LIMIT = 4096
BODY_LOG_LIMIT = 512

PROTOCOL_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": f"hfsampler/{hfsampler.__version__}",
}
# Remote-Write 2.0's, in place of the 1.0 ones above.
PROTOCOL_HEADERS_V2 = {
    **PROTOCOL_HEADERS,
    "Content-Type": CONTENT_TYPE_V2,
    "X-Prometheus-Remote-Write-Version": VERSION_V2,
}
WRITTEN_HEADER = "X-Prometheus-Remote-Write-Samples-Written"
# 2.0 counts native histograms apart from float samples; a request's samples are both kinds.
HISTOGRAMS_WRITTEN_HEADER = "X-Prometheus-Remote-Write-Histograms-Written"
MAX_REDIRECTS = 10  # as Go's HTTP client, which Prometheus sends with
KEEPS_BODY = frozenset((307, 308))  # redirects that keep the method and the body
# How a 400 says the body was too big ("snappy: decoded length N exceeds limit M").
BODY_TOO_LARGE = re.compile(
    r"decoded length \d+ exceeds limit|(?:body|message|request) (?:is )?too large|"
    r"larger than max",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class _Answer:
    """A receiver's answer to one request: the text already log-safe (``_printable``)."""

    status: int
    text: str
    retry_after_s: float | None
    written: int | None
    location: str = ""  # a 3xx's Location, as sent


def same_origin(url: str, other: str) -> bool:
    """Whether two URLs share scheme, host and port (a port left out is the scheme's)."""
    try:
        a, b = urlsplit(url), urlsplit(other)
        ports = [p.port or {"http": 80, "https": 443}.get(p.scheme.lower()) for p in (a, b)]
    except ValueError:
        return False
    return (
        a.scheme.lower() == b.scheme.lower()
        and (a.hostname or "") == (b.hostname or "")
        and ports[0] == ports[1]
    )


class RemoteClient:
    """HTTP for one endpoint: ``open``, then ``post`` any number of times, then ``close``."""

    def __init__(self, config: EndpointConfig, metrics: SelfMetrics, connections: int) -> None:
        self.config = config
        self._metrics = metrics
        self._labels = {"remote_name": config.remote_name, "url": config.display_url}
        self._connections = connections
        # Protocol headers last: a user header can never replace them.
        self._headers = {**config.headers, **PROTOCOL_HEADERS}
        self._headers_v2 = {**config.headers, **PROTOCOL_HEADERS_V2}
        self._auth = AuthHeader(config.auth) if config.auth is not None else None
        self._ssl: ssl.SSLContext | None = None
        if config.tls is not None and config.url.startswith("https:"):
            self._ssl = ssl_context(config.tls)
        self._session: aiohttp.ClientSession | None = None
        self._redact = Redactor(config.secrets())
        self._said_redirects: set[tuple[int, str]] = set()

    def open(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._connections, ssl=self._ssl or True)
            self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, body: bytes, n_samples: int, v2: bool = False) -> int | None:
        """Send one request (a 2.0 one with ``v2``); once the receiver answered 2xx, return the
        samples it says it wrote (``X-Prometheus-Remote-Write-Samples-Written``, plus its
        ``Histograms-Written``; None when it did not say, as 1.x receivers do not); else raise."""
        session = self._session
        assert session is not None, "open() was not called"
        headers = self._headers_v2 if v2 else self._headers
        if self._auth is not None:
            headers = {**headers, "Authorization": self._auth.value()}
        url = self.config.url
        for _ in range(MAX_REDIRECTS + 1):
            answer = await self._post_once(session, url, body, headers, n_samples)
            if not 300 <= answer.status < 400:
                break
            url = self._follow(url, answer)
        else:
            raise NonRecoverableSendError(
                f"HTTP {answer.status}: stopped after {MAX_REDIRECTS} redirects",
                answer.status,
                answer.text,
            )
        status, text = answer.status, answer.text
        if 200 <= status < 300:
            return answer.written
        outcome = classify(status, self.config.queue.retry_on_http_429)
        if outcome is Outcome.REFUSED and status == 400 and BODY_TOO_LARGE.search(text):
            outcome = Outcome.TOO_LARGE  # Prometheus 3 answers 400, not 413, past 32 MiB
        if outcome is Outcome.RETRY:
            raise RecoverableSendError(f"HTTP {status}: {text}", answer.retry_after_s)
        if outcome is Outcome.TOO_LARGE:
            raise RequestTooLargeError(f"HTTP 413: {text}", status)
        raise NonRecoverableSendError(f"HTTP {status}: {text}", status, text, answer.written)

    async def _post_once(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: bytes,
        headers: dict[str, str],
        n_samples: int,
    ) -> _Answer:
        """One HTTP request, redirects not followed; its answer, or a transport error raised."""
        timeout = aiohttp.ClientTimeout(total=self.config.remote_timeout_s)
        tls = self.config.tls
        started = time.monotonic()
        try:
            async with session.post(
                url,
                data=body,
                headers=headers,
                timeout=timeout,
                proxy=self.config.proxy_url or None,
                server_hostname=(tls.server_name or None) if tls is not None else None,
                allow_redirects=False,  # followed here, only where no secret can leak
            ) as resp:
                written = _written(resp.headers.get(WRITTEN_HEADER), n_samples)
                histograms = _written(resp.headers.get(HISTOGRAMS_WRITTEN_HEADER), 0)
                if written is not None and histograms:
                    written = min(written + histograms, n_samples)
                if 200 <= resp.status < 300:
                    await resp.read()
                    self._count_request(str(resp.status))
                    return _Answer(resp.status, "", None, written)
                raw_text = await resp.content.read(BODY_READ_LIMIT)
                answer = _Answer(
                    resp.status,
                    self._printable(raw_text.decode("utf-8", "replace")),
                    parse_retry_after(resp.headers.get("Retry-After")),
                    written,
                    resp.headers.get("Location", "") if 300 <= resp.status < 400 else "",
                )
                self._count_request(str(resp.status))
                return answer
        except TimeoutError:
            self._count_request("timeout")
            raise RecoverableSendError(
                f"no answer within remote_timeout {self.config.remote_timeout_s} s"
            ) from None
        except aiohttp.ClientConnectorCertificateError as err:
            self._count_request("error")
            cert = err.certificate_error
            reason = getattr(cert, "verify_message", None) or getattr(cert, "reason", None)
            raise TLSSendError(
                f"TLS certificate not trusted: {reason or type(cert).__name__} "
                "(check tls_config.ca_file and server_name)",
            ) from None
        except aiohttp.ClientSSLError as err:
            self._count_request("error")
            reason = getattr(getattr(err, "os_error", None), "reason", None)
            raise TLSSendError(
                f"TLS handshake failed: {reason or type(err).__name__} "
                "(check tls_config: client certificate, CA)",
            ) from None
        except aiohttp.ClientError as err:
            self._count_request("error")
            tls_error = _ssl_error(err)
            if tls_error is not None:
                # TLS 1.3 refuses a missing client certificate only after the handshake.
                raise TLSSendError(
                    f"TLS refused: {tls_error.reason or type(tls_error).__name__} "
                    "(check tls_config: client certificate, CA)"
                ) from None
            # Only the class and OS reason: aiohttp's own text may quote the URL with credentials.
            os_error = getattr(err, "os_error", None)
            reason = getattr(os_error, "strerror", None)
            text = f"{type(err).__name__}{f': {reason}' if reason else ''}"
            if isinstance(os_error, ConnectionRefusedError):
                raise ReceiverDownError(text) from None
            raise RecoverableSendError(text) from None
        finally:
            self._metrics.set(sm.RW_SEND_DURATION, time.monotonic() - started, self._labels)

    def _follow(self, url: str, answer: _Answer) -> str:
        """Where a 3xx sends the request next, or NonRecoverableSendError when it is not
        followed: as Prometheus (``follow_redirects``, true by default), except that a request
        never leaves the configured scheme, host and port, where its credentials, API keys
        and tenant go, and that a 301, 302 or 303 (a POST turned into a GET) ends it."""
        status = answer.status
        target = urljoin(url, answer.location) if answer.location else ""
        shown = self._printable(redact_url(target)) if target else "nowhere (no Location)"
        if not target:
            why = "no Location"
        elif not self.config.follow_redirects:
            why = "follow_redirects is false"
        elif status not in KEEPS_BODY:
            why = "only a 307 or 308 keeps the POST's body"
        elif not same_origin(url, target):
            why = (
                "another scheme, host or port: the endpoint's credentials and headers go "
                "nowhere else; set url to it if it is right"
            )
        else:
            if (status, shown) not in self._said_redirects:
                self._said_redirects.add((status, shown))
                log.warning(
                    "remote write %s (%s): HTTP %d redirects to %s: followed (the same host); "
                    "set url to it to save a request",
                    self.config.remote_name,
                    self.config.display_url,
                    status,
                    shown,
                )
            parts = urlsplit(target)  # the configured userinfo, if any, still applies
            return urlunsplit((*urlsplit(url)[:2], parts.path, parts.query, ""))
        said = f"redirect to {shown} not followed ({why})"
        raise NonRecoverableSendError(f"HTTP {status}: {said}", status, said)

    def _printable(self, text: str) -> str:
        """A receiver's text as one log-safe line: every secret sent replaced by ``<secret>``
        (a receiver may echo the request's head), control characters escaped, truncated."""
        text = self._redact(text, self._auth.secrets() if self._auth is not None else ())
        text = one_line(text)
        if len(text) > BODY_LOG_LIMIT:
            text = text[:BODY_LOG_LIMIT] + "...(truncated)"
        return text

    def _count_request(self, status: str) -> None:
        self._metrics.inc(sm.RW_REQUESTS, 1, {**self._labels, "status": status})


def _written(value: str | None, sent: int) -> int | None:
    """A Written header's count; None when absent. A header that is there but not a count
    still says the receiver decoded 2.0: taken as everything written, never resent."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return int(text)
    return sent


def _ssl_error(err: BaseException) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` behind an aiohttp error, if one is in its chain."""
    seen: BaseException | None = err
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        nested = getattr(seen, "os_error", None)
        seen = nested if isinstance(nested, BaseException) else (seen.__cause__ or seen.__context__)
    return None

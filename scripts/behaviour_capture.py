"""Remote-Write requests caught on loopback and decoded to canonical text, for the behaviour driver.

``CaptureReceiver`` keeps every request body by URL path and answers as a receiver that stored
everything would (2.0: with the ``Written`` headers, so that no sender falls back to 1.0).
``requests_json`` decodes requests in the order sent, one sample and one label set a line, so
that a diff of two runs shows the first sample that differs; ``merged_json`` merges requests
that arrive in no set order; ``bodies_text`` names each request's uncompressed bytes. The
protobuf classes come from the tree under test (``Protos``), found by the driver.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Protos:
    """The generated protobuf modules: 1.0's ``WriteRequest`` and 2.0's ``Request``."""

    remote_pb2: Any
    writev2_pb2: Any


# -- a receiver that keeps every request -----------------------------------------------------------

_KEPT_HEADERS = (
    "Content-Type",
    "Content-Encoding",
    "X-Prometheus-Remote-Write-Version",
    "User-Agent",
)
_WRITTEN = "X-Prometheus-Remote-Write-{}-Written"
_V2 = "io.prometheus.write.v2.Request"  # in a 2.0 request's Content-Type


@dataclass(frozen=True, slots=True)
class Captured:
    headers: dict[str, str]
    body: bytes


class CaptureReceiver:
    """Stores every request body by URL path and answers 204 (2.0: with the Written headers),
    on its own thread and event loop, on a free port of 127.0.0.1."""

    def __init__(self, protos: Protos) -> None:
        self.protos = protos
        self.requests: dict[str, list[Captured]] = {}
        self.samples: dict[str, int] = {}
        self.errors: list[str] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: Any = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def __enter__(self) -> CaptureReceiver:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/{path}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        headers = {h: request.headers[h] for h in _KEPT_HEADERS if h in request.headers}
        path = request.match_info["path"]
        try:
            version, n = _samples_in(body, headers.get("Content-Type", ""), self.protos)
        except Exception as exc:  # the driver's own fault: said once, and no retries
            self.errors.append(f"{path}: {type(exc).__name__}: {exc}")
            return web.Response(status=400, text=self.errors[-1])
        self.requests.setdefault(path, []).append(Captured(headers, body))
        self.samples[path] = self.samples.get(path, 0) + n
        answer = {}
        if version == 2:
            answer = {_WRITTEN.format(k): str(v) for k, v in
                      (("Samples", n), ("Histograms", 0), ("Exemplars", 0))}  # fmt: skip
        return web.Response(status=204, headers=answer)


# -- decoding, to canonical JSON -----------------------------------------------------------------


def _sample(timestamp_ms: int, value: float) -> str:
    """A sample as one string: its timestamp and its value exactly (repr, or a NaN's bits, since
    a stale marker is one NaN of many)."""
    shown = "NaN:" + struct.pack(">d", value).hex() if math.isnan(value) else repr(value)
    return f"{timestamp_ms} {shown}"


def _labels(pairs: Iterator[tuple[str, str]]) -> str:
    """Labels as one string, in the order sent, values quoted as in the text exposition."""
    return ",".join(f'{k}="{_quote(v)}"' for k, v in pairs)


def _quote(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _samples_in(body: bytes, content_type: str, protos: Protos) -> tuple[int, int]:
    """(protocol version, samples) of a request body, without decoding it to text."""
    import snappy

    raw = snappy.uncompress(body)
    if _V2 in content_type:
        v2 = protos.writev2_pb2.Request.FromString(raw)
        return 2, sum(len(ts.samples) for ts in v2.timeseries)
    v1 = protos.remote_pb2.WriteRequest.FromString(raw)
    return 1, sum(len(ts.samples) for ts in v1.timeseries)


def decode(req: Captured, protos: Protos) -> dict[str, Any]:
    """One request as JSON-ready data, everything in the order sent."""
    import snappy

    raw = snappy.uncompress(req.body)
    out: dict[str, Any] = {"headers": req.headers}
    if _V2 in req.headers.get("Content-Type", ""):
        msg = protos.writev2_pb2.Request.FromString(raw)
        sym = list(msg.symbols)
        out["version"] = 2
        out["symbols"] = sym
        out["timeseries"] = [
            {
                "labels": _labels((sym[a], sym[b]) for a, b in
                                  zip(ts.labels_refs[::2], ts.labels_refs[1::2], strict=True)),
                "samples": [f"{_sample(s.timestamp, s.value)} start={s.start_timestamp}"
                            for s in ts.samples],
                "histograms": len(ts.histograms),
                "exemplars": len(ts.exemplars),
                "metadata": f"type={ts.metadata.type} help={sym[ts.metadata.help_ref]!r} "
                            f"unit={sym[ts.metadata.unit_ref]!r}",
            }
            for ts in msg.timeseries
        ]  # fmt: skip
        return out
    msg = protos.remote_pb2.WriteRequest.FromString(raw)
    out["version"] = 1
    out["timeseries"] = [
        {
            "labels": _labels((label.name, label.value) for label in ts.labels),
            "samples": [_sample(s.timestamp, s.value) for s in ts.samples],
        }
        for ts in msg.timeseries
    ]
    out["metadata"] = [f"{m.metric_family_name} type={m.type} help={m.help!r} unit={m.unit!r}"
                       for m in msg.metadata]  # fmt: skip
    return out


def requests_json(requests: Sequence[Captured], protos: Protos) -> str:
    """Each request decoded, one sample a line, so that a diff shows the first that differs."""
    return _dumps([decode(r, protos) for r in requests])


def bodies_text(requests: Sequence[Captured], ordered: bool = True) -> str:
    """Each request's uncompressed bytes as length and SHA-256: the encoding itself, which may
    change where the decoded requests do not (``ordered=False``: sorted, for several shards)."""
    import snappy

    lines = []
    for r in requests:
        raw = snappy.uncompress(r.body)
        lines.append(f"{len(raw)} {hashlib.sha256(raw).hexdigest()}\n")
    return "".join(lines if ordered else sorted(lines))


def merged_json(requests: Sequence[Captured], protos: Protos) -> str:
    """Every series' samples over all requests, series sorted by labels: for requests that
    arrive in no set order (several shards)."""
    by_series: dict[str, list[str]] = {}
    metadata: set[str] = set()
    headers: set[str] = set()
    for r in requests:
        d = decode(r, protos)
        headers.add(json.dumps(d["headers"], sort_keys=True))
        metadata.update(d.get("metadata", ()))
        for ts in d["timeseries"]:
            by_series.setdefault(ts["labels"], []).extend(ts["samples"])
    series = {k: sorted(v, key=lambda s: int(s.split()[0])) for k, v in sorted(by_series.items())}
    return _dumps({"headers": sorted(headers), "metadata": sorted(metadata), "series": series})


def _dumps(data: Any) -> str:
    """Indented JSON, one string (a sample, a label set) a line: a diff shows the first that
    differs. orjson: the standard library's indenting encoder is pure Python, ten times slower."""
    import orjson

    return orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n"

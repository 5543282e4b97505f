"""Prometheus text exposition (format 0.0.4) of the latest snapshot, as dcgm-exporter serves it.

``render`` writes a snapshot's page. ``Page`` is what /metrics serves: the latest snapshot's page
rendered at most once (on the first request after a window), gzipped at most once, the same bytes
for every request until the next window; a series' text (name and labels) is kept across windows,
so a render formats only the values. The same holds for the protobuf page
(``exposition_proto``), which a scraper gets when its ``Accept`` asks for it: the text format has
no native histograms, so the histogram series are on the protobuf page only.
"""

from __future__ import annotations

import gzip
import math
from collections import defaultdict

from hfsampler.export import exposition_proto
from hfsampler.series import Family, Series, Snapshot, is_stale

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Labels pushes carry because no scrape adds them; a scrape of /metrics adds its own (and a
# second one would come back as exported_instance), so /metrics leaves them off.
SCRAPE_ADDED_LABELS = frozenset({"instance"})
# The page is mostly repeated label text: level 1 already takes 8 sim GPUs' 298 KB to 16 KB in
# 0.7 ms; the default level (6) gets 13 KB for 2.0 ms, every window.
GZIP_LEVEL = 1


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _series_text(s: Series) -> str:
    labels = [(k, v) for k, v in s.labels if k not in SCRAPE_ADDED_LABELS]
    if not labels:
        return s.name
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
    return f"{s.name}{{{inner}}}"


def _family_text(family: Family) -> str:
    return f"# HELP {family.name} {_escape_help(family.help)}\n# TYPE {family.name} {family.type}"


def _render(snapshot: Snapshot, texts: dict[int, str], seen: dict[int, str]) -> str:
    """The page; each series' text from ``texts`` (by ``Series.id``) where it is, and every one
    used put in ``seen``, so that a caller keeps only the live series' for the next window."""
    by_name: dict[str, list[tuple[Series, float]]] = defaultdict(list)
    for s, v in snapshot.items():
        if not is_stale(v):
            by_name[s.name].append((s, v))
    lines: list[str] = []
    for name in sorted(by_name):
        family = snapshot.families.get(name)
        if family is not None:
            lines.append(_family_text(family))
        for s, v in by_name[name]:
            text = texts.get(s.id)
            if text is None:
                text = _series_text(s)
            seen[s.id] = text
            lines.append(f"{text} {format_value(v)}")
    return "\n".join(lines) + "\n" if lines else ""


def render(snapshot: Snapshot | None) -> str:
    """The snapshot's series grouped by family with HELP and TYPE; stale markers left out, and
    the labels a scrape adds itself (``instance``)."""
    if snapshot is None:
        return ""
    return _render(snapshot, {}, {})


def content_type(protobuf: bool) -> str:
    return exposition_proto.CONTENT_TYPE if protobuf else CONTENT_TYPE


class Page:
    """/metrics' body: the latest snapshot's page in either format, each rendered and gzipped at
    most once per window (``protobuf``: the delimited protobuf format, else text).

    ``renders`` counts the pages rendered (a scrape between windows renders none)."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self._body: dict[bool, bytes] = {}
        self._gzipped: dict[bool, bytes] = {}
        self._texts: dict[int, str] = {}  # by Series.id: the live series' text, kept
        self._labels: dict[int, bytes] = {}  # by Series.id: its protobuf label bytes, kept
        self.renders = 0

    def update(self, snapshot: Snapshot) -> None:
        """A new window: the next request renders it (none renders what nobody asks for)."""
        self._snapshot = snapshot
        self._body, self._gzipped = {}, {}

    def body(self, protobuf: bool = False) -> bytes:
        """The page (empty before the first window)."""
        body = self._body.get(protobuf)
        if body is None:
            if self._snapshot is None:
                return b""
            if protobuf:
                labels: dict[int, bytes] = {}
                body = exposition_proto.render(
                    self._snapshot, self._labels, labels, SCRAPE_ADDED_LABELS
                )
                self._labels = labels  # an ended series' bytes go with it
            else:
                seen: dict[int, str] = {}
                body = _render(self._snapshot, self._texts, seen).encode()
                self._texts = seen
            self._body[protobuf] = body
            self.renders += 1
        return body

    def gzipped(self, protobuf: bool = False) -> bytes:
        """The page gzipped (``Content-Encoding: gzip``), for a client that accepts it."""
        zipped = self._gzipped.get(protobuf)
        if zipped is None:
            # mtime 0: the same page gives the same bytes
            zipped = self._gzipped[protobuf] = gzip.compress(
                self.body(protobuf), GZIP_LEVEL, mtime=0
            )
        return zipped


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` value takes gzip: named, or ``*`` where gzip is not,
    with a weight above 0 (RFC 9110, 12.5.3)."""
    weights: dict[str, float] = {}
    for coding in accept_encoding.split(","):
        name, _, params = coding.partition(";")
        weight = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        weights[name.strip().lower()] = weight
    return weights.get("gzip", weights.get("*", 0.0)) > 0

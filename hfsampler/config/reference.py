"""The configuration reference: every key, as the declarations and the ``remote_write`` key sets
say it, rendered as one markdown table (``docs/configuration.md`` is generated from it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields

from hfsampler.config.keys import Key, show_default
from hfsampler.config.loader import PASTED_KEYS
from hfsampler.config.settings import KEYS
from hfsampler.remote_write.keys import (
    ENDPOINT_ACCEPTED,
    ENDPOINT_KEYS,
    METADATA_KEYS,
    QUEUE_ACCEPTED,
    QUEUE_KEYS,
    Accepted,
    KeyDoc,
)
from hfsampler.remote_write.security import TLS_KEYS, TLSConfig

Row = tuple[str, str, str, str, str]  # key, type, default, flag, meaning
_HEADER = ("Key", "Type", "Default", "Flag", "Meaning")


def _cell(text: str) -> str:
    """A table cell: a pipe or a line break would end it."""
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _key_rows(keys: Iterable[Key]) -> list[Row]:
    rows = []
    for k in keys:
        names = " / ".join(_code(n) for n in (k.yaml, *k.also) if n) or "(flag only)"
        flag = _code(k.flag.name) if k.flag is not None else ""
        default = show_default(k) if k.field else "none"
        rows.append((names, k.type, default, flag, k.doc))
    return rows


def _endpoint_rows(
    prefix: str, keys: Mapping[str, KeyDoc], accepted: Mapping[str, Accepted]
) -> list[Row]:
    rows: list[Row] = [
        (_code(prefix + name), d.type, d.default, "", d.doc) for name, d in keys.items()
    ]
    rows += [
        (_code(prefix + name), "as Prometheus's", "", "", f"accepted with {a.doc}")
        for name, a in accepted.items()
    ]
    return rows


def _tls_rows(prefix: str) -> list[Row]:
    """``tls_config``'s keys with their types and defaults, read from ``TLSConfig``."""
    defaults = {f.name: f.default for f in fields(TLSConfig)}
    rows: list[Row] = []
    for name in TLS_KEYS:
        default = defaults[name]
        is_bool = isinstance(default, bool)
        kind = "bool" if is_bool else "path" if name.endswith("_file") else "string"
        shown = str(default).lower() if is_bool else str(default or "none")
        rows.append((_code(prefix + name), kind, shown, "", "as Prometheus's tls_config"))
    return rows


def reference_rows() -> list[Row]:
    """Every key hfsampler takes: its own (top-level and nested), those of a pasted Prometheus
    config it accepts, and each ``remote_write`` endpoint's."""
    rw = "remote_write[]."
    return [
        *_key_rows(sorted(KEYS, key=lambda k: (k.yaml is None, k.yaml or k.field))),
        *_key_rows(PASTED_KEYS),
        *_endpoint_rows(rw, ENDPOINT_KEYS, ENDPOINT_ACCEPTED),
        *_endpoint_rows(rw + "queue_config.", QUEUE_KEYS, QUEUE_ACCEPTED),
        *_endpoint_rows(rw + "metadata_config.", METADATA_KEYS, {}),
        *_tls_rows(rw + "tls_config."),
    ]


def reference_markdown() -> str:
    """The reference as a markdown table: key, type, default, flag, meaning."""
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in reference_rows()]
    return "\n".join(lines) + "\n"

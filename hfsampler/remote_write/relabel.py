"""Relabel: Prometheus's ``write_relabel_configs``, applied once per series per endpoint.

Supported actions are ``replace`` (the default), ``keep``, ``drop``, ``hashmod``,
``labeldrop``, ``labelkeep`` and ``labelmap``, with Prometheus's defaults (``separator: ';'``,
``regex: '(.*)'``, ``replacement: '$1'``) and its anchoring: a regex must match the whole value,
as if written ``^(?:regex)$``. Regexes are limited to what RE2 (Go's engine) accepts, so a config
that works here works in Prometheus too: lookarounds and backreferences are refused. Replacement
templates use Go's syntax: ``$1``, ``${1}``, ``$name``, ``${name}``, ``$$``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hfsampler.errors import ConfigError
from hfsampler.series import LABEL_NAME_RE, METRIC_NAME_RE, Series, SeriesRegistry

ACTIONS = ("replace", "keep", "drop", "hashmod", "labeldrop", "labelkeep", "labelmap")
_KEYS = ("source_labels", "separator", "target_label", "regex", "replacement", "action", "modulus")
# Prometheus takes modulus as a uint64.
MAX_MODULUS = (1 << 64) - 1
# Constructs Python's re has and RE2 does not: lookarounds, backreferences, possessive/atomic.
_NOT_RE2 = re.compile(r"\(\?<?[=!]|\\[1-9]|\(\?>|\(\?P=|[*+?}]\+")
# Go's template: $$, ${name}, or $name where name is the longest run of word characters.
_TEMPLATE = re.compile(r"\$(?:(\$)|\{(\w+)\}|(\w+))")


@dataclass(frozen=True, slots=True)
class RelabelRule:
    """One validated ``write_relabel_configs`` entry."""

    action: str = "replace"
    source_labels: tuple[str, ...] = ()
    separator: str = ";"
    target_label: str = ""
    regex: re.Pattern[str] = re.compile(r"(?:(.*))\Z")
    replacement: str = "$1"
    modulus: int = 0  # hashmod only


def compile_regex(text: object, key: str) -> re.Pattern[str]:
    """An RE2-compatible regex, anchored at both ends as Prometheus anchors it."""
    if not isinstance(text, str):
        raise ConfigError(key, "must be a string", "quote it, e.g. 'DCGM_.*_max'")
    if _NOT_RE2.search(text):
        raise ConfigError(
            key, "uses lookaround, backreferences or possessive repeats", "RE2 has none of them"
        )
    try:
        # Prometheus anchors with ^(?:...)$ where Go's $ is the end of text: \Z here, not $.
        return re.compile(f"(?:{text})\\Z")
    except re.error as exc:
        raise ConfigError(key, f"is not a valid regex: {exc.msg}") from None


def expand(template: str, match: re.Match[str]) -> str:
    """Go's ``Regexp.Expand``: unknown or unmatched groups become empty."""

    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(3)
        try:
            value = match.group(int(name) if name.isdigit() else name)
        except IndexError:  # no such group, as Go's Expand
            return ""
        return value or ""

    return _TEMPLATE.sub(one, template)


def parse_rules(raw: object, key: str) -> tuple[RelabelRule, ...]:
    """Every rule of a ``write_relabel_configs`` list, validated."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(key, "must be a list of rules", "start each rule with '- action:'")
    return tuple(_parse_rule(item, f"{key}[{i}]") for i, item in enumerate(raw))


def _parse_rule(raw: object, key: str) -> RelabelRule:
    if not isinstance(raw, Mapping):
        raise ConfigError(key, "must be a mapping", "e.g. {action: keep, regex: '.*_max'}")
    for k in raw:
        if k not in _KEYS:
            raise ConfigError(f"{key}.{k}", "is not a known key", "known: " + ", ".join(_KEYS))
    action = raw.get("action", "replace")
    if not isinstance(action, str) or action.lower() not in ACTIONS:
        raise ConfigError(
            f"{key}.action", f"unknown action {action!r}", "one of " + ", ".join(ACTIONS)
        )
    action = action.lower()
    sources = raw.get("source_labels", [])
    if sources is None:
        sources = []
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ConfigError(f"{key}.source_labels", "must be a list of label names")
    for s in sources:
        if not LABEL_NAME_RE.match(s):
            raise ConfigError(f"{key}.source_labels", f"{s!r} is not a valid label name")
    separator = raw.get("separator", ";")
    replacement = raw.get("replacement", "$1")
    target = raw.get("target_label", "")
    for name, value in (("separator", separator), ("replacement", replacement)):
        if not isinstance(value, str):
            raise ConfigError(f"{key}.{name}", "must be a string")
    if not isinstance(target, str):
        raise ConfigError(f"{key}.target_label", "must be a string")
    regex = compile_regex(raw.get("regex", "(.*)"), f"{key}.regex")
    if action == "replace" and not target:
        raise ConfigError(f"{key}.target_label", "is required for action replace")
    if action in ("keep", "drop") and not sources:
        raise ConfigError(f"{key}.source_labels", f"is required for action {action}")
    if action in ("labeldrop", "labelkeep") and (sources or target):
        raise ConfigError(
            key, f"action {action} takes only regex", "remove source_labels/target_label"
        )
    modulus = raw.get("modulus", 0)
    if action == "hashmod":
        if not target or not LABEL_NAME_RE.match(target):
            raise ConfigError(
                f"{key}.target_label", "must be a label name for action hashmod", "e.g. shard"
            )
        if isinstance(modulus, bool) or not isinstance(modulus, int):
            raise ConfigError(f"{key}.modulus", "must be a whole number", "e.g. modulus: 4")
        if not 0 < modulus <= MAX_MODULUS:
            raise ConfigError(
                f"{key}.modulus",
                "is required for hashmod and must be between 1 and 2^64-1",
                "e.g. modulus: 4",
            )
    elif "modulus" in raw:
        raise ConfigError(f"{key}.modulus", f"applies to hashmod only, not {action}", "remove it")
    return RelabelRule(action, tuple(sources), separator, target, regex, replacement, modulus)


def hashmod(value: str, modulus: int) -> int:
    """Prometheus's hashmod: the last 8 bytes of the value's MD5, big-endian, mod ``modulus``."""
    digest = hashlib.md5(value.encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[8:], "big") % modulus


def apply(rules: Sequence[RelabelRule], labels: dict[str, str]) -> dict[str, str] | None:
    """The relabelled label set (``__name__`` included), or None when the series is dropped."""
    for rule in rules:
        if rule.action in ("keep", "drop", "replace"):
            value = rule.separator.join(labels.get(s, "") for s in rule.source_labels)
            m = rule.regex.match(value)
            if rule.action == "keep" and m is None:
                return None
            if rule.action == "drop" and m is not None:
                return None
            if rule.action == "replace" and m is not None:
                target = expand(rule.target_label, m)
                if not LABEL_NAME_RE.match(target):
                    continue  # Prometheus skips an invalid target, it is not an error
                result = expand(rule.replacement, m)
                if result:
                    labels[target] = result
                else:
                    labels.pop(target, None)
        elif rule.action == "hashmod":
            value = rule.separator.join(labels.get(s, "") for s in rule.source_labels)
            labels[rule.target_label] = str(hashmod(value, rule.modulus))
        elif rule.action == "labeldrop":
            labels = {k: v for k, v in labels.items() if not rule.regex.match(k)}
        elif rule.action == "labelkeep":
            labels = {k: v for k, v in labels.items() if rule.regex.match(k)}
        elif rule.action == "labelmap":
            mapped = {}
            for k, v in labels.items():
                m = rule.regex.match(k)
                if m is not None:
                    new = expand(rule.replacement, m)
                    if LABEL_NAME_RE.match(new):
                        mapped[new] = v
            labels.update(mapped)
    name = labels.get("__name__", "")
    if not METRIC_NAME_RE.match(name):
        return None  # no valid metric name is left: the series cannot be sent
    return {k: v for k, v in labels.items() if v}


class Relabeller:
    """One endpoint's rules applied to series: each series relabelled once, then cached.

    Relabelled series get ids of their own (a registry per endpoint), so the encoder's label
    cache stays per series. A series whose stale marker has gone out is forgotten, so pod
    churn cannot grow the cache.
    """

    def __init__(self, rules: Sequence[RelabelRule]) -> None:
        self.rules = tuple(rules)
        self._cache: dict[int, Series | None] = {}
        self._registry = SeriesRegistry()

    def __len__(self) -> int:
        return len(self._cache)

    def series(self, series: Series) -> Series | None:
        """The series as this endpoint sends it, or None when a rule drops it."""
        try:
            return self._cache[series.id]
        except KeyError:
            pass
        labels = apply(self.rules, {"__name__": series.name, **dict(series.labels)})
        out = None
        if labels is not None:
            name = labels.pop("__name__")
            out = self._registry.series(name, labels)
        self._cache[series.id] = out
        return out

    def forget(self, series: Series) -> None:
        """``series`` ended (its stale marker is queued): drop what was cached for it."""
        out = self._cache.pop(series.id, None)
        if out is not None:
            self._registry.forget([out])

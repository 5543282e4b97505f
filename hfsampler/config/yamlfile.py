"""A YAML file read as Prometheus reads its own: safely, a key given twice refused, and every
mistake one ``ConfigError``; and an unknown key named with the nearest known one.

The config file (``config.loader``) and the web configuration file (``config.webconfig``) are
both read here, so a file pasted between hfsampler and a Prometheus tool means the same in both.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hfsampler.errors import ConfigError


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: object, first_line: int, line: int) -> None:
        super().__init__(f"{key}: given twice")
        self.key = key
        self.first_line = first_line
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping.

    PyYAML keeps the last value without a word; Prometheus (Go's strict YAML) refuses the file,
    so a block pasted between the two must mean the same in both. A merge key (``<<``) may still
    be overridden: only keys written in the mapping itself count.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKeyError(key, seen[key], line)
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the safe loader names that problem itself
        mapping: dict[Any, Any] = super().construct_mapping(node, deep)
        return mapping


def read_yaml(path: str | Path, key: str) -> object:
    """The YAML document in ``path``. A file that cannot be read is a mistake in ``key`` (the
    option that named it); one that is not valid YAML, a mistake in the file, which is named.
    No message quotes the file's text: it may hold secrets."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(key, f"cannot read {p}: {exc.strerror}", "check the path") from None
    except UnicodeDecodeError:
        raise ConfigError(key, f"{p} is not UTF-8 text", "save it as UTF-8") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except RecursionError:
        # PyYAML builds nested nodes recursively: a file nested hundreds deep runs out of stack
        raise ConfigError(
            str(p), "is nested too deeply to be a config file", "check its brackets and indents"
        ) from None
    except _DuplicateKeyError as exc:
        where = (
            f"on line {exc.line}"
            if exc.line == exc.first_line
            else f"at lines {exc.first_line} and {exc.line}"
        )
        raise ConfigError(str(p), f"{exc.key}: given twice, {where}", "keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(str(p), f"{problem}{where}", "fix the YAML syntax") from None


def unknown_key(key: str, allowed: Sequence[str], where: str = "") -> ConfigError:
    """``where + key`` is no key here: the nearest known one offered, else all of them."""
    close = difflib.get_close_matches(key, allowed, n=1)
    fix = f"did you mean {close[0]!r}?" if close else "known keys: " + ", ".join(allowed)
    return ConfigError(f"{where}{key}", "unknown key", fix)

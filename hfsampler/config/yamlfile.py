"""A YAML file read as Prometheus reads its own: safely, a key given twice refused, and every
mistake one ``ConfigError``; and an unknown key named with the nearest known one.

The config file (``config.loader``) and the web configuration file (``config.webconfig``) are
both read here, so a file pasted between hfsampler and a Prometheus tool means the same in both;
``read_text`` reads them, and the counters file (``config.counters_csv``), as written.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hfsampler.errors import ConfigError

# Config files are written by hand (dcgm-exporter's counters file is 10 KB): a larger one is a
# wrong path, a log or a device, read no further.
MAX_FILE_BYTES = 1 << 20
# A quoted token of a YAML error (an alias, a tag) is the file's text, maybe a password; one
# character (what cannot start a token) or PyYAML's own <token> names say nothing secret.
_QUOTED = re.compile(r"'(?!<[a-z ]+>')[^']{2,}'")


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
    text = read_text(str(p), key)
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
        problem = _QUOTED.sub("'...'", getattr(exc, "problem", None) or "invalid YAML")
        raise ConfigError(str(p), f"{problem}{where}", "fix the YAML syntax") from None


def read_text(path: str, key: str) -> str:
    """The UTF-8 text of the file ``path`` exactly as written (a lone CR stays in it, as Go's
    readers keep it). A FIFO or a device is refused without reading it, as is a file over
    ``MAX_FILE_BYTES``: either would hang the start or a reload, or fill the memory."""
    try:  # O_NONBLOCK: opening a FIFO with no writer would block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        reason = getattr(exc, "strerror", None) or "not a usable path"
        raise ConfigError(key, f"cannot read {path}: {reason}", "check the path") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(key, f"{path} is not a regular file", "name the file itself")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(key, f"cannot read {path}: {exc.strerror}", "check it") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            key, f"{path} is over {MAX_FILE_BYTES >> 20} MiB", "name the config file itself"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(key, f"{path} is not UTF-8 text", "save it as UTF-8") from None


def unknown_key(key: str, allowed: Sequence[str], where: str = "") -> ConfigError:
    """``where + key`` is no key here: the nearest known one offered, else all of them."""
    close = difflib.get_close_matches(key, allowed, n=1)
    fix = f"did you mean {close[0]!r}?" if close else "known keys: " + ", ".join(allowed)
    return ConfigError(f"{where}{key}", "unknown key", fix)

"""What a config key is: its YAML name, flag, type and parser, reload rule and one line of doc.

Each key is declared once, on its ``Config`` field (``hfsampler.config.settings``), with ``key``:
the field's default is the key's default, and ``declared`` reads the declarations back for the
file loader, the flags, the reload rules and the configuration reference. The YAML value parsers
here turn what the file holds into the field's value, or a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from hfsampler import fields as catalogue
from hfsampler.config.counters_csv import CountersFile, read_counters_file
from hfsampler.durations import parse_duration
from hfsampler.errors import ConfigError
from hfsampler.remote_write.config import parse_remote_write, parse_size

# (the YAML value, the key's dotted name, the key's example) -> the field's value
Parse = Callable[[object, str, str], Any]
# (the YAML value, the key's dotted name) -> the Config fields it sets
Load = Callable[[object, str], dict[str, Any]]
# What a reload does with a changed key: take it as it is (live), rebuild the metric model
# (labels), restart the changed endpoints (endpoints), or keep the running value until a restart.
Reload = Literal["live", "labels", "endpoints", "restart"]
_METADATA = "hfsampler.key"


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag as every command that takes it spells it; ``help`` is `run`'s wording.

    The flag's value passes through ``convert`` (which raises ``ConfigError`` naming the flag: a
    mistake in a flag reads like one in the file), or through ``merge``, which also gets the
    value the files gave (``--label`` adds to the file's labels).
    """

    name: str
    help: str | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    repeat: bool = False  # given once per value, collected in a list
    convert: Callable[[Any, str], Any] | None = None  # (value, flag name) -> the field's value
    merge: Callable[[Any, Any, str], Any] | None = None  # (the file's value, value, flag name)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True, slots=True)
class Key:
    """One config key: how the file spells it, the flag that sets it, and what it means."""

    yaml: str | None  # dotted for a nested key (``dcgm.path``); None: a flag only
    type: str  # as the reference names it: duration, size, string, ...
    doc: str  # one line
    example: str = ""  # a value the messages offer after "e.g."
    parse: Parse | None = None
    load: Load | None = None  # a key that sets other fields than its own (`intervals: auto`)
    flag: Flag | None = None
    reload: Reload = "restart"
    also: tuple[str, ...] = ()  # other YAML names merged into the same field
    shown_default: str | None = None  # how the reference writes the default, where needed
    spec: str | None = None  # the ``SourceSpec`` field it sets: the source's own settings
    field: str = ""  # the Config field: filled in by ``declared``
    default: object = None  # the field's default: filled in by ``declared``

    def load_value(self, value: object, name: str) -> dict[str, Any]:
        """The Config fields the YAML ``value`` of this key (as ``name``) sets."""
        if self.load is not None:
            return self.load(value, name)
        assert self.parse is not None, f"{self.field} has neither parse nor load"
        return {self.field: self.parse(value, name, self.example)}


def key(
    default: object = dataclasses.MISSING,
    *,
    factory: Callable[[], object] | None = None,
    **declaration: Any,
) -> Any:
    """A ``Config`` field declaring its key (``Key``'s arguments); ``factory`` for a mutable
    default. Typed ``Any`` as ``dataclasses.field`` is, so the field keeps its own type."""
    metadata = {_METADATA: Key(**declaration)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def declared(cls: type) -> tuple[Key, ...]:
    """Every key declared on the dataclass ``cls``, in field order, with field and default."""
    out = []
    for f in dataclasses.fields(cls):
        if _METADATA in f.metadata:
            default = f.default_factory() if callable(f.default_factory) else f.default
            out.append(replace(f.metadata[_METADATA], field=f.name, default=default))
    return tuple(out)


# -- YAML values ----------------------------------------------------------------------------------


_KINDS = {int: "a whole number", bool: "true or false", str: "a string", list: "a list",
          dict: "a mapping"}  # fmt: skip


def expect(value: object, kind: type | tuple[type, ...], key: str, example: str) -> Any:
    """``value`` if it is a ``kind`` (a bool is no number), else a mistake offering ``example``."""
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        what = _KINDS.get(kind, "a number") if isinstance(kind, type) else "a number"
        raise ConfigError(key, f"expected {what}, got {value!r}", f"e.g. {key}: {example}")
    return value


def as_text(value: object, key: str, example: str) -> str:
    text: str = expect(value, str, key, example)
    return text


def as_text_or_none(value: object, key: str, example: str) -> str | None:
    """A string; the empty one turns the setting off."""
    return as_text(value, key, example) or None


def as_lower(value: object, key: str, example: str) -> str:
    return as_text(value, key, example).lower()


def as_whole(value: object, key: str, example: str) -> int:
    number: int = expect(value, int, key, example)
    return number


def as_bool(value: object, key: str, example: str) -> bool:
    flag: bool = expect(value, bool, key, example)
    return flag


# A number as Go's YAML (Prometheus's) and YAML 1.2 read it: PyYAML's YAML 1.1 reads ``1e-3`` and
# ``1.5e3`` (no dot, or no exponent sign) as text, so a plain scalar of this form is taken as one.
_GO_YAML_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def as_number(value: object, key: str, example: str) -> float:
    if isinstance(value, str) and _GO_YAML_FLOAT.fullmatch(value):
        return float(value)
    return float(expect(value, (int, float), key, example))


def as_wholes(value: object, key: str, example: str) -> tuple[int, ...]:
    items = expect(value, list, key, example)
    return tuple(as_whole(i, f"{key}[]", "0") for i in items)


def as_names(value: object, key: str, example: str) -> tuple[str, ...]:
    """One name or a list of them."""
    items = [value] if isinstance(value, str) else expect(value, list, key, example)
    return tuple(as_text(i, f"{key}[]", "fast") for i in items)


def as_str_map(value: object, key: str, example: str = "a mapping") -> dict[str, str]:
    mapping = expect(value, dict, key, example)
    out = {}
    for k, v in mapping.items():
        if not isinstance(k, str) or isinstance(v, dict | list) or v is None:
            raise ConfigError(f"{key}.{k}", f"expected a string value, got {v!r}", "quote it")
        out[k] = str(v)
    return out


def as_duration(value: object, key: str, example: str) -> float:
    return parse_duration(value, key)


def as_size(value: object, key: str, example: str) -> int:
    return parse_size(value, key)


def as_listen(value: object, key: str, example: str) -> str | None:
    return None if value in (None, "", False) else as_text(value, key, example)


def as_instance(value: object, key: str, example: str) -> str:
    # `instance: ""` or `instance: false` leave the label off
    return "" if value in ("", False) else as_text(value, key, example)


def as_absolute_path(value: object, key: str, example: str) -> str:
    path = as_text(value, key, example)
    if not path.startswith("/"):
        raise ConfigError(key, f"{path!r} is not an absolute path", "start it with /")
    return path


def as_counters_file(value: object, key: str, example: str) -> CountersFile | None:
    """A dcgm-exporter counters file, read now; the empty path turns the setting off."""
    path = as_text(value, key, example)
    return read_counters_file(path, key) if path else None


def as_remote_write(value: object, key: str, example: str) -> object:
    return parse_remote_write(value, key)


def load_intervals(value: object, key: str) -> dict[str, Any]:
    """``intervals: auto`` (probe at start), or each group's interval over the defaults."""
    if value == "auto":
        return {"auto_intervals": True}
    intervals = expect(value, dict, key, "{fast: 1ms, slow: 100ms}")
    merged = dict(catalogue.DEFAULT_GROUP_INTERVALS_S)
    for group, text in intervals.items():
        if not isinstance(group, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", group):
            raise ConfigError(f"{key}.{group}", "bad group name", "use e.g. fast, slow")
        merged[group] = parse_duration(text, f"{key}.{group}")
    return {"intervals_s": merged}


def show_default(k: Key) -> str:
    """The key's default as a user would write it in the file."""
    if k.shown_default is not None:
        return k.shown_default
    value = k.default
    if value is None or value == () or value == {}:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Mapping):
        return ", ".join(f"{name}: {v}" for name, v in value.items())
    return str(value)

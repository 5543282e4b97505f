"""The config file: each top-level and nested key handed to its declaration (``KEYS``).

Read by ``config.yamlfile`` (a key given twice, a file that is not UTF-8: one ``ConfigError``).
Every key the file names that hfsampler does not take (a typo, a Prometheus key it has no use
for, in the file or its ``remote_write`` block) is named in one message, so a pasted block is
fixed in one edit, not one key per run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hfsampler.config.keys import Key, expect
from hfsampler.config.settings import KEYS, Config
from hfsampler.config.yamlfile import read_yaml, unknown_key
from hfsampler.durations import parse_prometheus_duration
from hfsampler.errors import ConfigError, one_error
from hfsampler.remote_write.keys import unsupported_keys


def _unused(value: object, key: str) -> dict[str, Any]:
    parse_prometheus_duration(value, key)  # still a valid one, as Prometheus would check
    return {}


# Keys of a pasted Prometheus config that hfsampler takes and has no use for: it does not scrape
# or evaluate rules (its own timing is `intervals` and `window`).
PASTED_KEYS: tuple[Key, ...] = tuple(
    Key(yaml=f"global.{name}", type="duration", load=_unused, doc=f"{doc}: accepted, not used")
    for name, doc in (
        ("scrape_interval", "Prometheus's scrape interval (hfsampler does not scrape)"),
        ("scrape_timeout", "Prometheus's scrape timeout (hfsampler does not scrape)"),
        ("evaluation_interval", "Prometheus's rule evaluation interval (no rules here)"),
    )
)


def _names() -> tuple[dict[str, Key], dict[str, dict[str, Key]]]:
    """The top-level keys and, per block (``dcgm``, ``global``, ...), its keys. A name may be
    both (``consumers: false``, or a ``consumers:`` block whose ``enabled`` is the same key)."""
    top: dict[str, Key] = {}
    blocks: dict[str, dict[str, Key]] = {}
    for k in (*KEYS, *PASTED_KEYS):
        for name in (k.yaml, *k.also) if k.yaml else ():
            block, dot, sub = name.partition(".")
            if dot:
                blocks.setdefault(block, {})[sub] = k
            else:
                top[name] = k
    return top, blocks


_TOP, _BLOCKS = _names()
TOP_LEVEL_KEYS = (*_TOP, *_BLOCKS)  # every key the file may have at its top level


def _block_example(block: str) -> str:
    sub, first = next(iter(_BLOCKS[block].items()))
    return f"{{{sub}: {first.example}}}"


def _check_names(data: Mapping[object, object]) -> None:
    """Every key the file names is one hfsampler takes: else one error naming them all."""
    problems: list[ConfigError] = []
    for name, value in data.items():
        if not isinstance(name, str) or name not in TOP_LEVEL_KEYS:
            problems.append(unknown_key(str(name), TOP_LEVEL_KEYS))
        elif name in _BLOCKS and isinstance(value, dict):
            known = tuple(_BLOCKS[name])
            problems += [unknown_key(str(s), known, f"{name}.") for s in value if s not in known]
        elif name == "remote_write":
            problems += unsupported_keys(value, name)
    if problems:
        raise one_error(problems)


def _apply(kw: dict[str, Any], k: Key, value: object, name: str) -> None:
    for field, v in k.load_value(value, name).items():
        if isinstance(kw.get(field), dict) and isinstance(v, dict):
            kw[field].update(v)  # external_labels and global.external_labels together
        else:
            kw[field] = v


def from_mapping(data: object, base: Config | None = None) -> Config:
    """Build a Config from the YAML file's top-level mapping; its keys replace ``base``'s."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "the config file must be a YAML mapping", "see docs/configuration.md")
    _check_names(data)
    kw: dict[str, Any] = {}
    for name, value in data.items():
        if name in _BLOCKS and (name not in _TOP or isinstance(value, dict)):
            block = expect(value, dict, name, _block_example(name))
            for sub, subvalue in block.items():
                _apply(kw, _BLOCKS[name][sub], subvalue, f"{name}.{sub}")
        else:
            _apply(kw, _TOP[name], value, name)
    return replace(base or Config(), **kw)


def load_file(path: str | Path, base: Config | None = None) -> Config:
    """Read and validate a config file; its keys replace those of ``base`` (an earlier file)."""
    return from_mapping(read_yaml(path, "--config"), base)

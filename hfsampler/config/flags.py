"""The flags that set a ``Config``: read from the keys' declarations, and one function turning
them into it.

`run`, `record` and `probe` register the flags they take with ``add_sampling_flags`` (a command
words a flag's help for itself where `run`'s wording does not fit) and build their ``Config``
with ``config_from_args``. A flag's name, metavar, type and what it changes in the ``Config`` are
declared once, with its key (``hfsampler.config.settings``), and are the same wherever it is
taken; only ``--config``, which names files rather than a key, is declared here.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from hfsampler.config.keys import Flag, Key
from hfsampler.config.loader import load_file
from hfsampler.config.settings import KEYS, SOURCES, Config

CONFIG_FLAG = Flag(
    "--config",
    "YAML config file (repeatable: a later file's keys replace an earlier's, e.g. a "
    "Secret's remote_write over a ConfigMap's; flags override both)",
    metavar="FILE",
    repeat=True,
)
# In `hfsampler run --help` order: the keys' order.
FLAGGED: tuple[tuple[Flag, Key], ...] = tuple((k.flag, k) for k in KEYS if k.flag is not None)
FLAGS: tuple[Flag, ...] = (CONFIG_FLAG, *(flag for flag, _ in FLAGGED))
BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}


def add_sampling_flags(
    parser: argparse.ArgumentParser,
    names: Sequence[str] | None = None,
    *,
    wording: Mapping[str, str | None] | None = None,
    sources: tuple[str, ...] = SOURCES,
) -> None:
    """Register the flags ``names`` (every one in ``FLAGS`` when None) on ``parser``, in order.

    ``wording`` replaces a flag's help for this command (None: no help text); ``sources`` narrows
    ``--source`` to the kinds the command can drive.
    """
    wording = wording or {}
    for name in names if names is not None else BY_NAME:
        flag = BY_NAME[name]
        options: dict[str, Any] = {
            "help": wording.get(name, flag.help),
            "metavar": flag.metavar,
            "choices": sources if name == "--source" else flag.choices,
        }
        if flag.type is not None:
            options["type"] = flag.type
        if flag.repeat:
            options.update(action="append", default=[])  # a new list per parser
        parser.add_argument(name, **options)


def config_from_args(args: argparse.Namespace, base: Config | None = None) -> Config:
    """``base`` (default ``Config()``), each ``--config`` file over it, then every flag given.

    Every command that samples builds its ``Config`` here. A flag a command registers itself must
    not take the ``dest`` of one in ``FLAGS`` (`record`'s ``--gpus`` selects GPUs: ``gpu_list``).
    """
    given = vars(args)
    config = base if base is not None else Config()
    for path in given.get(CONFIG_FLAG.dest) or ():
        config = load_file(path, config)
    changes: dict[str, Any] = {}
    for flag, k in FLAGGED:
        value = given.get(flag.dest)
        if value is None or (flag.repeat and not value):
            continue  # not given, or a flag this command does not take
        if flag.merge is not None:
            changes[k.field] = flag.merge(getattr(config, k.field), value, flag.name)
        elif flag.convert is not None:
            changes[k.field] = flag.convert(value, flag.name)
        else:
            changes[k.field] = value
    return replace(config, **changes) if changes else config

"""Which sampled gauges get native histograms (``histograms:``), and at which relative error.

``histograms`` takes names and groups as ``fields`` does (the catalogue's ``select``, its mistakes
naming ``histograms``): a field named must be a sampled gauge, else the key is refused with the
fix; a group or ``all`` stands for the sampled gauges among its fields, so ``histograms: [fast]``
means "every fast gauge" and never refuses its counters. ``histogram_relative_error`` picks the
bucket schema (``histograms.schema_for_error``): the coarsest whose buckets' centres are within
that fraction of every value in them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hfsampler import fields as catalogue
from hfsampler.errors import ConfigError
from hfsampler.histograms import SCHEMA_MAX, bucket_error, growth, schema_for_error

HISTOGRAMS_KEY = "histograms"
ERROR_KEY = "histogram_relative_error"
_GROUPS = ("all", *catalogue.DEFAULT_GROUP_INTERVALS_S)


def select_histograms(
    selectors: Sequence[str], sampled: Sequence[catalogue.Field]
) -> tuple[catalogue.Field, ...]:
    """The fields of ``sampled`` that ``selectors`` ask histograms of, in catalogue order."""
    names = {f.name for f in sampled}
    wanted: set[str] = set()
    for token in selectors:
        chosen = catalogue.select([token], HISTOGRAMS_KEY)
        if token.strip().lower() in _GROUPS:  # a group: its sampled gauges
            wanted.update(f.name for f in chosen if f.kind is catalogue.Kind.GAUGE)
            continue
        # the field named, not one it brought along (``requires``), which may come first
        required = {r for g in chosen for r in g.requires}
        f = next(g for g in chosen if g.name not in required)
        if f.kind is not catalogue.Kind.GAUGE:
            raise ConfigError(
                HISTOGRAMS_KEY,
                f"{f.name} is a {f.kind.value}, and only a gauge's samples make a distribution",
                "name gauges only (`hfsampler fields` lists each field's kind)",
            )
        if f.name not in names:
            raise ConfigError(
                HISTOGRAMS_KEY,
                f"{f.name} is not sampled",
                "add it to fields (or fields_csv), or leave it out of histograms",
            )
        wanted.add(f.name)
    return tuple(f for f in catalogue.CATALOGUE if f.name in wanted and f.name in names)


def check_relative_error(relative_error: float) -> None:
    """The error must be a fraction a schema can meet: below 1, and no finer than the finest
    schema's (8: 0.135%), which would otherwise be given in its place without a word."""
    if not 0 < relative_error < 1:
        raise ConfigError(
            ERROR_KEY, f"{relative_error:g} is out of range", "give a fraction, e.g. 0.05 for 5%"
        )
    finest = bucket_error(SCHEMA_MAX)
    if relative_error < finest:
        raise ConfigError(
            ERROR_KEY,
            f"{relative_error:g} is finer than native histograms go (schema {SCHEMA_MAX}: "
            f"{100 * finest:.3g}%)",
            f"give {math.ceil(finest * 1e5) / 1e5:g} or more",
        )


def histogram_warnings(counted: bool, serving: bool, sends: Sequence[bool]) -> list[str]:
    """What the histogram keys accepted will not do: histograms counted (``counted``) with no
    /metrics (``serving``) and no endpoint sending them, or endpoints that would send them (per
    ``remote_write`` entry, ``sends``) with none counted. Either is silent otherwise."""
    if counted and not serving and not any(sends):
        return [
            f"{HISTOGRAMS_KEY} are counted but go nowhere: listen is empty (no /metrics) and no "
            "remote_write endpoint has send_native_histograms: true; set it where the receiver "
            f"takes native histograms, or leave {HISTOGRAMS_KEY} out"
        ]
    if counted:
        return []
    return [
        f"remote_write[{i}].send_native_histograms is not used: {HISTOGRAMS_KEY} names no "
        f"field, so there are none to send; e.g. {HISTOGRAMS_KEY}: [DCGM_FI_DEV_POWER_USAGE]"
        for i, send in enumerate(sends)
        if send
    ]


def describe(relative_error: float) -> str:
    """check-config's line: the schema an error gives and how wide its buckets are."""
    schema = schema_for_error(relative_error)
    return (
        f"schema {schema}: buckets {100 * (growth(schema) - 1):.3g}% wide, a bucket's centre "
        f"within {100 * bucket_error(schema):.3g}% of its values"
    )

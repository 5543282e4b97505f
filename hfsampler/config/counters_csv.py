"""A dcgm-exporter counters file (``fields_csv``): the catalogue fields it selects, with its help.

dcgm-exporter reads ``FIELD, prometheus type, help`` rows with Go's ``encoding/csv`` (``Comment =
'#'``) and then trims spaces off each field (``internal/pkg/counters/counter_config.go``,
``ReadCSVFile`` and ``ExtractCounters``, NVIDIA/dcgm-exporter 7ad58324). The file is read here by
the same rules, so that a file means the same to both and one that dcgm-exporter refuses is
refused here too, naming its line:

- a line whose first character is ``#`` is a comment; ``  # ...`` (a space first) is not: it is a
  row of one field, refused;
- an empty line is skipped; a line of spaces is a row of one field, refused;
- fields are split on ``,``; a field whose first character is ``"`` is quoted (``""`` in it is a
  quote; it may hold commas and line breaks); a ``"`` anywhere else is refused, as Go refuses it
  (so ``, "a, b"`` with a space before the quote is refused: write ``,"a, b"``);
- each field is trimmed of spaces, not tabs (dcgm-exporter trims ``" "`` only);
- every row has three fields, and its type is one of ``TYPES`` as written (dcgm-exporter refuses
  any other, ``Gauge`` included).

What a row selects: a name of the catalogue (``hfsampler.fields``), exactly as written, selects
that field, whatever its prefix (``DCGM_FI_DEV_``, ``DCGM_FI_PROF_``, ``DCGM_EXP_``). A
``DCGM_FI_PROF_`` field is read where a GPU has it, found at start as dcgm-exporter finds it per
GPU. A ``label`` row asks for a label on every series, not a series: hfsampler sets
``DCGM_FI_DRIVER_VERSION`` always, and has no other. Any other name (a DCGM field hfsampler does
not read, an older per-link name) is left out, named in one warning line: users' files carry
DCGM-only fields, and dcgm-exporter's own defaults do.

What is honoured: the file's help text replaces the catalogue's, unless it names a unit, ``(in
X)``, other than the one hfsampler exports (then it would mislabel the values). The file's type
is the catalogue's or ``untyped`` (which claims nothing), or it contradicts the catalogue: a
window reduces a counter and a gauge differently (a counter is never averaged), so the
catalogue's type stays, and the warning names the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from hfsampler import fields as catalogue
from hfsampler.config.yamlfile import read_text
from hfsampler.errors import ConfigError

KEY = "fields_csv"
# The types dcgm-exporter takes (its promMetricType): it renders these as one sample each.
TYPES = ("counter", "gauge", "untyped", "label")
# The ``label`` rows hfsampler sets on every series itself (GPU_LABEL_NAMES).
SET_LABELS = frozenset(n for n in catalogue.GPU_LABEL_NAMES if n.startswith("DCGM_"))
_UNIT_RE = re.compile(r"\(in ([^)]*)\)")
_FIX_TYPE = "dcgm-exporter takes " + ", ".join(TYPES)


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the file, its fields trimmed as dcgm-exporter trims them."""

    line: int  # where the row starts, from 1
    name: str
    type: str
    help: str


@dataclass(frozen=True, slots=True)
class CountersFile:
    """What a counters file selects from the catalogue, and what it leaves out.

    Read at load, so a reload that finds the file changed needs a restart, as ``fields`` does.
    """

    path: str
    rows: tuple[Row, ...]

    @property
    def selected(self) -> tuple[str, ...]:
        """The catalogue names the file selects, in its order, once each."""
        names = (r.name for r in self.rows if r.type != "label" and r.name in catalogue.BY_NAME)
        return tuple(dict.fromkeys(names))

    @property
    def left_out(self) -> tuple[str, ...]:
        """The names hfsampler has nothing for (a label row: a label it does not set)."""
        out = []
        for r in self.rows:
            if r.type == "label":
                if r.name not in SET_LABELS:
                    out.append(f"{r.name} (a label)")
            elif r.name not in catalogue.BY_NAME:
                out.append(r.name)
        return tuple(dict.fromkeys(out))

    @property
    def labels(self) -> tuple[str, ...]:
        """The label rows hfsampler sets on every series anyway."""
        return tuple(dict.fromkeys(r.name for r in self.rows if r.name in SET_LABELS))

    def _first(self) -> dict[str, Row]:
        """The first row of each selected name: a name given again changes nothing."""
        first: dict[str, Row] = {}
        for r in self.rows:
            if r.type != "label" and r.name in catalogue.BY_NAME:
                first.setdefault(r.name, r)
        return first

    def contradicted_types(self) -> tuple[tuple[Row, str], ...]:
        """(row, the catalogue's type) where the row declares another type: the catalogue's
        stays."""
        out = []
        for r in self._first().values():
            kept = catalogue.BY_NAME[r.name].prometheus_type
            if r.type not in ("untyped", kept):
                out.append((r, kept))
        return tuple(out)

    def help_texts(self) -> dict[str, str]:
        """Per selected name, the help it is exported with: the file's where honoured."""
        return {name: _help(r, catalogue.BY_NAME[name]) for name, r in self._first().items()}

    def select(self, selectors: Iterable[str] | None) -> tuple[catalogue.Field, ...]:
        """The file's fields and those ``selectors`` (the ``fields`` key) name besides, in
        catalogue order, with the file's help texts where honoured."""
        wanted = set(self.selected)
        given = tuple(selectors or ())
        if any(s.strip() for s in given):  # ``fields: []`` beside the file: none besides
            wanted.update(f.name for f in catalogue.select(given))
        if not wanted:
            some = ", ".join(self.left_out[:5]) + (", ..." if len(self.left_out) > 5 else "")
            raise ConfigError(
                KEY,
                f"{self.path} selects no field hfsampler has" + (f" (only {some})" if some else ""),
                "`hfsampler fields` lists them; name some in the file or in fields",
            )
        helps = self.help_texts()
        return tuple(  # through the catalogue's selection: a counted field brings what it counts
            replace(f, help=helps[f.name]) if f.name in helps else f
            for f in catalogue.select(sorted(wanted))
        )

    def only(self, names: Iterable[str]) -> CountersFile:
        """This file without the rows of catalogue fields other than ``names`` (the probe's)."""
        keep = set(names)
        rows = tuple(r for r in self.rows if r.name not in catalogue.BY_NAME or r.name in keep)
        return replace(self, rows=rows)

    def warnings(self) -> list[str]:
        """One line naming every row left out; one naming every type the catalogue overrides."""
        out = []
        if self.left_out:
            out.append(
                f"{KEY}: {self.path}: hfsampler has no field for these, left out: "
                + ", ".join(self.left_out)
            )
        if contradicted := self.contradicted_types():
            out.append(
                f"{KEY}: {self.path}: a window reduces a counter and a gauge differently, so "
                "these keep the catalogue's type: "
                + ", ".join(f"{r.name} ({r.type} on line {r.line}, {kept} here)"
                            for r, kept in contradicted)
            )  # fmt: skip
        return out

    def describe(self) -> list[str]:
        """What ``check-config`` says of the file: selected, left out, help and labels."""
        selected = self.selected
        lines = [
            f"{KEY}: {self.path}: {len(self.rows)} rows, {len(selected)} fields selected, "
            f"{len(self.left_out)} left out",
            "  selected: " + (", ".join(selected) or "none"),
        ]
        if self.left_out:
            lines.append("  left out: " + ", ".join(self.left_out))
        if self.labels:
            lines.append("  labels hfsampler sets on every series: " + ", ".join(self.labels))
        kept = []
        for name, r in self._first().items():
            f = catalogue.BY_NAME[name]
            if (unit := _unit(r.help)) is not None and unit != f.unit:
                kept.append(f"{name} (the file's help says in {unit}, hfsampler exports {f.unit})")
        if kept:
            lines.append("  help from the catalogue, not the file: " + ", ".join(kept))
        return lines


def _unit(text: str) -> str | None:
    found = _UNIT_RE.search(text)
    return found.group(1).strip() if found else None


def _help(row: Row, field: catalogue.Field) -> str:
    """The file's help, unless it is empty or names a unit other than the exported one."""
    unit = _unit(row.help)
    if not row.help or (unit is not None and unit != field.unit):
        return field.help
    return row.help


class _CsvError(Exception):
    def __init__(self, line: int, problem: str) -> None:
        super().__init__(problem)
        self.line = line
        self.problem = problem


def _records(text: str) -> Iterator[tuple[int, list[str]]]:
    """(first line, fields) of each record, as Go's ``encoding/csv`` reads them with
    ``Comment = '#'`` (its ``readRecord``): comments and empty lines skipped, quotes as RFC 4180
    with no leniency."""
    lines = text.split("\n")
    at = 0
    while at < len(lines):
        line, start = lines[at].removesuffix("\r"), at + 1
        at += 1
        if line.startswith("#") or not line:
            continue
        fields: list[str] = []
        pos = 0
        while True:
            if line.startswith('"', pos):
                parts, pos = [], pos + 1
                while True:
                    quote = line.find('"', pos)
                    if quote < 0:  # the field goes on on the next line
                        if at == len(lines):
                            raise _CsvError(start, "a quoted field is never closed")
                        parts.append(line[pos:] + "\n")
                        line, pos = lines[at].removesuffix("\r"), 0
                        at += 1
                        continue
                    parts.append(line[pos:quote])
                    pos = quote + 1
                    if not line.startswith('"', pos):
                        break
                    parts.append('"')  # a doubled quote: one quote in the value
                    pos += 1
                fields.append("".join(parts))
                if pos == len(line):
                    break
                if line[pos] != ",":
                    raise _CsvError(at, 'text after a closing quote (a quote inside is "")')
                pos += 1
                if pos == len(line):
                    fields.append("")
                    break
            else:
                comma = line.find(",", pos)
                value = line[pos:] if comma < 0 else line[pos:comma]
                if '"' in value:
                    raise _CsvError(
                        at, 'a quote inside an unquoted field (quote the whole field, "..." '
                        "with no space before it)"
                    )  # fmt: skip
                fields.append(value)
                if comma < 0:
                    break
                pos = comma + 1
        yield start, fields


def parse_rows(text: str, path: str, key: str = KEY) -> tuple[Row, ...]:
    """The file's rows; a row dcgm-exporter would refuse is a ``ConfigError`` naming its line."""
    if text.startswith("\ufeff"):
        raise ConfigError(key, f"{path} starts with a byte-order mark", "save it as UTF-8 without")
    rows = []
    try:
        for line, fields in _records(text):
            where = f"{path}, line {line}"
            values = [f.strip(" ") for f in fields]
            if len(values) != 3:
                raise ConfigError(
                    key, f"{where}: {len(values)} fields", "a row is FIELD, prometheus type, help"
                )
            name, kind, help_text = values
            if not name:
                raise ConfigError(key, f"{where}: no field name", "a row is FIELD, type, help")
            if kind not in TYPES:
                raise ConfigError(key, f"{where}: {name}: unknown type {kind!r}", _FIX_TYPE)
            rows.append(Row(line, name, kind, help_text))
    except _CsvError as exc:
        raise ConfigError(key, f"{path}, line {exc.line}: {exc.problem}", "as Go's csv") from None
    return tuple(rows)


def read_counters_file(path: str, key: str = KEY) -> CountersFile:
    """Read and check the counters file at ``path``; ``key`` is how the user named it."""
    return CountersFile(path, parse_rows(read_text(path, key), path, key))


def counters_file_flag(value: str, name: str) -> CountersFile | None:
    """``--fields-csv FILE``; ``''`` turns it off (over a file's ``fields_csv``)."""
    return read_counters_file(value, name) if value else None

"""Regenerate the references in docs/ from the code, so they are never copied by hand.

    python scripts/gen_docs.py          rewrite every generated part
    python scripts/gen_docs.py --check  exit 1, naming the stale files, if any part is out of date

Each generated part sits in a page between ``<!-- BEGIN GENERATED: NAME -->`` and
``<!-- END GENERATED: NAME -->``; the prose around it is written by hand and left alone.

- ``metrics`` (docs/metrics.md): every series of the field catalogue (``hfsampler.fields``).
- ``consumers`` (docs/metrics.md): the per-consumer series of shared GPUs
  (``hfsampler.export.consumer_series``).
- ``selfmetrics`` (docs/operating.md): hfsampler's own series (``hfsampler.selfmetrics``).
- ``config`` (docs/configuration.md): every setting, its YAML key, flag and default, and the
  ``remote_write`` endpoint and ``queue_config`` keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

REGENERATE = "python scripts/gen_docs.py"


# -- where the facts live: the only imports of hfsampler in this script ---------------------------


def _nvml_calls() -> ModuleType:
    """The nvml source's table of per-device calls."""
    from hfsampler.sources.nvml import calls

    return calls


def top_level_config_keys() -> tuple[str, ...]:
    """Every top-level key the config file loader accepts."""
    from hfsampler.config.loader import TOP_LEVEL_KEYS

    return tuple(TOP_LEVEL_KEYS)


# -- formatting ----------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    if seconds == 0:
        return "0s"
    for unit, scale in (("h", 3600), ("m", 60), ("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        value = seconds / scale
        if value >= 1 and abs(value - round(value)) < 1e-9:
            return f"{round(value)}{unit}"
    return f"{seconds:g}s"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _value(name: str, value: object) -> str:
    """A default as it would be written in the YAML file."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if name.endswith("_s") and isinstance(value, int | float):
        return _duration(float(value))
    if name.endswith("_bytes") and isinstance(value, int):
        return _size(value)
    if isinstance(value, dict | tuple | list) and not value:
        return "empty"
    if isinstance(value, dict):
        items = ", ".join(
            f"{k}: {_duration(v) if name.endswith('_s') or 'interval' in name else v}"
            for k, v in value.items()
        )
        return "{" + items + "}"
    if value == "":
        return "`''`"
    return str(value)


def _default(f: dataclasses.Field[Any]) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


# -- the metrics reference -----------------------------------------------------------------------


def _nvml_call_names(key: str) -> list[str]:
    """The NVML functions behind one of the nvml source's per-device calls, first choice first."""
    calls = _nvml_calls()
    spec = getattr(calls, "CALL_FIELDS", {}).get(key)
    reader = getattr(spec, "reader", key)
    out: list[str] = []
    for fn in getattr(calls, "READERS", {}).get(reader, ()):
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        for name, arg in re.findall(r"pynvml\.(nvml[A-Z]\w+)\(h(?:, pynvml\.(NVML_\w+))?", source):
            call = f"{name}({arg})" if arg else name
            if call not in out:
                out.append(call)
    return out


def _nvml_source(f: Any) -> str:
    if f.counted:
        counted = ", ".join(f"`{r}`" for r in f.requires)
        span = "since start" if f.counted.endswith("_total") else "over a trailing window"
        return f"counted from {counted} {span} ([how](dcgm-exporter-parity.md))"
    parts = []
    if f.nvml_field:
        parts.append(f"field `{f.nvml_field}`")
    if f.gpm_metric:
        parts.append(f"GPM `{f.gpm_metric}`")
    if f.nvml_call == "xid_count":
        parts.append("XID events (`nvmlEventSetWait`), counted per code")
    elif f.nvml_call == "xid":
        parts.append("XID events (`nvmlEventSetWait`), the last code")
    elif f.nvml_call:
        names = _nvml_call_names(f.nvml_call)
        call = " or ".join(f"`{n}`" for n in names) if names else f"call `{f.nvml_call}`"
        parts.append(("else " if f.nvml_field else "") + call)
    if f.nvml_rate:
        parts.append("rate per second between samples")
    if f.dcgm_field is not None:
        parts.append(f"DCGM field {f.dcgm_field} (`--source dcgm`)")
    return "; ".join(parts) if parts else "none"


def _dcgm_exporter(f: Any) -> str:
    if f.per == "link" and f.nvml_field and "{link}" in f.nvml_field:
        old = f.nvml_field.replace("NVML_", "DCGM_", 1).replace("{link}", "<N>")
        return f'`{old}` is `{f.name}{{link="<N>"}}`'
    if f.per == "link":
        return "none exactly (DCGM's `DCGM_FI_PROF_NVLINK_L<N>_*_BYTES` count headers too)"
    if f.name.startswith("DCGM_"):
        return "same name"
    return "none (hfsampler's own)"


def metrics_reference() -> str:
    from hfsampler import fields as catalogue
    from hfsampler.export.metrics import HISTOGRAM_SUFFIX

    out = []
    gauge_note = "`_min`, `_max`, `_p99`"
    rows = []
    for f in catalogue.CATALOGUE:
        label = "xid" if f.nvml_call == "xid_count" else f.per
        if f.counted:
            label = "xid" if f.counted.startswith("xid") else "clock_event"
        series = f"`{f.name}`" + (f" (label `{label}`)" if label else "")
        if f.kind is catalogue.Kind.GAUGE:
            series += f" and {gauge_note}"
        kind = f.kind.value if f.kind.value == f.prometheus_type else f"{f.kind.value} (gauge)"
        jetson = "[yes](jetson.md#what-is-measured)" if f.jetson else "no"
        default = "opt-in" if f.opt_in else "on"
        rows.append(
            (
                series,
                kind,
                f.unit,
                f.group,
                _nvml_source(f),
                jetson,
                _dcgm_exporter(f),
                default,
            )
        )
    out += _table(
        ("series", "kind", "unit", "group", "NVML source", "Jetson", "dcgm-exporter", "default"),
        rows,
    )
    out.append("")
    out.append(f"{len(catalogue.CATALOGUE)} fields; every one's help text:")
    out.append("")
    out += [f"- `{f.name}`: {f.help}" for f in catalogue.CATALOGUE]
    out.append("")
    codes = ", ".join(catalogue.XID_LABELS)
    out.append(f"`hfsampler_xid_events_total` has a series from the start for `xid` = {codes}.")
    out.append("")
    out.append(
        f"Every gauge named in `histograms:` also has `<name>{HISTOGRAM_SUFFIX}`, a native "
        "histogram of its every distinct sample ([above](#native-histograms)): on the protobuf "
        "/metrics page and in Remote-Write, never on the text page."
    )
    return "\n".join(out)


def consumers_reference() -> str:
    from hfsampler.export import consumer_series as cs

    rows = [(f"`{name}`", type_, help_text) for name, help_text, type_ in cs.FAMILIES]
    return "\n".join(_table(("series", "type", "meaning"), rows))


def selfmetrics_reference() -> str:
    from hfsampler import selfmetrics

    rows = [(f"`{d.name}`", d.type, d.help) for d in selfmetrics.ALL]
    return "\n".join(_table(("series", "type", "meaning"), rows))


# -- the configuration reference -----------------------------------------------------------------


def config_reference() -> str:
    """Every key, from the config declarations (hfsampler/config/keys.py and the remote_write
    key sets): the one place a key is spelled."""
    from hfsampler.config.reference import reference_markdown

    return reference_markdown().rstrip("\n")


# -- the pages -----------------------------------------------------------------------------------

PARTS: dict[str, tuple[str, Callable[[], str]]] = {
    "metrics": ("docs/metrics.md", metrics_reference),
    "consumers": ("docs/metrics.md", consumers_reference),
    "selfmetrics": ("docs/operating.md", selfmetrics_reference),
    "config": ("docs/configuration.md", config_reference),
}


def _splice(text: str, name: str, body: str, path: str) -> str:
    begin, end = f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"{path}: needs one {begin} and one {end}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    note = f"<!-- generated by {REGENERATE}; edit the code, not this part -->"
    return f"{head}{begin}\n{note}\n\n{body}\n\n{end}{tail}"


def render(root: Path = ROOT) -> dict[Path, str]:
    """Every page with generated parts, as it should read now."""
    pages: dict[Path, str] = {}
    for name, (rel, make) in PARTS.items():
        path = root / rel
        text = pages.get(path) or path.read_text(encoding="utf-8")
        pages[path] = _splice(text, name, make(), rel)
    return pages


def stale(root: Path = ROOT) -> list[Path]:
    """The pages whose committed generated parts differ from what the code gives now."""
    return [p for p, text in render(root).items() if p.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a part is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for p in old:
            print(f"{p.relative_to(ROOT)}: generated reference is stale", file=sys.stderr)
        if old:
            print(f"run `{REGENERATE}` and commit the result", file=sys.stderr)
            return 1
        return 0
    for path, text in render().items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

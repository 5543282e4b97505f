"""The `report` command: its flags, and a report (or a comparison) of recordings."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hfsampler.errors import why_not_writable
from hfsampler.profiling.report import ReportInputError, open_recording, render_html
from hfsampler.profiling.report_processes import processes_json
from hfsampler.profiling.summary import summarize
from hfsampler.profiling.tables import summary_dict


def check_output(out: Path) -> None:
    """Before the long pass: a ``ReportInputError`` unless ``out`` can be written."""
    if out.is_dir():
        raise ReportInputError(f"-o {out}: is a directory (give a file name, e.g. {out}/run.html)")
    parent = out.parent
    if not parent.is_dir():
        raise ReportInputError(f"-o {out}: no directory {parent} (create it, or write elsewhere)")
    if why := why_not_writable(out if out.exists() else parent):
        raise ReportInputError(f"-o {out}: {why} (write elsewhere)")


def _write(out: Path, text: str) -> None:
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ReportInputError(f"-o {out}: cannot write it: {exc.strerror or exc}") from None


def _print(text: str) -> None:
    """To stdout; a closed pipe (``| head``) is a one-line error, not a traceback."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # later flushes at exit would fail again: point stdout at nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise ReportInputError("stdout was closed before the report was written") from None


def register(sub: Any) -> dict[str, Any]:
    p = sub.add_parser("report", help="turn a recording into an HTML page or a JSON summary; "
                       "two recordings: compare them")  # fmt: skip
    p.add_argument("recordings", nargs="+", metavar="RUN.hfs",
                   help="one recording, or two to compare (BASE.hfs NEW.hfs)")  # fmt: skip
    p.add_argument("-o", "--output", metavar="FILE", help="default: RUN.html (json: stdout)")
    p.add_argument("--format", choices=("html", "json"), default="html")
    return {"report": cmd_report}


def cmd_report(args: argparse.Namespace) -> int:
    try:
        return _report(args)
    except ReportInputError as exc:
        print(f"hfsampler: error: {exc}", file=sys.stderr)
        return 2


def _report(args: argparse.Namespace) -> int:
    paths: list[str] = args.recordings
    if len(paths) > 2:
        raise ReportInputError(f"report takes one recording, or two to compare (BASE.hfs "
                               f"NEW.hfs); got {len(paths)}")  # fmt: skip
    recs = [open_recording(p) for p in paths]
    default = (Path(paths[1]).with_name(f"{Path(paths[0]).stem}-vs-{Path(paths[1]).stem}.html")
               if len(paths) == 2 else Path(paths[0]).with_suffix(".html"))  # fmt: skip
    out = Path(args.output) if args.output else None if args.format == "json" else default
    if out is not None:
        check_output(out)
    for rec in recs:  # on the terminal, whatever the format: a page is read later, if ever
        if rec.problem is not None:
            print(f"hfsampler: note: {rec.path}: {rec.problem}; the report covers what was "
                  "readable", file=sys.stderr)  # fmt: skip
    summaries = [summarize(rec) for rec in recs]
    if len(summaries) == 2:
        from hfsampler.profiling.compare import compare_dict, compare_html

        data: dict[str, Any] = compare_dict(*summaries)
    else:
        data = summary_dict(summaries[0])
        data["processes"] = processes_json(recs[0])
    if args.format == "json":
        text = json.dumps(data, indent=2)
        if out is not None:
            _write(out, text + "\n")
        else:
            _print(text)
        return 0
    assert out is not None  # html always has a file
    text = compare_html(*summaries) if len(summaries) == 2 else render_html(summaries[0])
    _write(out, text)
    print(f"wrote {out}", file=sys.stderr)
    return 0

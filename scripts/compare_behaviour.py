"""Behaviour unchanged: two revisions driven on the sim alike, their outputs compared byte for byte.

    python scripts/compare_behaviour.py [OLD_REV] [NEW_REV]     (defaults: ee5579b HEAD)

Each revision is exported (``git archive``) into a temporary folder, or, for ``WORKTREE``, is the
working tree this script is in; ``scripts/behaviour_driver.py`` (this tree's, the same driver for
both) then runs once per revision in a subprocess with ``PYTHONPATH`` at that tree, the same
Python, ``PYTHONHASHSEED=0`` and ``TZ=UTC``, writing its artifacts (/metrics text, decoded
Remote-Write requests, a recording, its report, its replays) to a temporary folder. Both run at
once. The artifacts are compared byte for byte and shown as a table; ``info`` rows (each
request's uncompressed bytes) are shown but never fail. Exit 0 when every required artifact is
identical; else 1, with a unified diff of the first that differs (a recording: the chunk where
the bytes part). ``--keep DIR`` keeps both sets of outputs, each with the driver's log
(``old.log``) and ``ENTRY_POINTS.txt``, the module each entry point was found in.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
DRIVER = SCRIPTS / "behaviour_driver.py"
WORKTREE = "WORKTREE"  # as a revision: the working tree, uncommitted changes included
DEFAULT_OLD = "ee5579b"  # the last commit before the packages by stage
MANIFEST = "MANIFEST"
DIFF_LINES = 80


def repo_root() -> Path:
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=SCRIPTS, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return Path(out.stdout.strip())


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` in ``into`` (the working tree itself for ``WORKTREE``)."""
    root = repo_root()
    if rev == WORKTREE:
        return root
    into.mkdir(parents=True)
    with subprocess.Popen(["git", "archive", "--format=tar", rev], cwd=root,
                          stdout=subprocess.PIPE) as git:  # fmt: skip
        assert git.stdout is not None
        with tarfile.open(fileobj=git.stdout, mode="r|") as tar:
            tar.extractall(into, filter="data")
    if git.returncode:
        raise SystemExit(f"git archive {rev} failed ({git.returncode})")
    return into


def start_driver(tree: Path, out: Path, python: str, quick: bool) -> subprocess.Popen[bytes]:
    """The driver on ``tree``, writing to ``out``; its output goes to ``out``.log."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "TZ": "UTC"}
    argv = [python, str(DRIVER), str(out), "--tree", str(tree), *(["--quick"] if quick else [])]
    with open(f"{out}.log", "wb") as log:  # the child has its own descriptor
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_drivers(trees: Sequence[Path], outs: Sequence[Path], python: str, quick: bool) -> None:
    """Every driver at once; a failure is said with the end of its log."""
    runs = [start_driver(t, o, python, quick) for t, o in zip(trees, outs, strict=True)]
    failed = []
    for run, out in zip(runs, outs, strict=True):
        if run.wait():
            tail = Path(f"{out}.log").read_text(errors="replace")[-4000:]
            failed.append(f"the driver on {out.name} exited {run.returncode}:\n{tail}")
    if failed:
        raise SystemExit("\n".join(failed))


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    required: bool
    old: str  # sha256, or "-" where that side has no such artifact
    new: str

    @property
    def identical(self) -> bool:
        return self.old == self.new and self.old != "-"


def _manifest(out: Path) -> dict[str, bool]:
    rows = (line.split("\t") for line in (out / MANIFEST).read_text().splitlines())
    return {name: kind == "required" for name, kind in rows}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "-"


def compare(old: Path, new: Path) -> list[Row]:
    """One row per artifact either side made, in the order the drivers made them."""
    a, b = _manifest(old), _manifest(new)
    names = list(dict.fromkeys([*b, *a]))
    return [Row(n, a.get(n, True) or b.get(n, True), _sha256(old / n), _sha256(new / n))
            for n in names]  # fmt: skip


def table(rows: Sequence[Row], old_rev: str, new_rev: str) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'artifact':<{width}}  {old_rev[:16]:<16}  {new_rev[:16]:<16}  identical?"]
    for r in rows:
        same = "yes" if r.identical else "NO" if r.required else "no (info)"
        lines.append(f"{r.name:<{width}}  {r.old[:16]:<16}  {r.new[:16]:<16}  {same}")
    return "\n".join(lines)


def explain(name: str, old: Path, new: Path) -> str:
    """Where artifact ``name`` first differs: a unified diff, or for a recording its chunk."""
    a, b = old / name, new / name
    if not a.exists() or not b.exists():
        return f"{name}: made on one side only ({a if a.exists() else b})"
    if name.endswith(".hfs"):
        return _explain_recording(name, a.read_bytes(), b.read_bytes())
    before, after = a.read_text().splitlines(), b.read_text().splitlines()
    text = list(difflib.unified_diff(before, after, f"old/{name}", f"new/{name}", lineterm=""))
    shown = "\n".join(text[:DIFF_LINES])
    more = f"\n... {len(text) - DIFF_LINES} more diff lines" if len(text) > DIFF_LINES else ""
    where = _first_json_difference(a, b) if name.endswith(".json") else ""
    return f"{where}{shown}{more}"


def _first_json_difference(a: Path, b: Path) -> str:
    """The path of the first value (a decoded sample, a label set) that differs, as a line."""

    def walk(x: Any, y: Any, path: str) -> str | None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in dict.fromkeys([*x, *y]):
                found = walk(x.get(k), y.get(k), f"{path}.{k}")
                if found:
                    return found
            return None
        if isinstance(x, list) and isinstance(y, list):
            for i in range(max(len(x), len(y))):
                found = walk(x[i] if i < len(x) else None, y[i] if i < len(y) else None,
                             f"{path}[{i}]")  # fmt: skip
                if found:
                    return found
            return None
        return None if x == y else f"first difference at {path}: {x!r} -> {y!r}\n"

    return walk(json.loads(a.read_text()), json.loads(b.read_text()), "$") or ""


def _explain_recording(name: str, a: bytes, b: bytes) -> str:
    """The first differing byte of two recordings and the chunk (tag, index) it falls in."""
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    pos, index, tag = 8, 0, b"MAGIC"  # 8 magic bytes, then frames: tag, length, CRC-32, payload
    while pos + 12 <= len(a) and at >= pos:
        tag, length, _ = struct.unpack_from("<4sII", a, pos)
        if at < pos + 12 + length:
            break
        pos += 12 + length
        index += 1
    return (f"{name}: {len(a)} bytes -> {len(b)} bytes; first difference at byte {at}, in chunk "
            f"{index} ({tag.decode(errors='replace')})")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "old", nargs="?", default=DEFAULT_OLD, help="a revision (default %(default)s)"
    )
    parser.add_argument("new", nargs="?", default="HEAD",
                        help=f"a revision, or {WORKTREE} (default %(default)s)")  # fmt: skip
    parser.add_argument("--python", default=sys.executable, help="the interpreter of both runs")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep both outputs in DIR")
    parser.add_argument("--quick", action="store_true", help="one scenario, fewer windows")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hfs-behaviour-"))
    try:
        trees = [export(args.old, work / "old-tree"), export(args.new, work / "new-tree")]
        base = args.keep.resolve() if args.keep else work
        outs = [base / "old", base / "new"]
        base.mkdir(parents=True, exist_ok=True)
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)
        run_drivers(trees, outs, args.python, args.quick)
        rows = compare(*outs)
        print(table(rows, args.old, args.new))
        differing = [r for r in rows if r.required and not r.identical]
        if not differing:
            print(f"identical: all {sum(r.required for r in rows)} required artifacts")
            return 0
        print(f"\n{len(differing)} artifact(s) differ; the first:\n")
        print(explain(differing[0].name, *outs))
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

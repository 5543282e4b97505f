"""One choke point for NVML: ``hfsampler.sources.nvml.calls`` is the only module importing pynvml.

Read from the source text (an AST scan), so an import inside a function counts as well, and so
does ``benchmarks/``, whose GPU check must meet the same pynvml as the source it measures.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = Path("hfsampler/sources/nvml/calls.py")


def _imports_pynvml(tree: ast.AST) -> list[int]:
    """Lines that import pynvml: ``import pynvml[.x] [as y]``, ``from pynvml import ...``, or
    ``importlib.import_module("pynvml")`` / ``__import__("pynvml")``."""
    lines = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            first = node.args[0]
            if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
                names = [str(first.value)]
        if any(n == "pynvml" or n.startswith("pynvml.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_nvml_calls_imports_pynvml() -> None:
    files = sorted([*ROOT.glob("hfsampler/**/*.py"), *ROOT.glob("benchmarks/**/*.py")])
    assert ROOT / OWNER in files
    offenders = {}
    for path in files:
        rel = path.relative_to(ROOT)
        lines = _imports_pynvml(ast.parse(path.read_text(), str(rel)))
        if rel == OWNER:
            assert lines, f"{OWNER} is the module that imports pynvml"
        elif lines:
            offenders[str(rel)] = lines
    assert offenders == {}, f"import pynvml through {OWNER}, not directly: {offenders}"


def test_the_scan_sees_every_way_of_importing() -> None:
    source = (
        "import os\nimport pynvml\nimport pynvml as nv\nfrom pynvml import nvmlInit\n"
        "def f():\n    import importlib\n    return importlib.import_module('pynvml')\n"
        "from hfsampler.sources.nvml import calls\n"
    )
    assert _imports_pynvml(ast.parse(source)) == [2, 3, 4, 7]

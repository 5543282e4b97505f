"""The import graph of hfsampler/: every import, at module level or inside a function, resolved
to the module it loads; fails (exit 1) on a cycle, on a leaf that imports a stage, on a loose
top-level module that is not a leaf, and on a cycle between the stage packages.

    python scripts/import_graph.py            # check, and print the package-level graph
    python scripts/import_graph.py --dot      # the module graph in Graphviz's dot format

Generated protobuf modules (``*_pb2``) are left out: they import only protobuf.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hfsampler"
# The loose top-level modules: leaves, which every stage may read and which read no stage.
LEAVES = {
    "fields",
    "series",
    "errors",
    "durations",
    "logs",
    "selfmetrics",
    "markers",
    "histograms",
}
# Entry points and the package's own __init__ sit at the top too.
ENTRY = {"__init__", "__main__"}
STAGES = (
    "config",
    "consumers",
    "sources",
    "sampling",
    "remote_write",
    "export",
    "profiling",
    "monitor",
    "cli",
)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        if path.name.endswith("_pb2.py"):
            continue
        found[module_name(path)] = path
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every hfsampler module ``path`` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    out.add(_nearest(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else _nearest(base, known))
    out.discard(name)
    return out


def _nearest(dotted: str, known: set[str]) -> str:
    parts = dotted.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES) else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def check(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for component in cycles(graph):
        problems.append("import cycle: " + " <-> ".join(component))
    for module, deps in sorted(graph.items()):
        parts = module.split(".")
        if len(parts) == 2 and parts[1] not in STAGES:
            if parts[1] not in LEAVES | ENTRY:
                problems.append(f"{module}: a loose top-level module that is not a leaf")
            elif parts[1] in LEAVES:
                for dep in sorted(deps):
                    if stage_of(dep):
                        problems.append(f"leaf {module} imports the stage module {dep}")
    stage_graph = package_graph(graph)
    for component in cycles(stage_graph):
        problems.append("cycle between stage packages: " + " <-> ".join(component))
    return problems


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {s: set() for s in STAGES}
    for module, deps in graph.items():
        src = stage_of(module)
        if src is None:
            continue
        for dep in deps:
            dst = stage_of(dep)
            if dst is not None and dst != src:
                out[src].add(dst)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot", action="store_true", help="print the module graph as dot")
    args = parser.parse_args(argv)
    found = modules()
    known = set(found)
    graph = {name: imports_of(path, name, known) for name, path in found.items()}
    if args.dot:
        print("digraph hfsampler {")
        for module, deps in sorted(graph.items()):
            for dep in sorted(deps):
                print(f'  "{module}" -> "{dep}";')
        print("}")
        return 0
    for stage, deps in package_graph(graph).items():
        print(f"{stage:>12} -> {', '.join(sorted(deps)) or '(leaves only)'}")
    problems = check(graph)
    for problem in problems:
        print(problem, file=sys.stderr)
    edges = sum(len(d) for d in graph.values())
    print(f"{len(graph)} modules, {edges} imports, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The manual holds together: links resolve, every field and config key is named, the generated
references match the code, and the README stays a landing page."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hfsampler import fields as catalogue

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 160

_FENCE_RE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _gen_docs() -> ModuleType:
    name = "gen_docs"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "gen_docs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _prose(path: Path) -> str:
    """The page without its code blocks (a link-like text in code is not a link)."""
    return _FENCE_RE.sub("", path.read_text(encoding="utf-8"))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        base = _anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))


def test_anchor_rule() -> None:
    assert _anchor("How fast to sample: `hfsampler probe`") == "how-fast-to-sample-hfsampler-probe"
    assert _anchor("Keep only the `_max` series for one endpoint") == (
        "keep-only-the-max-series-for-one-endpoint"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _LINK_RE.findall(_prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(dict.fromkeys(broken))


def test_every_catalogue_field_is_named_in_docs() -> None:
    text = _docs_text()
    missing = [f.name for f in catalogue.CATALOGUE if f.name not in text]
    assert not missing, f"fields named nowhere in docs/: {missing}"


def test_every_top_level_config_key_is_named_in_docs() -> None:
    text = _docs_text()
    keys = _gen_docs().top_level_config_keys()
    assert keys
    missing = [k for k in keys if not re.search(rf"`{re.escape(k)}[`:.]", text)]
    assert not missing, f"config keys named nowhere in docs/: {missing}"


def test_generated_references_are_current() -> None:
    gen = _gen_docs()
    stale = gen.stale()
    names = ", ".join(p.relative_to(ROOT).as_posix() for p in stale)
    assert not stale, f"stale generated reference in {names}: run `{gen.REGENERATE}` and commit"


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def _reading_guide(page: Path, prefix: str) -> list[tuple[str, str]]:
    """The "you want to | read" rows of a page: what the reader wants, and the page named."""
    row = re.compile(r"^\| ([^|]+?) \| \[[^\]]+\]\(" + re.escape(prefix) + r"([a-z-]+\.md)\) \|$")
    return [m.groups() for line in page.read_text().splitlines() if (m := row.match(line))]


def test_the_manual_s_index_is_the_readme_s_guide() -> None:
    """docs/README.md (what a reader browsing docs/ lands on) lists what the README's "Where to
    read on" lists, row for row: one guide, in two places, never drifting apart."""
    guide = _reading_guide(ROOT / "README.md", "docs/")
    assert len(guide) >= 10
    assert _reading_guide(DOCS / "README.md", "") == guide
    assert {page for _, page in guide} >= {p.name for p in DOCS.glob("*.md")} - {"README.md"}

"""The README's quick start is what CI runs: the two must not drift apart."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _shell_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    found = re.search(r'^TEST_COMMAND="(.+)"$', ci, re.M)
    assert found, ".ci/run names its TEST_COMMAND"
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = _shell_blocks(quick_start)
    assert len(blocks) == 2, "the quick start is exactly two commands"
    assert blocks[1] == found.group(1)
    assert "pytest" in blocks[1]


def test_quick_start_installs_and_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first = _shell_blocks(quick_start)[0]
    assert "pip install ." in first
    assert first.endswith("hfsampler run")

"""``scripts/compare_behaviour.py`` cannot rot silently: its driver, run twice on this tree, makes
identical artifacts (a driver that read a clock, a port or a random number would not), and the
comparison finds and shows a changed one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_driver_twice_on_one_tree_makes_identical_artifacts(tmp_path: Path) -> None:
    compare = _script("compare_behaviour")
    outs = [tmp_path / "a", tmp_path / "b"]
    compare.run_drivers([ROOT, ROOT], outs, sys.executable, quick=True)
    rows = compare.compare(*outs)
    names = {r.name for r in rows}
    assert {"sim2.metrics.txt", "sim2.rw1.json", "sim2.rw2.json", "recording.hfs", "report.json",
            "replay.json", "replay_raw.json"} <= names  # fmt: skip
    assert [r.name for r in rows if not r.identical] == []

    metrics = outs[1] / "sim2.metrics.txt"
    metrics.write_text(metrics.read_text().replace('gpu="1"', 'gpu="9"', 1))
    recording = outs[1] / "recording.hfs"
    data = bytearray(recording.read_bytes())
    data[-1] ^= 0xFF  # inside the last chunk's payload
    recording.write_bytes(bytes(data))
    assert [r.name for r in compare.compare(*outs) if not r.identical] == [
        "sim2.metrics.txt",
        "recording.hfs",
    ]
    shown = compare.explain("sim2.metrics.txt", *outs)
    assert '+DCGM_FI_DEV_CLOCKS_EVENT_REASONS{DCGM_FI_DRIVER_VERSION="sim-1.0"' in shown
    assert 'gpu="9"' in shown
    assert f"first difference at byte {len(data) - 1}" in compare.explain("recording.hfs", *outs)

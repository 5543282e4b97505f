"""`hfsampler report`'s mistakes are one line and exit 2: an unreadable input, an output that
cannot be written (found before the long pass), a closed stdout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sim_recordings import synthesize

from hfsampler.cli import report
from hfsampler.cli.main import main
from hfsampler.profiling import report as report_library

REPO = Path(__file__).resolve().parents[2]
S = 1_700_000_000 * 10**9


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("errors") / "run.hfs"
    synthesize(path, 1, 2, True, start_ns=S)
    return path


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("hfsampler: error: ")
    assert err.count("Errno") == 0
    return err


@pytest.mark.parametrize("case", ["a directory", "no such directory"])
def test_unwritable_output_fails_before_the_pass(
    recording: Path,
    tmp_path: Path,
    case: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_pass(*_: object) -> None:
        raise AssertionError("the output should have been checked before the pass")

    monkeypatch.setattr(report, "summarize", no_pass)
    out = {"a directory": tmp_path, "no such directory": tmp_path / "gone" / "r.html"}[case]
    for fmt in ("html", "json"):
        assert main(["report", str(recording), "--format", fmt, "-o", str(out)]) == 2
        err = one_line_error(capsys)
        assert {"a directory": "is a directory", "no such directory": "no directory"}[case] in err


def test_unreadable_input_is_one_line(recording: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    def denied(path: str) -> None:  # as open() says it to a user without read permission
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(report_library, "Recording", denied)
    assert main(["report", str(recording)]) == 2
    err = one_line_error(capsys)
    assert f"{recording}: cannot read it: Permission denied" in err


def test_closed_stdout_is_one_line(recording: Path) -> None:
    """A real process whose stdout is a pipe closed by its reader: the exit status and stderr a
    shell sees."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-m", "hfsampler", "report", str(recording),
                              "--format", "json"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None
    assert child.stderr is not None
    child.stdout.close()  # the reader went away (`| head` that has read enough)
    with child.stderr:
        err = child.stderr.read()
    assert child.wait(timeout=60) == 2
    assert err.strip().splitlines() == ["hfsampler: error: stdout was closed before the report "
                                        "was written"]  # fmt: skip

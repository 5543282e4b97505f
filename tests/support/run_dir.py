"""The test run's shared directory: where xdist's workers meet (the timing tests' barrier in
tests/conftest.py) and where a product several modules' fixtures need is made once per run."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

# Set by the controller (tests/conftest.py) before it starts the workers, who inherit it.
RUN_DIR_VARIABLE = "HFSAMPLER_TEST_RUN_DIR"


def run_dir() -> Path | None:
    where = os.environ.get(RUN_DIR_VARIABLE)
    return Path(where) if where else None


def made_once(
    name: str, tmp_path_factory: pytest.TempPathFactory, make: Callable[[Path], None]
) -> Path:
    """The directory ``make`` filled, made by whichever worker asks first; the others wait.

    A module whose timing test runs in the timing unit while its other tests run elsewhere would
    otherwise make its module fixture twice, the second time on a busy machine.
    """
    shared = run_dir()
    if shared is None:  # one process: a module fixture is made once anyway
        where = tmp_path_factory.mktemp(name)
        make(where)
        return where
    where = shared / "once" / name
    where.parent.mkdir(exist_ok=True)
    with (where.parent / f"{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = where.parent / f"{name}.made"
        if not made.exists():
            shutil.rmtree(where, ignore_errors=True)  # a failed attempt's leftovers
            where.mkdir()
            make(where)
            made.touch()
    return where

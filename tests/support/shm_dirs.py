"""Shared-memory directories that refuse: a 1 MiB tmpfs and a read-only one, for tests.

hfsampler makes its blocks in ``$HFSAMPLER_SHM_DIR`` when it is set (tests only), so a test can
give it a directory like the 64 MiB ``/dev/shm`` of a pod, or a read-only one, without touching
the machine's own ``/dev/shm``. Mounting a tmpfs needs root (CI runs as root); elsewhere the
tests that need one are skipped, saying why.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hfsampler.sampling.ring import SHM_DIR_ENV

SMALL_BYTES = 1 << 20


def _mount_tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 1 MiB tmpfs that hfsampler (and every process it starts) takes for /dev/shm."""
    for path in _mount_tmpfs(tmp_path / "shm", f"size={SMALL_BYTES},mode=1777"):
        monkeypatch.setenv(SHM_DIR_ENV, str(path))
        yield path


@pytest.fixture
def readonly_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A read-only tmpfs that hfsampler takes for /dev/shm."""
    for path in _mount_tmpfs(tmp_path / "shm", "ro,size=1m"):
        monkeypatch.setenv(SHM_DIR_ENV, str(path))
        yield path


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A plain directory that hfsampler takes for /dev/shm: room enough, and private to the test."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(path))
    return path

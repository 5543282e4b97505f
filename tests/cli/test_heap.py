"""The long-running commands' heap setting: large frees go back to the system (glibc)."""

from __future__ import annotations

import platform

import pytest

from hfsampler.cli import heap


def test_glibc_takes_the_fixed_thresholds() -> None:
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt's thresholds are glibc's")
    assert heap.return_large_frees()
    assert heap.return_large_frees(heap.LARGE_BYTES * 2)  # and again, at another size

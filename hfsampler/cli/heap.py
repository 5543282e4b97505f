"""The heap of a long-running command: large blocks it frees go back to the system at once.

A window's rows, encoded requests and /metrics pages are blocks of hundreds of kB made and freed
every window. glibc raises its mmap threshold after the first such free (up to 32 MB), so the
next ones come from the heap, whose freed space stays resident: the parent kept about 5 MB more
than it used at 8 sim GPUs (``benchmarks/steady.py``). A fixed threshold keeps large blocks
mapped on their own and unmapped when freed, at the cost of a map and unmap per block (a few µs,
a few times a window).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGE_BYTES = 128 * 1024  # glibc's own starting threshold, kept fixed


def return_large_frees(threshold_bytes: int = LARGE_BYTES) -> bool:
    """Blocks of ``threshold_bytes`` or more mapped apart and the heap's freed top trimmed past
    it; True where the C library took it (glibc), False elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    with contextlib.suppress(OSError, AttributeError):
        mallopt = ctypes.CDLL(name).mallopt
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        mallopt.restype = ctypes.c_int
        mapped: int = mallopt(_M_MMAP_THRESHOLD, threshold_bytes)
        trimmed: int = mallopt(_M_TRIM_THRESHOLD, threshold_bytes)
        return mapped == 1 and trimmed == 1
    return False

"""Fake of DCGM's ``dcgm_structs`` module: the constants and error class hfsampler uses."""

from __future__ import annotations

DCGM_OPERATION_MODE_AUTO = 1
DCGM_GROUP_EMPTY = 1


class DCGMError(Exception):
    """DCGM's base error (the real one carries a return code)."""

    def __init__(self, value: int = -1) -> None:
        super().__init__(f"DCGM error {value}")
        self.value = value

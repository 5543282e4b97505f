"""hfsampler: millisecond NVIDIA GPU sampling, window statistics, Prometheus Remote-Write push."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfsampler.monitor.measurement import Measurement
    from hfsampler.monitor.monitor import Monitor

__version__ = "0.1.0"
__all__ = ["Measurement", "Monitor", "__version__"]


def __getattr__(name: str) -> Any:
    """``Monitor`` and ``Measurement`` on first use: ``import hfsampler`` (and
    ``from hfsampler import markers``, in every training script) stays free of numpy and the
    sampler."""
    if name == "Monitor":
        from hfsampler.monitor.monitor import Monitor

        return Monitor
    if name == "Measurement":
        from hfsampler.monitor.measurement import Measurement

        return Measurement
    raise AttributeError(f"module 'hfsampler' has no attribute {name!r}")

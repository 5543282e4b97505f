"""hfsampler: millisecond NVIDIA GPU sampling, window statistics, Prometheus Remote-Write push."""

__version__ = "0.1.0"

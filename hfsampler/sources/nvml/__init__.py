"""The NVML source: ``calls`` is the only importer of ``pynvml``; the rest reads through it."""

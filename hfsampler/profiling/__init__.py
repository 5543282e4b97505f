"""Profiling a job: the recording file, ``record``, the report, the comparison, ``replay``."""

"""The service: wires the sampling pipeline to its sinks (/metrics, remote-write endpoints)."""

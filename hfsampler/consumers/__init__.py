"""Consumers of a shared GPU: who a GPU process belongs to (a Slurm job, a Kubernetes container,
a systemd unit, a user's command), the names the container runtime gives them, and each window's
GPU energy split among them by their share of the SMs.

``identity`` is the consumer and its labels; ``procfs`` finds a process's consumer from the host's
procfs; ``cri`` asks the container runtime for pod and container names; ``split`` divides a
window's energy. Nothing here reads NVML: the process lists and utilisation samples come in as
plain numbers, so the same code serves ``run`` and ``record``.
"""

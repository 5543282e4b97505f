"""The consumer keys' values (``consumers``, ``procfs``, ``container_runtime_socket`` and the
``consumers.*`` block): parsed and checked here, declared on ``Config`` like every key.

``consumers`` is ``auto`` (on where the source lists GPU processes: NVML; off for the sim, whose
consumers are a demonstration, and for Jetson and DCGM, which list none), ``true`` or ``false``.
The same key is ``consumers.enabled`` inside the block, so ``consumers: false`` and ``consumers:
{enabled: false, max_per_gpu: 8}`` both say it.
"""

from __future__ import annotations

import os

from hfsampler.consumers.cri import ALLOWLIST_KEY, allowlist
from hfsampler.errors import ConfigError

CONSUMERS_KEY = "consumers"
MODES = ("auto", "on", "off")
MAX_PER_GPU_KEY = "consumers.max_per_gpu"
MAX_PER_GPU_LIMIT = 1024  # a GPU's series per consumer times this: beyond, a label set explodes
# the sources whose processes NVML lists, so `auto` reads them there
LISTING_SOURCES = ("nvml",)


def as_mode(value: object, key: str, example: str) -> str:
    """``auto``, or a YAML boolean (``true``/``false``) as ``on``/``off``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.lower() in (*MODES, "true", "false"):
        text = value.lower()
        return {"true": "on", "false": "off"}.get(text, text)
    raise ConfigError(key, f"expected auto, true or false, got {value!r}", f"e.g. {key}: auto")


def mode_flag(value: str, name: str) -> str:
    return as_mode(value, name, "auto")


def check(mode: str, procfs: str, socket: str | None, max_per_gpu: int, allow: str | None) -> None:
    """Every consumer key at load time, each mistake naming its key and the fix."""
    if mode not in MODES:
        raise ConfigError(CONSUMERS_KEY, f"unknown mode {mode!r}", "auto, true or false")
    if not procfs.startswith("/"):
        raise ConfigError(
            "procfs", f"{procfs!r} is not an absolute path", "e.g. /proc, or /host/proc in a pod"
        )
    if os.path.exists(procfs) and not os.path.isdir(procfs):  # missing: not mounted here yet
        raise ConfigError(
            "procfs", f"{procfs!r} is not a directory", "e.g. /proc, or /host/proc in a pod"
        )
    if socket is not None and not socket.startswith("/"):
        raise ConfigError(
            "container_runtime_socket",
            f"{socket!r} is not an absolute path",
            "e.g. /run/containerd/containerd.sock",
        )
    if isinstance(max_per_gpu, bool) or not 1 <= max_per_gpu <= MAX_PER_GPU_LIMIT:
        raise ConfigError(
            MAX_PER_GPU_KEY, f"{max_per_gpu!r} is out of range", f"give 1 to {MAX_PER_GPU_LIMIT}"
        )
    allowlist(allow)  # a ConfigError naming consumers.pod_label_allowlist when it is no regex


def warnings(socket: str | None, allow: str | None, virtual_gpus: bool) -> list[str]:
    """Consumer keys accepted that do nothing: pod labels and per-pod series need the pods'
    names, which only the container runtime's socket gives."""
    if socket is not None:
        return []
    out = []
    if allow:
        out.append(f"{ALLOWLIST_KEY} is not used: container_runtime_socket is not set, so no "
                   "pod's labels are known")  # fmt: skip
    if virtual_gpus:
        out.append("consumers.dcgm_exporter_virtual_gpus is not used: container_runtime_socket "
                   "is not set, so no pod is named")  # fmt: skip
    return out


def enabled(mode: str, source_kind: str) -> bool:
    """Whether a run of ``source_kind`` (the resolved source: nvml, sim, ...) reads consumers."""
    if mode == "auto":
        return source_kind in LISTING_SOURCES
    return mode == "on"


__all__ = [
    "ALLOWLIST_KEY", "CONSUMERS_KEY", "MAX_PER_GPU_KEY", "MODES", "as_mode", "check", "warnings"
]  # fmt: skip

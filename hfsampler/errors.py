"""hfsampler's exception tree: every error the package raises on purpose descends from here."""

from __future__ import annotations

import os
from collections.abc import Sequence


class HfsamplerError(Exception):
    """Root of every error hfsampler raises on purpose."""


class ConfigError(HfsamplerError, ValueError):
    """A user's mistake in the config file or flags: names the key and the fix (exit 2)."""

    def __init__(self, key: str, problem: str, fix: str = "") -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        text = f"{key}: {problem}" if key else problem
        if fix:
            text += f" ({fix})"
        super().__init__(text)


def one_error(errors: Sequence[ConfigError]) -> ConfigError:
    """Several mistakes found in one pass as one error, naming each: fixed in one edit."""
    if len(errors) == 1:
        return errors[0]
    return ConfigError("", f"{len(errors)} keys to fix: " + "; ".join(str(e) for e in errors), "")


class QueueDirLockedError(ConfigError):
    """Another process holds the queue directory: one spool, one process (exit 2, one line)."""

    def __init__(self, directory: str, pid: int | None) -> None:
        self.directory = directory
        self.pid = pid
        holder = f"pid {pid}" if pid is not None else "its pid not yet written"
        super().__init__(
            "queue_dir",
            f"{directory} is in use by another hfsampler ({holder})",
            "stop that one first, or give each its own queue_dir",
        )


class SpoolFormatError(ConfigError):
    """A spool segment of a format this version does not read (exit 2, one line)."""

    def __init__(self, path: str, found: str, version: str) -> None:
        self.path = path
        self.found = found
        super().__init__(
            "queue_dir",
            f"{path} is a spool segment of format {found}; this hfsampler reads {version} only",
            "move or delete the file; nothing was released that wrote another format",
        )


class SourceError(HfsamplerError, RuntimeError):
    """A GPU source could not be opened or read."""


class DriverNotFoundError(SourceError):
    """No NVIDIA driver (libnvidia-ml) on this machine."""


class NoPermissionError(SourceError, PermissionError):
    """The NVIDIA driver is there, but this user may not open it."""


class FieldNotSupportedError(SourceError):
    """The device or driver does not provide this field."""


class GpuLostError(SourceError):
    """The device fell off the bus or stopped answering: stop sampling it, keep the others."""


class RemoteWriteError(HfsamplerError):
    """A Remote-Write request failed."""


class RecoverableSendError(RemoteWriteError, ConnectionError):
    """A failure the spec says to retry: network errors, timeouts, 5xx, 429."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ReceiverDownError(RecoverableSendError, ConnectionRefusedError):
    """Nothing listens at the receiver's address (a refused connection): retried at least every
    second, so that delivery resumes within a second of the receiver's return."""


class NonRecoverableSendError(RemoteWriteError, ValueError):
    """The receiver refused the batch (4xx other than 429): never resent as it was.

    ``text`` is the start of the receiver's answer; ``written`` the samples a 2.0 receiver said
    it stored anyway (``X-Prometheus-Remote-Write-Samples-Written``), None when it did not say.
    """

    def __init__(
        self, message: str, status: int, text: str = "", written: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.text = text
        self.written = written


class RequestTooLargeError(NonRecoverableSendError):
    """413: the receiver refused the body's size; the sender splits it rather than drop it."""


class InvalidLabelError(HfsamplerError, ValueError):
    """A label set that Remote-Write receivers would refuse."""


def why_not_writable(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` (an existing file or directory) can be written, else why not in words
    that name the cause: a read-only file system is not a permissions problem."""
    if os.access(path, os.W_OK | os.X_OK if os.path.isdir(path) else os.W_OK):
        return None
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "is on a read-only file system" if read_only else "is not writable (its permissions)"

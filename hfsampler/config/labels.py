"""Label names and values a user gives (``external_labels``, ``--label``): Prometheus's rules,
the names hfsampler sets itself, and the limits of a strict receiver."""

from __future__ import annotations

from hfsampler.errors import ConfigError
from hfsampler.fields import GPU_LABEL_NAMES, MIG_LABEL_NAMES
from hfsampler.series import LABEL_NAME_RE

# Labels hfsampler's own series and attribution add: a host label of one of these names would
# be overwritten, or overwrite them.
RESERVED_LABELS = (
    *GPU_LABEL_NAMES,
    *MIG_LABEL_NAMES,
    "instance",
    "field",
    "group",
    "rail",
    "zone",
    "pod",
    "namespace",
    "container",
    "hpc_job",
    "remote_name",
    "url",
    "reason",
    "status",
)
# Mimir's default limits, which refuse whole series: warn before a run finds out.
MIMIR_MAX_LABEL_NAMES = 30
MIMIR_MAX_LABEL_VALUE_BYTES = 2048


def parse_label(text: str, key: str = "--label") -> tuple[str, str]:
    """``k=v`` → (k, v), with Prometheus's rules for label names."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(key, f"{text!r} is not k=v", "write it as name=value, e.g. cluster=eu1")
    check_label(name, value, key)
    return name, value


def check_label(name: str, value: str, key: str) -> None:
    if not LABEL_NAME_RE.match(name) or name.startswith("__"):
        raise ConfigError(
            key, f"invalid label name {name!r}", "use letters, digits and _, not starting with __"
        )
    if value == "":
        raise ConfigError(key, f"label {name!r} has an empty value", "give it a value or drop it")
    check_utf8(value, key)


def check_utf8(value: str, key: str) -> None:
    """Label values go out as UTF-8: bytes that are not (from argv, say) are refused here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(key, "is not valid UTF-8 text", "use UTF-8 characters only") from None

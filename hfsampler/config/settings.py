"""Configuration: one YAML file plus command-line flags, validated once into a frozen ``Config``.

Every mistake becomes a ``ConfigError`` that names the key and the fix; the CLI prints it on one
line and exits 2. The ``remote_write`` block is parsed by ``hfsampler.remote_write.config`` with
Prometheus's own key names.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from hfsampler import fields as catalogue
from hfsampler.durations import parse_duration, to_ns
from hfsampler.errors import ConfigError
from hfsampler.fields import DEFAULT_INSTANCE_PORT, GPU_LABEL_NAMES, MIG_LABEL_NAMES
from hfsampler.remote_write.config import (
    EndpointConfig,
    QueueConfig,
    check_unique_names,
    endpoint_from_url,
    parse_remote_write,
    parse_size,
)
from hfsampler.series import LABEL_NAME_RE

# The most shared memory the sampler's rings may take unless ``max_ring_bytes`` says otherwise.
DEFAULT_MAX_RING_BYTES = 256 << 20

SOURCES = ("auto", "nvml", "sim", "dcgm", "jetson")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
MIN_INTERVAL_S = 1e-4
# Compared in whole nanoseconds, so that no spelling of 100us falls a float's hair short of it.
_MIN_INTERVAL_NS = to_ns(MIN_INTERVAL_S)
# The slow lane's groups sleep without spinning and share a thread: faster than this, they are
# often late (measured: a 1 ms group there was late on half of its ticks)
SLOW_LANE_MIN_INTERVAL_S = 0.01
MIN_MAX_RING_BYTES = 1 << 20


def parse_label(text: str, key: str = "--label") -> tuple[str, str]:
    """``k=v`` → (k, v), with Prometheus's rules for label names."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(key, f"{text!r} is not k=v", "write it as name=value, e.g. cluster=eu1")
    _check_label(name, value, key)
    return name, value


def _check_label(name: str, value: str, key: str) -> None:
    if not LABEL_NAME_RE.match(name) or name.startswith("__"):
        raise ConfigError(
            key, f"invalid label name {name!r}", "use letters, digits and _, not starting with __"
        )
    if value == "":
        raise ConfigError(key, f"label {name!r} has an empty value", "give it a value or drop it")
    _check_utf8(value, key)


def _check_utf8(value: str, key: str) -> None:
    """Label values go out as UTF-8: bytes that are not (from argv, say) are refused here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(key, "is not valid UTF-8 text", "use UTF-8 characters only") from None


# Labels hfsampler's own series and attribution add: a host label of one of these names would
# be overwritten, or overwrite them.
_RESERVED_LABELS = (
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


@dataclass(frozen=True, slots=True)
class Config:
    """Everything `hfsampler run` needs, validated."""

    source: str = "auto"
    sim_gpus: int = 2
    sim_mig: tuple[str, ...] = ()  # `--sim-mig 3g,2g,1g,1g`: every sim GPU's MIG layout
    seed: int = 0
    devices: tuple[int, ...] | None = None
    intervals_s: Mapping[str, float] = field(
        default_factory=lambda: dict(catalogue.DEFAULT_GROUP_INTERVALS_S)
    )
    field_groups: Mapping[str, str] = field(default_factory=dict)
    fields: tuple[str, ...] | None = None
    window_s: float = 1.0
    listen: str | None = "127.0.0.1:9400"
    duration_s: float | None = None
    external_labels: Mapping[str, str] = field(default_factory=dict)
    log_level: str = "info"
    log_format: str = "text"
    remote_write: tuple[EndpointConfig, ...] = ()
    stale_after_windows: int = 5
    realtime_priority: int = 1  # the sampler's SCHED_FIFO priority when allowed; 0: never ask
    auto_intervals: bool = False  # `intervals: auto`: groups from `hfsampler probe` at start
    dcgm_path: str | None = None  # `dcgm.path`: DCGM's Python bindings (None: DCGM's places)
    dcgm_host: str = "localhost"  # `dcgm.host`: the DCGM host engine
    dcgm_interval_s: float = 0.1  # `dcgm.interval`: how often DCGM samples watched fields
    # `jetson.sysfs_root`: where the jetson source finds sys/, proc/ and etc/; for tests only
    jetson_sysfs_root: str | None = None
    pod_resources_socket: str | None = None  # the kubelet's, for pod/namespace/container labels
    hpc_job_mapping_dir: str | None = None  # one file per GPU naming its jobs, for hpc_job
    hostname: str | None = None  # Hostname label; None: the machine's (in a pod: not the node)
    host_label: str = "Hostname"  # the host label's name: dcgm-exporter's, or newer `hostname`
    instance: str | None = None  # `instance` label; None: <host>:<listen port or 9400>; "": none
    queue_dir: str | None = None  # spool Remote-Write queues here (persistent); None: memory only
    max_ring_bytes: int = DEFAULT_MAX_RING_BYTES  # the most shared memory the sample rings may take
    # `mig.copy_device_fields`: GPU-level fields on every MIG instance too, as dcgm-exporter does
    mig_copy_device_fields: bool = False

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError("source", f"unknown source {self.source!r}", _one_of(SOURCES))
        if self.sim_gpus < 1 or self.sim_gpus > 1024:
            raise ConfigError("gpus", f"{self.sim_gpus} GPUs", "give between 1 and 1024")
        if self.window_s < 0.01 or self.window_s > 3600:
            raise ConfigError("window", f"{self.window_s}s is out of range", "use 10ms to 1h")
        for group, interval in self.intervals_s.items():
            if to_ns(interval) < _MIN_INTERVAL_NS:
                raise ConfigError(f"intervals.{group}", "shorter than 100us", "use 100us or more")
            if to_ns(interval) > to_ns(self.window_s):
                raise ConfigError(
                    f"intervals.{group}",
                    f"{interval}s is longer than the window ({self.window_s}s)",
                    "sample at least once per window, or lengthen --window",
                )
        for name, group in self.field_groups.items():
            if group not in self.intervals_s:
                raise ConfigError(
                    f"field_groups.{name}", f"unknown group {group!r}", _one_of(self.intervals_s)
                )
        if self.listen is not None:
            parse_listen(self.listen)
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError("duration", "must be positive", "e.g. 10s")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", f"unknown level {self.log_level!r}", _one_of(LOG_LEVELS))
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(
                "log_format", f"unknown format {self.log_format!r}", _one_of(LOG_FORMATS)
            )
        for name, value in self.external_labels.items():
            _check_label(name, value, f"external_labels.{name}")
        if not 0 <= self.realtime_priority <= 99:
            raise ConfigError(
                "realtime_priority", f"{self.realtime_priority} is out of range", "use 0 to 99"
            )
        if not _MIN_INTERVAL_NS <= to_ns(self.dcgm_interval_s) <= to_ns(self.window_s):
            raise ConfigError(
                "dcgm.interval", f"{self.dcgm_interval_s}s is out of range", "use 100us to --window"
            )
        if isinstance(self.max_ring_bytes, bool) or not isinstance(self.max_ring_bytes, int):
            raise ConfigError("max_ring_bytes", "must be a size", "e.g. 256MiB")
        if self.max_ring_bytes < MIN_MAX_RING_BYTES:
            raise ConfigError(
                "max_ring_bytes", f"{self.max_ring_bytes} bytes is too small", "give 1MiB or more"
            )
        if self.stale_after_windows < 1:
            raise ConfigError("stale_after_windows", "must be at least 1", "e.g. 5")
        if self.queue_dir is not None:
            _check_queue_dir(self.queue_dir)
        if self.jetson_sysfs_root is not None and not os.path.isdir(self.jetson_sysfs_root):
            raise ConfigError(
                "jetson.sysfs_root",
                f"{self.jetson_sysfs_root!r} is not a directory",
                "give a fixture tree's root, or leave it out on a Jetson (it reads /)",
            )
        for key in ("pod_resources_socket", "hpc_job_mapping_dir"):
            path = getattr(self, key)
            if path is not None and not path.startswith("/"):
                raise ConfigError(key, f"{path!r} is not an absolute path", "start it with /")
        if not LABEL_NAME_RE.match(self.host_label) or self.host_label.startswith("__"):
            raise ConfigError(
                "host_label", f"{self.host_label!r} is not a label name", "Hostname or hostname"
            )
        if self.host_label in _RESERVED_LABELS:
            raise ConfigError(
                "host_label",
                f"{self.host_label!r} is a label hfsampler sets itself",
                "Hostname or hostname",
            )
        if self.instance is not None:
            if "\n" in self.instance or "\r" in self.instance:
                raise ConfigError("instance", "must be one line", "e.g. instance: node17:9400")
            _check_utf8(self.instance, "instance")
        # unknown names fail here, at load time, and so does a field no group samples
        check_unique_names(self.remote_write)  # also across --remote-write URLs
        check_intervals(self.selected_fields(), self.intervals_s)

    def warnings(self) -> list[str]:
        """What is accepted but will not do what it might seem to: said at check and at start."""
        out = self.label_warnings() + self.lane_warnings()
        default_max = QueueConfig().max_shards
        for i, ep in enumerate(self.remote_write):
            if ep.queue.max_shards != default_max:
                out.append(
                    f"remote_write[{i}].queue_config.max_shards is not used: hfsampler runs "
                    f"min_shards ({ep.queue.min_shards}) shards and does not reshard"
                )
        return out

    def lane_warnings(self) -> list[str]:
        """Groups as fast as the real-time lane's but not on it (only the fastest group is)."""
        used = {f.group for f in self.selected_fields()}
        groups = [g for g in self.intervals_s if g in used]
        if len(groups) < 2:
            return []
        lane = min(groups, key=self.intervals_s.__getitem__)  # as plan_groups picks it
        out = []
        for g in groups:
            interval = self.intervals_s[g]
            if g != lane and interval < SLOW_LANE_MIN_INTERVAL_S:
                out.append(
                    f"intervals.{g}: {interval * 1e3:g} ms runs on the sampler's second thread "
                    f"(only the fastest group, {lane}, has the real-time lane) and will often "
                    f"be late; give it {SLOW_LANE_MIN_INTERVAL_S * 1e3:g} ms or more, or move "
                    "its fields into the fastest group with field_groups"
                )
        return out

    def label_warnings(self) -> list[str]:
        """What a strict receiver (Mimir's defaults) would refuse in this config's series."""
        names = (
            1 + len(GPU_LABEL_NAMES) + 1 + (self.instance != "")
        )  # __name__, GPU, host, instance
        names += 1  # `field` on hfsampler_field_refresh_seconds
        names += 3 if self.pod_resources_socket else 0  # pod, namespace, container
        names += 1 if self.hpc_job_mapping_dir else 0
        names += len(set(self.external_labels) - {self.host_label, "instance", *GPU_LABEL_NAMES})
        out = []
        if names > MIMIR_MAX_LABEL_NAMES:
            out.append(
                f"series will carry up to {names} labels; Mimir refuses more than "
                f"{MIMIR_MAX_LABEL_NAMES} by default (max_label_names_per_series): drop some "
                "external_labels or a labeldrop in write_relabel_configs"
            )
        for name in sorted(set(self.external_labels) & {*_RESERVED_LABELS, self.host_label}):
            out.append(
                f"external_labels.{name}: hfsampler sets {name!r} on its series itself, and a "
                "series' own label wins over an external one (as in Prometheus), so this one "
                "is left off those series; give it another name"
                + (" (the host's labels are set with hostname, host_label and instance)"
                   if name in (self.host_label, "instance") else "")
            )  # fmt: skip
        for name, value in sorted(self.external_labels.items()):
            if len(value.encode()) > MIMIR_MAX_LABEL_VALUE_BYTES:
                out.append(
                    f"external_labels.{name} is {len(value.encode())} bytes; Mimir refuses values "
                    f"over {MIMIR_MAX_LABEL_VALUE_BYTES} (max_label_value_length)"
                )
        return out

    @property
    def instance_port(self) -> int:
        """The port in the default ``instance``: the /metrics port, else dcgm-exporter's."""
        return parse_listen(self.listen)[1] if self.listen else DEFAULT_INSTANCE_PORT

    def selected_fields(self) -> tuple[catalogue.Field, ...]:
        chosen = catalogue.select(self.fields)
        return catalogue.regroup(chosen, dict(self.field_groups))


def check_intervals(fields: Sequence[catalogue.Field], intervals_s: Mapping[str, float]) -> None:
    """Every field's group has an interval: a field is sampled, or refused, never dropped."""
    for f in fields:
        if f.group not in intervals_s:
            raise ConfigError(
                f"intervals.{f.group}",
                f"not given, yet {f.name} (group {f.group}) is selected",
                f"add intervals.{f.group}, move the field with field_groups, or leave it out "
                "of fields",
            )
    # The fastest group has the sampler's real-time lane to itself (hfsampler.lanes); a per-link
    # NVLink field asks each link's state there once a second, a stall that lane must not take.
    # (the lane's group as plan_groups picks it: the first of the shortest interval); a lane of
    # 100 ms or more has the time
    used = {f.group for f in fields}
    lane = min((g for g in intervals_s if g in used), key=intervals_s.__getitem__, default=None)
    if lane is not None and intervals_s[lane] < catalogue.DEFAULT_GROUP_INTERVALS_S["slow"]:
        for f in fields:
            if f.per == "link" and f.group == lane:
                raise ConfigError(
                    f"field_groups.{f.name}",
                    f"group {f.group} is the fastest, the real-time lane's",
                    "leave per-link NVLink fields in slow, or a group slower than the fastest",
                )


def _check_queue_dir(path: str) -> None:
    """The spool directory must be creatable and writable; checked at load, not at first spill."""
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise ConfigError("queue_dir", "must be a directory path", "e.g. /var/lib/hfsampler/queue")
    p = Path(path)
    existing = next((q for q in (p, *p.parents) if q.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError("queue_dir", f"{path} is not a directory", "give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("queue_dir", f"{existing} is not writable", "fix its permissions")


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError("listen", f"{text!r} is not HOST:PORT", "e.g. 127.0.0.1:9400 or :9400")
    return host.strip("[]") or "0.0.0.0", int(port)


def _one_of(choices: Sequence[str] | Mapping[str, object]) -> str:
    return "one of " + ", ".join(choices)


# -- the YAML file --------------------------------------------------------------------------------

_FILE_KEYS = (
    "source",
    "gpus",
    "seed",
    "devices",
    "intervals",
    "field_groups",
    "fields",
    "window",
    "listen",
    "duration",
    "external_labels",
    "global",
    "log_level",
    "log_format",
    "remote_write",
    "stale_after_windows",
    "queue_dir",
    "max_ring_bytes",
    "realtime_priority",
    "dcgm",
    "jetson",
    "pod_resources_socket",
    "hpc_job_mapping_dir",
    "hostname",
    "host_label",
    "instance",
    "mig",
)


def _unknown(key: str, allowed: Sequence[str], where: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    fix = f"did you mean {close[0]!r}?" if close else "known keys: " + ", ".join(allowed)
    return ConfigError(f"{where}{key}", "unknown key", fix)


def _expect(value: object, kind: type | tuple[type, ...], key: str, example: str) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(key, f"expected {example}, got {value!r}", f"e.g. {key}: {example}")
    if not isinstance(value, kind):
        raise ConfigError(key, f"expected {example}, got {value!r}", f"e.g. {key}: {example}")
    return value


def _str_map(value: object, key: str) -> dict[str, str]:
    mapping = _expect(value, dict, key, "a mapping")
    out = {}
    for k, v in mapping.items():
        if not isinstance(k, str) or isinstance(v, dict | list) or v is None:
            raise ConfigError(f"{key}.{k}", f"expected a string value, got {v!r}", "quote it")
        out[k] = str(v)
    return out


def from_mapping(data: object, base: Config | None = None) -> Config:
    """Build a Config from the YAML file's top-level mapping."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "the config file must be a YAML mapping", "see the README's example")
    kw: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in _FILE_KEYS:
            raise _unknown(str(key), _FILE_KEYS)
        if key == "source":
            kw["source"] = _expect(value, str, key, "sim")
        elif key == "gpus":
            kw["sim_gpus"] = _expect(value, int, key, "2")
        elif key == "seed":
            kw["seed"] = _expect(value, int, key, "0")
        elif key == "devices":
            items = _expect(value, list, key, "[0, 1]")
            kw["devices"] = tuple(_expect(i, int, f"{key}[]", "0") for i in items)
        elif key == "intervals" and value == "auto":
            kw["auto_intervals"] = True
        elif key == "intervals":
            intervals = _expect(value, dict, key, "{fast: 1ms, slow: 100ms}")
            merged = dict(catalogue.DEFAULT_GROUP_INTERVALS_S)
            for group, text in intervals.items():
                if not isinstance(group, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", group):
                    raise ConfigError(f"intervals.{group}", "bad group name", "use e.g. fast, slow")
                merged[group] = parse_duration(text, f"intervals.{group}")
            kw["intervals_s"] = merged
        elif key == "field_groups":
            kw["field_groups"] = _str_map(value, key)
        elif key == "fields":
            items = [value] if isinstance(value, str) else _expect(value, list, key, "[fast]")
            kw["fields"] = tuple(str(_expect(i, str, f"{key}[]", "fast")) for i in items)
        elif key in ("window", "duration"):
            kw[f"{key}_s"] = parse_duration(value, key)
        elif key == "listen":
            kw["listen"] = None if value in (None, "", False) else _expect(value, str, key, ":9400")
        elif key == "external_labels":
            kw.setdefault("external_labels", {}).update(_str_map(value, key))
        elif key == "global":
            block = _expect(value, dict, key, "{external_labels: {cluster: eu1}}")
            for sub, subvalue in block.items():
                if sub != "external_labels":
                    raise _unknown(str(sub), ["external_labels"], "global.")
                labels = _str_map(subvalue, "global.external_labels")
                kw.setdefault("external_labels", {}).update(labels)
        elif key in ("log_level", "log_format"):
            kw[key] = _expect(value, str, key, "info" if key == "log_level" else "json").lower()
        elif key == "remote_write":
            kw["remote_write"] = parse_remote_write(value, "remote_write")
        elif key == "stale_after_windows":
            kw["stale_after_windows"] = _expect(value, int, key, "5")
        elif key == "max_ring_bytes":
            kw[key] = parse_size(value, key)
        elif key == "queue_dir":
            kw[key] = _expect(value, str, key, "/var/lib/hfsampler/queue") or None
        elif key == "dcgm":
            block = _expect(value, dict, key, "{path: /usr/local/dcgm/bindings/python3}")
            for sub, subvalue in block.items():
                if sub == "path":
                    kw["dcgm_path"] = _expect(subvalue, str, "dcgm.path", "/opt/dcgm/python3")
                elif sub == "host":
                    kw["dcgm_host"] = _expect(subvalue, str, "dcgm.host", "localhost")
                elif sub == "interval":
                    kw["dcgm_interval_s"] = parse_duration(subvalue, "dcgm.interval")
                else:
                    raise _unknown(str(sub), ["path", "host", "interval"], "dcgm.")
        elif key == "jetson":
            block = _expect(value, dict, key, "{sysfs_root: /tmp/orin-tree}")
            for sub, subvalue in block.items():
                if sub != "sysfs_root":
                    raise _unknown(str(sub), ["sysfs_root"], "jetson.")
                root = _expect(subvalue, str, "jetson.sysfs_root", "/tmp/orin-tree")
                if not root.startswith("/"):
                    raise ConfigError(
                        "jetson.sysfs_root", f"{root!r} is not an absolute path", "start it with /"
                    )
                kw["jetson_sysfs_root"] = root
        elif key == "realtime_priority":
            kw["realtime_priority"] = _expect(value, int, key, "1")
        elif key == "pod_resources_socket":
            sock = "/var/lib/kubelet/pod-resources/kubelet.sock"
            kw[key] = _expect(value, str, key, sock) or None
        elif key == "hostname":
            kw[key] = _expect(value, str, key, "gpu-node-17") or None
        elif key == "host_label":
            kw[key] = _expect(value, str, key, "hostname")
        elif key == "instance":
            # `instance: ""` or `instance: false` leave the label off
            kw[key] = "" if value in ("", False) else _expect(value, str, key, "node17:9400")
        elif key == "mig":
            block = _expect(value, dict, key, "{copy_device_fields: true}")
            for sub, subvalue in block.items():
                if sub != "copy_device_fields":
                    raise _unknown(str(sub), ["copy_device_fields"], "mig.")
                kw["mig_copy_device_fields"] = _expect(
                    subvalue, bool, "mig.copy_device_fields", "true"
                )
        elif key == "hpc_job_mapping_dir":
            kw[key] = _expect(value, str, key, "/var/run/hfsampler/jobs") or None
    return replace(base or Config(), **kw)


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: object, first_line: int, line: int) -> None:
        super().__init__(f"{key}: given twice")
        self.key = key
        self.first_line = first_line
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping.

    PyYAML keeps the last value without a word; Prometheus (Go's strict YAML) refuses the file,
    so a block pasted between the two must mean the same in both. A merge key (``<<``) may still
    be overridden: only keys written in the mapping itself count.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKeyError(key, seen[key], line)
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the safe loader names that problem itself
        mapping: dict[Any, Any] = super().construct_mapping(node, deep)
        return mapping


def load_file(path: str | Path, base: Config | None = None) -> Config:
    """Read and validate a config file; its keys replace those of ``base`` (an earlier file)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            "--config", f"cannot read {p}: {exc.strerror}", "check the path"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError("--config", f"{p} is not UTF-8 text", "save it as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except _DuplicateKeyError as exc:
        where = (
            f"on line {exc.line}"
            if exc.line == exc.first_line
            else f"at lines {exc.first_line} and {exc.line}"
        )
        raise ConfigError(str(p), f"{exc.key}: given twice, {where}", "keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(str(p), f"{problem}{where}", "fix the YAML syntax") from None
    return from_mapping(data, base)


def with_remote_write_urls(config: Config, urls: Sequence[str]) -> Config:
    """Add ``--remote-write URL`` endpoints to those of the file."""
    extra = tuple(endpoint_from_url(u) for u in urls)
    return replace(config, remote_write=config.remote_write + extra) if extra else config

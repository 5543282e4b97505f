"""The ``Config``: every key declared once, on its field, and validated once, at construction.

Each field's ``key(...)`` is the key's whole declaration: YAML name, flag, type and parser,
default (the field's), reload rule and one line of doc; the loader (``config.loader``), the flags
(``config.flags``), the reload (``config.reload``) and the reference (``config.reference``) read
it back through ``KEYS``. Every mistake becomes a ``ConfigError`` that names the key and the fix;
the CLI prints it on one line and exits 2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hfsampler import fields as catalogue
from hfsampler.config import consumer_keys
from hfsampler.config.counters_csv import CountersFile, counters_file_flag
from hfsampler.config.histogram_keys import (
    check_relative_error,
    histogram_warnings,
    select_histograms,
)
from hfsampler.config.keys import (
    Flag,
    Key,
    as_absolute_path,
    as_bool,
    as_counters_file,
    as_duration,
    as_instance,
    as_listen,
    as_lower,
    as_names,
    as_number,
    as_remote_write,
    as_size,
    as_str_map,
    as_text,
    as_text_or_none,
    as_whole,
    as_wholes,
    declared,
    key,
    load_intervals,
)
from hfsampler.config.labels import (
    MIMIR_MAX_LABEL_NAMES,
    MIMIR_MAX_LABEL_VALUE_BYTES,
    RESERVED_LABELS,
    check_label,
    check_utf8,
    parse_label,
)
from hfsampler.config.webconfig import load_web_config
from hfsampler.durations import parse_duration, to_ns
from hfsampler.errors import ConfigError, why_not_writable
from hfsampler.fields import DEFAULT_INSTANCE_PORT, GPU_LABEL_NAMES, realtime_group
from hfsampler.histograms import DEFAULT_RELATIVE_ERROR, schema_for_error
from hfsampler.remote_write.config import (
    EndpointConfig,
    QueueConfig,
    check_unique_names,
    endpoint_from_url,
)
from hfsampler.series import LABEL_NAME_RE
from hfsampler.sources.sim.mig import parse_layout

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


def _blank_is_none(value: str, name: str) -> str | None:
    return value or None  # '' turns the setting off


def _is_set(value: str, name: str) -> bool:
    return True  # `--intervals auto`, its one choice


def _fast_interval(intervals_s: Mapping[str, float], text: str, name: str) -> dict[str, float]:
    return {**intervals_s, catalogue.FAST: parse_duration(text, name)}


def _add_labels(labels: Mapping[str, str], given: list[str], name: str) -> dict[str, str]:
    return {**labels, **dict(parse_label(text, name) for text in given)}


def _split_fields(given: list[str], name: str) -> tuple[str, ...]:
    return tuple(t for item in given for t in item.split(",") if t.strip())


def _add_endpoints(
    endpoints: tuple[EndpointConfig, ...], urls: list[str], name: str
) -> tuple[EndpointConfig, ...]:
    return endpoints + tuple(endpoint_from_url(u) for u in urls)


def _default_intervals() -> dict[str, float]:
    return dict(catalogue.DEFAULT_GROUP_INTERVALS_S)


@dataclass(frozen=True, slots=True)
class Config:
    """Everything `hfsampler run` needs, validated. The fields with a flag come in `hfsampler run
    --help` order."""

    source: str = key(
        "auto", yaml="source", type="string", example="sim", parse=as_text,
        doc="where samples come from: " + ", ".join(SOURCES),
        flag=Flag("--source", "default: auto (NVML; on a Jetson without NVML, jetson; else sim)",
                  choices=SOURCES),
    )  # fmt: skip
    sim_gpus: int = key(
        2, yaml="gpus", type="whole number", example="2", parse=as_whole,
        spec="gpus",
        doc="how many GPUs the sim source simulates",
        flag=Flag("--gpus", "simulated GPUs (sim source)", metavar="N", type=int),
    )  # fmt: skip
    seed: int = key(
        0, yaml="seed", type="whole number", example="0", parse=as_whole,
        spec="seed",
        doc="the seed of every simulated signal",
        flag=Flag("--seed", "seed of the simulated GPUs", type=int),
    )  # fmt: skip
    sim_mig: tuple[str, ...] = key(
        (), yaml=None, type="MIG layout", doc="every simulated GPU's MIG layout, e.g. 3g,2g,1g,1g",
        spec="sim_mig",
        flag=Flag("--sim-mig", "MIG layout of every simulated GPU, e.g. 3g,2g,1g,1g (H200 "
                  "profiles)", metavar="LAYOUT", convert=parse_layout),
    )  # fmt: skip
    intervals_s: Mapping[str, float] = key(
        factory=_default_intervals, yaml="intervals", type="group: duration, or auto",
        load=load_intervals, shown_default="fast: 1ms, slow: 100ms, gpm: 100ms",
        doc="each group's sampling interval; auto: groups from `hfsampler probe` at start",
        flag=Flag("--interval", "the fast group's interval, e.g. 1ms", metavar="DUR",
                  merge=_fast_interval),
    )  # fmt: skip
    auto_intervals: bool = key(
        False, yaml=None, type="auto", doc="`intervals: auto`: measure refresh periods at start",
        flag=Flag("--intervals", "auto: measure refresh periods at start (hfsampler probe) and "
                  "group fields by them", choices=("auto",), convert=_is_set),
    )  # fmt: skip
    window_s: float = key(
        1.0, yaml="window", type="duration", parse=as_duration, shown_default="1s",
        doc="the window each statistic (min, max, mean, p99) is reduced over",
        flag=Flag("--window", "window length, e.g. 1s (default)", metavar="DUR",
                  convert=parse_duration),
    )  # fmt: skip
    listen: str | None = key(
        "127.0.0.1:9400", yaml="listen", type="HOST:PORT", example=":9400", parse=as_listen,
        doc="the /metrics address; empty: serve no /metrics",
        flag=Flag("--listen", "/metrics address; '' turns it off", metavar="HOST:PORT",
                  convert=_blank_is_none),
    )  # fmt: skip
    web_config_file: str | None = key(
        None, yaml="web_config_file", type="path", example="/etc/hfsampler/web-config.yml",
        parse=as_text_or_none, doc="TLS and basic auth for /metrics, in Prometheus's web "
        "configuration format (node_exporter's --web.config.file); re-read when it changes",
        flag=Flag("--web-config-file", "TLS and basic auth for /metrics (Prometheus's web "
                  "configuration file)", metavar="FILE", convert=_blank_is_none),
    )  # fmt: skip
    duration_s: float | None = key(
        None, yaml="duration", type="duration", parse=as_duration,
        doc="stop after this long; none: run until stopped",
        flag=Flag("--duration", "stop after this long, e.g. 10s", metavar="DUR",
                  convert=parse_duration),
    )  # fmt: skip
    external_labels: Mapping[str, str] = key(
        factory=dict, yaml="external_labels", also=("global.external_labels",),
        type="name: value", example="{cluster: train-a}", parse=as_str_map, reload="labels",
        doc="labels added to every series (as Prometheus's global.external_labels)",
        flag=Flag("--label", "external label (repeatable)", metavar="K=V", repeat=True,
                  merge=_add_labels),
    )  # fmt: skip
    fields: tuple[str, ...] | None = key(
        None, yaml="fields", type="list of names", example="[fast]", parse=as_names,
        shown_default="the default selection",
        doc="field names or groups to sample (fast, slow, gpm; all: the opt-in ones too)",
        flag=Flag("--fields", "comma-separated field names or groups (fast, slow, gpm; all: "
                  "the opt-in ones too)", metavar="LIST", repeat=True, convert=_split_fields),
    )  # fmt: skip
    fields_csv: CountersFile | None = key(  # noqa: RUF009 (a frozen dataclass: immutable)
        None, yaml="fields_csv", type="path", example="/etc/dcgm-exporter/default-counters.csv",
        parse=as_counters_file,
        doc="a dcgm-exporter counters file: sample the fields it names (with fields: both)",
        flag=Flag("--fields-csv", "dcgm-exporter counters file (FIELD, type, help): sample the "
                  "fields it names; '' for none", metavar="FILE", convert=counters_file_flag),
    )  # fmt: skip
    histograms: tuple[str, ...] = key(
        (), yaml="histograms", type="list of names", example="[DCGM_FI_DEV_POWER_USAGE]",
        parse=as_names, reload="labels",
        doc="sampled gauges (names or groups, as fields takes them) whose every distinct sample "
        "is counted into a native histogram per GPU and MIG instance (<field>_histogram)",
    )  # fmt: skip
    histogram_relative_error: float = key(
        DEFAULT_RELATIVE_ERROR, yaml="histogram_relative_error", type="number", example="0.05",
        parse=as_number, reload="labels",
        doc="the histograms' bucket width as a relative error: 0.05 gives schema 3 (buckets "
        "9% wide; `hfsampler check-config` says which)",
    )  # fmt: skip
    remote_write: tuple[EndpointConfig, ...] = key(
        (), yaml="remote_write", type="list of endpoints", parse=as_remote_write,
        reload="endpoints", doc="Remote-Write receivers, as Prometheus's remote_write block",
        flag=Flag("--remote-write", "push to (repeatable)", metavar="URL", repeat=True,
                  merge=_add_endpoints),
    )  # fmt: skip
    realtime_priority: int = key(
        1, yaml="realtime_priority", type="0 to 99", example="1", parse=as_whole,
        doc="the sampler's SCHED_FIFO priority when allowed; 0: never ask",
        flag=Flag("--realtime-priority", "the sampler's SCHED_FIFO priority when allowed "
                  "(default 1; 0: normal scheduler)", metavar="N", type=int),
    )  # fmt: skip
    pod_resources_socket: str | None = key(
        None, yaml="pod_resources_socket", type="path",
        example="/var/lib/kubelet/pod-resources/kubelet.sock", parse=as_text_or_none,
        doc="the kubelet's pod-resources socket: pod, namespace and container labels",
        flag=Flag("--pod-resources-socket", "kubelet pod-resources socket: add pod, namespace, "
                  "container labels", metavar="PATH", convert=_blank_is_none),
    )  # fmt: skip
    hostname: str | None = key(
        None, yaml="hostname", type="string", example="gpu-node-17", parse=as_text_or_none,
        reload="labels", doc="the host label's value; none: the machine's (in a pod: not the node)",
        flag=Flag("--hostname", "the host label's value (in Kubernetes: the node's name)",
                  metavar="NAME", convert=_blank_is_none),
    )  # fmt: skip
    instance: str | None = key(
        None, yaml="instance", type="string", example="node17:9400", parse=as_instance,
        reload="labels", shown_default="HOST:PORT",
        doc="the instance label; none: <host>:<listen port or 9400>; empty: no instance label",
        flag=Flag("--instance", "the instance label (default HOST:PORT, as a scrape would add; "
                  "'' for none)", metavar="VALUE"),
    )  # fmt: skip
    hpc_job_mapping_dir: str | None = key(
        None, yaml="hpc_job_mapping_dir", type="path", example="/var/run/hfsampler/jobs",
        parse=as_text_or_none, doc="one file per GPU naming its jobs: the hpc_job label",
        flag=Flag("--hpc-job-mapping-dir", "one file per GPU naming its jobs: hpc_job",
                  metavar="DIR", convert=_blank_is_none),
    )  # fmt: skip
    consumers: str = key(
        "auto", yaml="consumers", also=("consumers.enabled",), type="auto, true or false",
        example="auto", parse=consumer_keys.as_mode, shown_default="auto",
        doc="per-consumer series of shared GPUs (who used each GPU, how much, its energy): "
        "auto reads GPU processes on NVML, not on the sim (true shows its made-up ones)",
        flag=Flag("--consumers", "per-consumer series of shared GPUs: auto (NVML only), on, off",
                  choices=consumer_keys.MODES, convert=consumer_keys.mode_flag),
    )  # fmt: skip
    procfs: str = key(
        "/proc", yaml="procfs", type="path", example="/host/proc", parse=as_text,
        doc="the host's procfs, where a GPU process's cgroup names its consumer (/host/proc "
        "in a container, as node_exporter's --path.procfs)",
        flag=Flag("--procfs", "the host's procfs (default /proc; /host/proc in a container)",
                  metavar="PATH"),
    )  # fmt: skip
    container_runtime_socket: str | None = key(
        None, yaml="container_runtime_socket", type="path",
        example="/run/containerd/containerd.sock", parse=as_text_or_none,
        doc="the container runtime's CRI socket: pod, namespace and container names of consumers",
        flag=Flag("--container-runtime-socket", "CRI socket (containerd, CRI-O): name the "
                  "consumers' pods and containers", metavar="PATH", convert=_blank_is_none),
    )  # fmt: skip
    consumers_max_per_gpu: int = key(
        16, yaml="consumers.max_per_gpu", type="whole number", example="16", parse=as_whole,
        reload="labels", doc='consumers with series of their own per GPU; the rest are folded '
        'into consumer="other"',
    )  # fmt: skip
    consumers_pod_label_allowlist: str | None = key(
        None, yaml="consumers.pod_label_allowlist", type="regex", example="team|app",
        parse=as_text_or_none, reload="labels",
        doc="pod labels (keys matching this regex whole) added to a pod consumer's series, as "
        "dcgm-exporter's --kubernetes-enable-pod-labels; needs container_runtime_socket; no "
        "repeat of a repeat or of alternatives ((a+)+, (a|b)*): a pod's key could make it "
        "run for hours",
    )  # fmt: skip
    consumers_dcgm_exporter_virtual_gpus: bool = key(
        False, yaml="consumers.dcgm_exporter_virtual_gpus", type="bool", example="true",
        parse=as_bool, reload="labels",
        doc="also DCGM_FI_DEV_GPU_UTIL and DCGM_FI_DEV_FB_USED per pod, as dcgm-exporter's "
        "--kubernetes-virtual-gpus has them (a plain sum over a GPU then counts it twice)",
    )  # fmt: skip
    queue_dir: str | None = key(
        None, yaml="queue_dir", type="path", example="/var/lib/hfsampler/queue",
        parse=as_text_or_none, doc="spool Remote-Write queues here (persistent); none: memory only",
        flag=Flag("--queue-dir", "spool Remote-Write queues here (survives restarts)",
                  metavar="DIR", convert=_blank_is_none),
    )  # fmt: skip
    log_level: str = key(
        "info", yaml="log_level", type=", ".join(LOG_LEVELS), example="info", parse=as_lower,
        reload="live", doc="the least severe log lines written",
        flag=Flag("--log-level", choices=LOG_LEVELS),
    )  # fmt: skip
    log_format: str = key(
        "text", yaml="log_format", type=", ".join(LOG_FORMATS), example="json", parse=as_lower,
        doc="log lines as text or one JSON object each", flag=Flag("--log-format",
                                                                    choices=LOG_FORMATS),
    )  # fmt: skip
    devices: tuple[int, ...] | None = key(
        None, yaml="devices", type="list of indices", example="[0, 1]", parse=as_wholes,
        spec="indices",
        shown_default="all", doc="the NVML indices of the GPUs to sample",
    )  # fmt: skip
    field_groups: Mapping[str, str] = key(
        factory=dict, yaml="field_groups", type="field: group",
        example="{DCGM_FI_DEV_ECC_SBE_VOL_TOTAL: slow}",
        parse=as_str_map, doc="move fields into another interval group",
    )  # fmt: skip
    stale_after_windows: int = key(
        5, yaml="stale_after_windows", type="whole number", example="5", parse=as_whole,
        reload="labels", doc="windows without a sample before a series is marked stale",
    )  # fmt: skip
    max_ring_bytes: int = key(
        DEFAULT_MAX_RING_BYTES, yaml="max_ring_bytes", type="size", parse=as_size,
        shown_default="256MiB", doc="the most shared memory the sample rings may take",
    )  # fmt: skip
    # dcgm-exporter 4.8.3 and newer spell it `hostname` (its PR #655); `Hostname` until 4.8.2
    host_label: str = key(
        "hostname", yaml="host_label", type="label name", example="Hostname", parse=as_text,
        reload="labels",
        doc="the host label's name: hostname, as dcgm-exporter 4.8.3 on; Hostname, as before",
    )  # fmt: skip
    xid_count_window_s: float = key(
        300.0, yaml="xid_count_window", type="duration", parse=as_duration, shown_default="5m",
        reload="labels", doc="DCGM_EXP_XID_ERRORS_COUNT's trailing window (dcgm-exporter's "
        "--xid-count-window-size)",
    )  # fmt: skip
    clock_events_count_window_s: float = key(
        300.0, yaml="clock_events_count_window", type="duration", parse=as_duration,
        shown_default="5m", reload="labels", doc="DCGM_EXP_CLOCK_EVENTS_COUNT's trailing window "
        "(dcgm-exporter's --clock-events-count-window-size)",
    )  # fmt: skip
    dcgm_path: str | None = key(
        None, yaml="dcgm.path", type="path", example="/usr/local/dcgm/bindings/python3",
        spec="dcgm_path",
        parse=as_text, shown_default="DCGM's places", doc="where DCGM's Python bindings are",
    )  # fmt: skip
    dcgm_host: str = key(
        "localhost", yaml="dcgm.host", type="string", example="localhost", parse=as_text,
        spec="dcgm_host",
        doc="the DCGM host engine",
    )  # fmt: skip
    dcgm_interval_s: float = key(
        0.1, yaml="dcgm.interval", type="duration", parse=as_duration, shown_default="100ms",
        spec="dcgm_interval_s",
        doc="how often DCGM samples the watched fields",
    )  # fmt: skip
    jetson_sysfs_root: str | None = key(
        None, yaml="jetson.sysfs_root", type="path", example="/tmp/orin-tree",
        parse=as_absolute_path, shown_default="/",
        doc="where the jetson source finds sys/, proc/ and etc/; for tests only",
    )  # fmt: skip
    mig_copy_device_fields: bool = key(
        False, yaml="mig.copy_device_fields", type="bool", example="true", parse=as_bool,
        doc="GPU-level fields on every MIG instance too, as dcgm-exporter does",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError("source", f"unknown source {self.source!r}", _one_of(SOURCES))
        if self.sim_gpus < 1 or self.sim_gpus > 1024:
            raise ConfigError("gpus", f"{self.sim_gpus} GPUs", "give between 1 and 1024")
        if self.window_s < 0.01 or self.window_s > 3600:
            raise ConfigError("window", f"{self.window_s}s is out of range", "use 10ms to 1h")
        for name, count_s in (
            ("xid_count_window", self.xid_count_window_s),
            ("clock_events_count_window", self.clock_events_count_window_s),
        ):
            # whole milliseconds: the series say the window in their window_size_in_ms label
            # (dcgm-exporter's flag is in ms), where 100us would read 0
            count_ns = to_ns(count_s)
            if not 0 < count_ns <= 86400 * 10**9 or count_ns % 10**6:
                fix = "use whole ms from 1ms to 24h; dcgm-exporter's is 5m"
                raise ConfigError(name, f"{count_s:g}s is out of range", fix)
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
        if self.web_config_file is not None:
            load_web_config(self.web_config_file)  # refused now, not at the first scrape
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError("duration", "must be positive", "e.g. 10s")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", f"unknown level {self.log_level!r}", _one_of(LOG_LEVELS))
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(
                "log_format", f"unknown format {self.log_format!r}", _one_of(LOG_FORMATS)
            )
        for name, value in self.external_labels.items():
            check_label(name, value, f"external_labels.{name}")
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
        for name in ("pod_resources_socket", "hpc_job_mapping_dir"):
            path = getattr(self, name)
            if path is not None and not path.startswith("/"):
                raise ConfigError(name, f"{path!r} is not an absolute path", "start it with /")
        consumer_keys.check(
            self.consumers,
            self.procfs,
            self.container_runtime_socket,
            self.consumers_max_per_gpu,
            self.consumers_pod_label_allowlist,
        )
        if not LABEL_NAME_RE.match(self.host_label) or self.host_label.startswith("__"):
            raise ConfigError(
                "host_label", f"{self.host_label!r} is not a label name", "Hostname or hostname"
            )
        if self.host_label in RESERVED_LABELS:
            raise ConfigError(
                "host_label",
                f"{self.host_label!r} is a label hfsampler sets itself",
                "Hostname or hostname",
            )
        if self.instance is not None:
            if "\n" in self.instance or "\r" in self.instance:
                raise ConfigError("instance", "must be one line", "e.g. instance: node17:9400")
            check_utf8(self.instance, "instance")
        # unknown names fail here, at load time, and so does a field no group samples
        check_unique_names(self.remote_write)  # also across --remote-write URLs
        check_intervals(self.selected_fields(), self.intervals_s)
        check_relative_error(self.histogram_relative_error)
        self.histogram_fields()

    def warnings(self) -> list[str]:
        """What is accepted but will not do what it might seem to: said at check and at start."""
        out = self.label_warnings() + self.lane_warnings()
        out += self.fields_csv.warnings() if self.fields_csv is not None else []
        out += histogram_warnings(
            bool(self.histogram_fields()),
            bool(self.listen),
            [ep.send_native_histograms for ep in self.remote_write],
        )
        out += consumer_keys.warnings(
            self.container_runtime_socket,
            self.consumers_pod_label_allowlist,
            self.consumers_dcgm_exporter_virtual_gpus,
        )
        if self.web_config_file is not None and not self.listen:
            out.append("web_config_file is not used: listen is empty, so no /metrics is served")
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
        lane = realtime_group(self.selected_fields(), self.intervals_s)
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
        for name in sorted(set(self.external_labels) & {*RESERVED_LABELS, self.host_label}):
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
        """The selected fields a source reads (not those counted from them: ``counted_fields``)."""
        chosen = [f for f in self._chosen_fields() if f.counted is None]
        return catalogue.regroup(chosen, dict(self.field_groups))

    def counted_fields(self) -> tuple[catalogue.Field, ...]:
        """The selected fields the export stage counts from others (dcgm-exporter's DCGM_EXP_*)."""
        return tuple(f for f in self._chosen_fields() if f.counted is not None)

    def histogram_fields(self) -> tuple[catalogue.Field, ...]:
        """The sampled gauges counted into native histograms (``histograms``)."""
        return select_histograms(self.histograms, self.selected_fields())

    @property
    def histogram_schema(self) -> int:
        """The native histograms' bucket schema, from ``histogram_relative_error``."""
        return schema_for_error(self.histogram_relative_error)

    def _chosen_fields(self) -> tuple[catalogue.Field, ...]:
        if self.fields_csv is not None:  # the file's fields and those of `fields` besides
            return self.fields_csv.select(self.fields)
        return catalogue.select(self.fields)


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
    # NVLink field asks each link's state there once a second, a stall that lane must not take
    # (a lane of 100 ms or more has the time).
    lane = realtime_group(fields, intervals_s)
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
    if why := why_not_writable(existing):
        raise ConfigError("queue_dir", f"{existing} {why}", "give a writable directory")


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError("listen", f"{text!r} is not HOST:PORT", "e.g. 127.0.0.1:9400 or :9400")
    return host.strip("[]") or "0.0.0.0", int(port)


def _one_of(choices: Sequence[str] | Mapping[str, object]) -> str:
    return "one of " + ", ".join(choices)


KEYS: tuple[Key, ...] = declared(Config)

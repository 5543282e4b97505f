"""The field catalogue: the one table every stage reads (sources, windows, encoder, /metrics, docs).

Each entry names the dcgm-exporter metric, its help text and unit, how NVML gives it (a field id for
the batched ``nvmlDeviceGetFieldValues`` hot path, or a call), the scale from NVML's unit to the
exported unit, its kind, and the sampling group it belongs to by default; and how the ``jetson``
source reads it from sysfs, where it can. A field that a source finds several of on a device (a
Jetson's power rails, its thermal zones) names the label that tells them apart (``per``): the
source expands it at open into one field per instance, each carrying that label (``labels``).
The roles (``POWER``, ``FB_USED``, ...) name what other stages need a field for; ``pick`` finds
the field that serves one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from hfsampler.errors import ConfigError


class Kind(enum.Enum):
    """How a window reduces a field and how it is exported."""

    GAUGE = "gauge"  # every gauge statistic of hfsampler.window.STATS: the mean under the name
    COUNTER = "counter"  # monotonic: the window's last value, exported as a counter, never averaged
    STATE = "state"  # a code (last XID, remap failure flag): the window's last value, no siblings
    BITMASK = "bitmask"  # reason bits: OR over the window, so a 2 ms throttle is not lost


FAST = "fast"
SLOW = "slow"
GPM = "gpm"  # activity ratios from NVML's GPM sample pairs: NVML refreshes them every ~100 ms
DEFAULT_GROUP_INTERVALS_S: dict[str, float] = {FAST: 0.001, SLOW: 0.1, GPM: 0.1}


@dataclass(frozen=True, slots=True)
class Field:
    """One metric of the catalogue."""

    name: str
    help: str
    unit: str
    kind: Kind
    group: str
    nvml_field: str | None = None  # pynvml constant name (NVML_FI_DEV_*), read in the batched call
    nvml_call: str | None = None  # key of a per-device call in the nvml source (fallback too)
    scale: float = 1.0  # exported value = NVML value * scale
    # NVML gives a cumulative counter; export its rate per second between distinct samples
    nvml_rate: bool = False
    gpm_metric: str | None = None  # pynvml constant name (NVML_GPM_METRIC_*), from GPM samples
    dcgm_field: int | None = None  # DCGM field id, read by the dcgm source
    jetson: str | None = None  # what the jetson source reads it from (hfsampler.sources.jetson)
    per: str | None = None  # one series per instance found at open, told apart by this label
    # (a per-link NVLink field's nvml_field may name the link: "..._L{link}")
    labels: tuple[tuple[str, str], ...] = ()  # an expanded field's own labels, e.g. (("rail", ..),)
    # not in the default selection nor in a group's: only by name or ``all`` (see ``select``)
    opt_in: bool = False
    # the field's per-MIG-instance twin (expand_mig): read on MIG instance rows, not on GPUs
    mig_instance: bool = False
    # not read from a device: counted by the export stage from the series of the fields in
    # ``requires`` (hfsampler.export.event_counts: "xid", "clock_events" over a trailing
    # window; "xid_total", "clock_events_total" since start)
    counted: str | None = None
    requires: tuple[str, ...] = ()  # selecting this field selects these too

    @property
    def prometheus_type(self) -> str:
        return "counter" if self.kind is Kind.COUNTER else "gauge"

    @property
    def nvml_readable(self) -> bool:
        """NVML (or the sim, which imitates an NVML GPU) has a way to read it."""
        return bool(self.nvml_field or self.nvml_call or self.gpm_metric)

    def instance(self, value: str) -> Field:
        """The field for one instance of a ``per`` field (one rail, one zone)."""
        if self.per is None:
            raise ValueError(f"{self.name} is not a per-instance field")
        return replace(self, labels=((self.per, value),))


_MIB = 1.0 / (1 << 20)
_PCT = 0.01  # GPM reports activity in percent, DCGM's DCGM_FI_PROF_* ratios are 0.0-1.0
_MIB_S = float(1 << 20)  # GPM reports bandwidth in MiB/s, DCGM in bytes/s

CATALOGUE: tuple[Field, ...] = (
    # Clocks
    Field("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "MHz", Kind.GAUGE, FAST,
          nvml_call="clock_sm", jetson="gpu_freq"),
    Field("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "MHz", Kind.GAUGE, FAST,
          nvml_call="clock_mem", jetson="emc_freq"),
    # Temperature
    Field("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "C", Kind.GAUGE, SLOW,
          nvml_call="temperature_gpu", jetson="gpu_temp"),
    Field("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", "C", Kind.GAUGE, SLOW,
          nvml_field="NVML_FI_DEV_MEMORY_TEMP"),
    # Power and energy
    Field("DCGM_FI_DEV_POWER_USAGE", "Power draw, 1 s average as the driver reports it (in W).",
          "W", Kind.GAUGE, FAST, nvml_field="NVML_FI_DEV_POWER_AVERAGE", nvml_call="power_usage",
          scale=1e-3),
    Field("DCGM_FI_DEV_POWER_USAGE_INSTANT", "Current instantaneous power draw (in W).", "W",
          Kind.GAUGE, FAST, nvml_field="NVML_FI_DEV_POWER_INSTANT", scale=1e-3,
          jetson="gpu_rail_power"),
    Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).",
          "mJ", Kind.COUNTER, SLOW, nvml_field="NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
          nvml_call="total_energy", jetson="gpu_rail_energy"),
    # DCGM reads these two with nvmlDeviceGetPowerManagementLimit (the limit set, e.g. by
    # `nvidia-smi -pl`) and nvmlDeviceGetEnforcedPowerLimit (the lowest of every limiter, out of
    # band ones too); dcgm-exporter has both opt-in (4.8.4). The set limit stays in hfsampler's
    # defaults: its shipped alerts and the report's power line read it.
    Field("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", "W", Kind.GAUGE, SLOW,
          nvml_call="power_mgmt_limit", scale=1e-3),
    Field("DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
          "Power limit the driver enforces after every limiter (in W).", "W", Kind.GAUGE, SLOW,
          nvml_field="NVML_FI_DEV_POWER_CURRENT_LIMIT", nvml_call="power_limit", scale=1e-3,
          opt_in=True),
    # PCIe
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", "1", Kind.COUNTER,
          SLOW, nvml_field="NVML_FI_DEV_PCIE_REPLAY_COUNTER"),
    # From the byte counters, not nvmlDeviceGetPcieThroughput: that call measures for ~20 ms
    # inside the call, which would stall the millisecond loop.
    Field("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "PCIe transmit throughput (in KB/s).", "KB/s",
          Kind.GAUGE, SLOW, nvml_field="NVML_FI_DEV_PCIE_COUNT_TX_BYTES", scale=1 / 1024,
          nvml_rate=True),
    Field("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "PCIe receive throughput (in KB/s).", "KB/s",
          Kind.GAUGE, SLOW, nvml_field="NVML_FI_DEV_PCIE_COUNT_RX_BYTES", scale=1 / 1024,
          nvml_rate=True),
    # Utilization
    Field("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "%", Kind.GAUGE, FAST,
          nvml_call="util_gpu", jetson="gpu_load"),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "%", Kind.GAUGE, FAST,
          nvml_call="util_mem", jetson="emc_load"),
    Field("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).", "%", Kind.GAUGE, FAST,
          nvml_call="util_enc"),
    Field("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).", "%", Kind.GAUGE, FAST,
          nvml_call="util_dec"),
    # Errors
    Field("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "1", Kind.STATE,
          SLOW, nvml_call="xid"),
    # every XID event, counted in the sampler process, so a burst between two reads is all in
    # the next value; expand_xid makes it one series per code (an `xid` label)
    Field("hfsampler_xid_events_total", "XID events the driver reported since hfsampler started.",
          "1", Kind.COUNTER, SLOW, nvml_call="xid_count"),
    # dcgm-exporter's DCGM_EXP_XID_ERRORS_*, counted from the two above; opt-in there too
    Field("DCGM_EXP_XID_ERRORS_COUNT", "XID errors observed during the configured time window.",
          "1", Kind.STATE, SLOW, counted="xid", opt_in=True,
          requires=("DCGM_FI_DEV_XID_ERRORS", "hfsampler_xid_events_total")),
    Field("DCGM_EXP_XID_ERRORS_TOTAL", "Total XID errors observed since exporter start.", "1",
          Kind.COUNTER, SLOW, counted="xid_total", opt_in=True,
          requires=("DCGM_FI_DEV_XID_ERRORS", "hfsampler_xid_events_total")),
    Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", "1",
          Kind.COUNTER, SLOW, nvml_field="NVML_FI_DEV_ECC_SBE_VOL_TOTAL"),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", "1",
          Kind.COUNTER, SLOW, nvml_field="NVML_FI_DEV_ECC_DBE_VOL_TOTAL"),
    Field("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC errors.",
          "1", Kind.COUNTER, SLOW, nvml_field="NVML_FI_DEV_ECC_SBE_AGG_TOTAL"),
    Field("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC errors.",
          "1", Kind.COUNTER, SLOW, nvml_field="NVML_FI_DEV_ECC_DBE_AGG_TOTAL"),
    # Retired pages (pre-Ampere; Ampere and newer remap rows instead): opt-in, as there
    Field("DCGM_FI_DEV_RETIRED_SBE", "Total number of retired pages due to single-bit errors.",
          "1", Kind.COUNTER, SLOW, nvml_field="NVML_FI_DEV_RETIRED_SBE", opt_in=True),
    Field("DCGM_FI_DEV_RETIRED_DBE", "Total number of retired pages due to double-bit errors.",
          "1", Kind.COUNTER, SLOW, nvml_field="NVML_FI_DEV_RETIRED_DBE", opt_in=True),
    Field("DCGM_FI_DEV_RETIRED_PENDING",
          "Whether pages are pending retirement (1 means pending and 0 means not pending).", "1",
          Kind.STATE, SLOW, nvml_field="NVML_FI_DEV_RETIRED_PENDING", opt_in=True),
    # Memory
    Field("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "MiB", Kind.GAUGE, FAST,
          nvml_call="fb_free", scale=_MIB, jetson="mem_available"),
    Field("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "MiB", Kind.GAUGE, FAST,
          nvml_call="fb_used", scale=_MIB, jetson="mem_used"),
    Field("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).", "MiB", Kind.GAUGE,
          FAST, nvml_call="fb_reserved", scale=_MIB),
    Field("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", "MiB", Kind.GAUGE, SLOW,
          nvml_call="fb_total", scale=_MIB),
    # NVLink
    # DCGM publishes a rate, not a counter: NVML's TX and RX data KiB counters summed over
    # every link, differenced between its polls, per second, /1000 ("MB/s"; dcgm-exporter PR
    # #658 quotes DcgmCacheManager's ReadAndCacheNvLinkBandwidthTotal). Here the same counters,
    # differenced between the driver's refreshes; the window keeps their mean and peaks.
    Field("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
          "NVLink data throughput over all links, TX and RX together (in MB/s, KiB/s / 1000 as "
          "DCGM computes it).", "MB/s", Kind.GAUGE, SLOW, nvml_call="nvlink_data_kib",
          scale=1e-3, nvml_rate=True, dcgm_field=449),
    # the same counters as they are: exact over any range (rate(...[5m])), whatever a window or
    # a scrape missed
    Field("hfsampler_nvlink_data_bytes_total",
          "NVLink data moved over all links since the driver loaded, TX and RX together, "
          "payload without protocol headers (in bytes).", "B", Kind.COUNTER, SLOW,
          nvml_call="nvlink_data_kib", scale=1024.0),
    # All links together (pre-Hopper): dcgm-exporter's opt-in rows, under DCGM's current names
    # (dcgm-exporter 4.8.3's files named them ..._COUNT_TOTAL)
    Field("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL",
          "Total number of NVLink flow-control CRC errors across all lanes.", "1", Kind.COUNTER,
          SLOW, nvml_field="NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_TOTAL",
          "Total number of NVLink data CRC errors across all lanes.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_TOTAL",
          "Total number of NVLink replay errors across all lanes.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_TOTAL",
          "Total number of NVLink recovery errors across all lanes.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", opt_in=True),
    # Per link (a `link` label, one series per link active at open; hfsampler.sources.nvml_nvlink).
    # DCGM's per-link fields keyed by a link entity, one field id for every link, give the names;
    # its older per-link ids (DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0 ... _L17) are these
    # families' series with link="0" ... "17". NVML reads the bandwidth as a cumulative KiB
    # counter with the link as scopeId, the errors by one field id per link ("{link}").
    Field("DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK",
          "NVLink data transmitted on one link, payload without protocol headers (in B/s).",
          "B/s", Kind.GAUGE, SLOW, nvml_field="NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
          scale=1024.0, nvml_rate=True, per="link", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_RX_THROUGHPUT_PER_LINK",
          "NVLink data received on one link, payload without protocol headers (in B/s).",
          "B/s", Kind.GAUGE, SLOW, nvml_field="NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
          scale=1024.0, nvml_rate=True, per="link", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL",
          "Number of NVLink flow-control CRC errors on one link.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L{link}", per="link", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_PER_LINK_TOTAL",
          "Number of NVLink data CRC errors on one link.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{link}", per="link", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_PER_LINK_TOTAL",
          "Number of NVLink replays (retries) on one link.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_L{link}", per="link", opt_in=True),
    Field("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_PER_LINK_TOTAL",
          "Number of NVLink recovery errors on one link.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_L{link}", per="link", opt_in=True),
    # Remapped rows
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
          "Number of remapped rows for correctable errors.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_REMAPPED_COR"),
    Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
          "Number of remapped rows for uncorrectable errors.", "1", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_REMAPPED_UNC"),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed.", "1",
          Kind.STATE, SLOW, nvml_field="NVML_FI_DEV_REMAPPED_FAILURE"),
    # Clock events (throttling)
    Field("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
          "Clock event (throttle) reasons as NVML's reason bits.", "1",
          Kind.BITMASK, FAST, nvml_call="clocks_event_reasons"),
    Field("DCGM_EXP_CLOCK_EVENTS_COUNT",
          "Clock events observed during the configured time window.", "1", Kind.STATE, SLOW,
          counted="clock_events", opt_in=True, requires=("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",)),
    Field("DCGM_EXP_CLOCK_EVENTS_TOTAL",
          "Total clock events observed since exporter start (edge-counted).", "1", Kind.COUNTER,
          SLOW, counted="clock_events_total", opt_in=True,
          requires=("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",)),
    # Violation time in ns as NVML counts it (nvmlViolationTime_t.violationTime) and DCGM
    # passes it on (dcgm_fields.h; dcgm-exporter's help says ns since its PR #589), so
    # rate(...[5m]) / 1e9 is the fraction of time throttled, as for dcgm-exporter.
    Field("DCGM_FI_DEV_POWER_VIOLATION",
          "Throttling duration due to power constraints (in ns).", "ns", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_PERF_POLICY_POWER"),
    Field("DCGM_FI_DEV_THERMAL_VIOLATION",
          "Throttling duration due to thermal constraints (in ns).", "ns", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_PERF_POLICY_THERMAL"),
    # commented out (opt-in) in dcgm-exporter's counters files, so opt-in here
    Field("DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
          "Throttling duration due to sync-boost constraints (in ns).", "ns", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_PERF_POLICY_SYNC_BOOST", opt_in=True),
    Field("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
          "Throttling duration due to board limit constraints (in ns).", "ns", Kind.COUNTER,
          SLOW, nvml_field="NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT", opt_in=True),
    Field("DCGM_FI_DEV_LOW_UTIL_VIOLATION",
          "Throttling duration due to low utilization (in ns).", "ns", Kind.COUNTER, SLOW,
          nvml_field="NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION", opt_in=True),
    Field("DCGM_FI_DEV_RELIABILITY_VIOLATION",
          "Throttling duration due to reliability constraints (in ns).", "ns", Kind.COUNTER,
          SLOW, nvml_field="NVML_FI_DEV_PERF_POLICY_RELIABILITY", opt_in=True),
    # Board state
    Field("DCGM_FI_DEV_FAN_SPEED", "Fan speed (in %).", "%", Kind.GAUGE, SLOW, nvml_call="fan"),
    Field("DCGM_FI_DEV_PSTATE", "Performance state (0 fastest, 15 slowest).", "1", Kind.GAUGE,
          SLOW, nvml_call="pstate"),
    # Activity (DCGM profiling names and units; NVML's GPM on Hopper and newer, or DCGM)
    Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE",
          "Ratio of time the graphics engine is active.", "ratio", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_GRAPHICS_UTIL", scale=_PCT, dcgm_field=1001),
    Field("DCGM_FI_PROF_SM_ACTIVE",
          "The ratio of cycles an SM has at least 1 warp assigned.", "ratio", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_SM_UTIL", scale=_PCT, dcgm_field=1002),
    Field("DCGM_FI_PROF_SM_OCCUPANCY",
          "The ratio of number of warps resident on an SM.", "ratio", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_SM_OCCUPANCY", scale=_PCT, dcgm_field=1003),
    Field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
          "Ratio of cycles the tensor (HMMA) pipe is active.", "ratio", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_ANY_TENSOR_UTIL", scale=_PCT, dcgm_field=1004),
    Field("DCGM_FI_PROF_DRAM_ACTIVE",
          "Ratio of cycles the device memory interface is active sending or receiving data.",
          "ratio", Kind.GAUGE, GPM, gpm_metric="NVML_GPM_METRIC_DRAM_BW_UTIL", scale=_PCT,
          dcgm_field=1005),
    Field("DCGM_FI_PROF_PIPE_FP64_ACTIVE",
          "Ratio of cycles the fp64 pipes are active.", "ratio", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_FP64_UTIL", scale=_PCT, dcgm_field=1006),
    Field("DCGM_FI_PROF_PIPE_FP32_ACTIVE",
          "Ratio of cycles the fp32 pipes are active.", "ratio", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_FP32_UTIL", scale=_PCT, dcgm_field=1007),
    Field("DCGM_FI_PROF_PIPE_FP16_ACTIVE",
          "Ratio of cycles the fp16 pipes are active.", "ratio", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_FP16_UTIL", scale=_PCT, dcgm_field=1008),
    Field("DCGM_FI_PROF_PCIE_TX_BYTES",
          "The rate of data transmitted over the PCIe bus, headers included, in bytes per second.",
          "B/s", Kind.GAUGE, GPM, gpm_metric="NVML_GPM_METRIC_PCIE_TX_PER_SEC", scale=_MIB_S,
          dcgm_field=1009),
    Field("DCGM_FI_PROF_PCIE_RX_BYTES",
          "The rate of data received over the PCIe bus, headers included, in bytes per second.",
          "B/s", Kind.GAUGE, GPM, gpm_metric="NVML_GPM_METRIC_PCIE_RX_PER_SEC", scale=_MIB_S,
          dcgm_field=1010),
    Field("DCGM_FI_PROF_NVLINK_TX_BYTES",
          "The rate of data transmitted over NVLink, not including protocol headers, in bytes "
          "per second.", "B/s", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", scale=_MIB_S, dcgm_field=1011),
    Field("DCGM_FI_PROF_NVLINK_RX_BYTES",
          "The rate of data received over NVLink, not including protocol headers, in bytes "
          "per second.", "B/s", Kind.GAUGE, GPM,
          gpm_metric="NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", scale=_MIB_S, dcgm_field=1012),
    # Jetson (sysfs, hfsampler.sources.jetson): what a Jetson has and dcgm-exporter has no name
    # for. The fields above marked jetson= are read there too (docs/jetson.md).
    Field("hfsampler_jetson_rail_power_watts",
          "Power on one INA3221 rail of the Jetson module, voltage x current (in W).", "W",
          Kind.GAUGE, FAST, jetson="rail_power", per="rail"),
    Field("hfsampler_jetson_rail_voltage_volts",
          "Bus voltage of one INA3221 rail of the Jetson module (in V).", "V", Kind.GAUGE, FAST,
          jetson="rail_voltage", per="rail"),
    Field("hfsampler_jetson_rail_current_amperes",
          "Current on one INA3221 rail of the Jetson module (in A).", "A", Kind.GAUGE, FAST,
          jetson="rail_current", per="rail"),
    Field("hfsampler_jetson_temp_celsius", "Temperature of one thermal zone (in C).", "C",
          Kind.GAUGE, SLOW, jetson="zone_temp", per="zone"),
    Field("hfsampler_jetson_gpu_min_clock_mhz",
          "Lowest GPU clock the devfreq governor may choose now (in MHz).", "MHz", Kind.STATE,
          SLOW, jetson="gpu_min_freq"),
    Field("hfsampler_jetson_gpu_max_clock_mhz",
          "Highest GPU clock the devfreq governor may choose now, the power mode's cap (in MHz).",
          "MHz", Kind.STATE, SLOW, jetson="gpu_max_freq"),
    Field("hfsampler_jetson_gpu_railgated",
          "1 while the GPU is rail-gated (powered off by runtime PM), 0 while powered.", "1",
          Kind.STATE, SLOW, jetson="gpu_railgated"),
    Field("hfsampler_jetson_nvmap_used_mib",
          "Memory the GPU and other engines hold through nvmap, NvMapMemUsed (in MiB).", "MiB",
          Kind.GAUGE, FAST, jetson="nvmap_used"),
)  # fmt: skip

BY_NAME: dict[str, Field] = {f.name: f for f in CATALOGUE}
DEFAULT_SELECTION: tuple[Field, ...] = tuple(f for f in CATALOGUE if not f.opt_in)

# The XID codes hfsampler_xid_events_total has a series for from the start (at 0, so the first
# event is an increase), from NVIDIA's XID catalogue; any other code counts under "other", and
# DCGM_FI_DEV_XID_ERRORS still says which it was. 13/31/43/45: application faults; 48, 63, 64,
# 92, 94, 95: memory (ECC) errors and their page retirement or row remapping; 61/62: internal
# microcontroller errors; 74: NVLink; 79: fallen off the bus; 119/120: GSP errors.
XID_CODES: tuple[int, ...] = (13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120)
XID_OTHER = "other"
XID_LABELS: tuple[str, ...] = (*(str(c) for c in XID_CODES), XID_OTHER)


def expand_xid(fields: Sequence[Field]) -> tuple[Field, ...]:
    """``fields`` with the XID counter as one field per code of ``XID_LABELS`` (label ``xid``).

    The codes are a fixed list, not something a device is found to have, so the caller expands
    them before opening a source; unexpanded, the counter is every code's events together.
    """
    out: list[Field] = []
    for f in fields:
        if f.nvml_call == "xid_count" and not f.labels:
            out.extend(replace(f, labels=(("xid", x),)) for x in XID_LABELS)
        else:
            out.append(f)
    return tuple(out)


# What NVML answers per MIG instance: its own framebuffer, and (Hopper and newer) GPM activity
# through nvmlGpmMigSampleGet. Everything else (power, clocks, temperature, ECC, PCIe, NVLink,
# energy) belongs to the physical GPU.
MIG_INSTANCE_FIELDS: frozenset[str] = frozenset(
    {"DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_TOTAL"}
    | {"DCGM_FI_DEV_FB_RESERVED"}
    | {f.name for f in CATALOGUE if f.gpm_metric}
)


def realtime_group(fields: Iterable[Field], intervals_s: Mapping[str, float]) -> str | None:
    """The group that has the sampler's real-time lane to itself: of the groups that have
    fields, the one with the shortest interval (of equally short ones, the first in
    ``intervals_s``); None when no field has a group there.

    The one statement of the lane rule: the planner (``plan_groups``), the config's checks and
    warnings, and ``expand_mig`` all ask here.
    """
    used = {f.group for f in fields}
    return min((g for g in intervals_s if g in used), key=intervals_s.__getitem__, default=None)


def expand_mig(fields: Sequence[Field], intervals_s: Mapping[str, float]) -> tuple[Field, ...]:
    """``fields`` and, after them, the per-MIG-instance twin of each that NVML has per instance.

    The twins carry ``mig_instance`` and are read on MIG instance rows only (a source without
    MIG finds them unsupported everywhere, and discovery drops them). A twin never samples in
    the real-time lane's group (``realtime_group``): a MIG read belongs to the slow lane, so a
    twin of a lane field goes to the next slower group there is (``slow`` by default); with no
    slower group, there is no slow lane and it stays.
    """
    lane = realtime_group(fields, intervals_s)
    lane_s = intervals_s[lane] if lane is not None else 0.0
    # of equally fast groups, `slow` (GPM has its own refresh and may be moved alone)
    slower = sorted((iv, name != SLOW, name) for name, iv in intervals_s.items() if iv > lane_s)
    twins = []
    for f in fields:
        if f.name not in MIG_INSTANCE_FIELDS or f.mig_instance:
            continue
        group = f.group
        if group == lane and slower:
            group = slower[0][2]
        twins.append(replace(f, mig_instance=True, group=group))
    return (*fields, *twins)


_BY_LOWER: dict[str, str] = {name.lower(): name for name in BY_NAME}  # names are case-insensitive


@dataclass(frozen=True, slots=True)
class Role:
    """What another stage needs a field for, and the catalogue names that serve it, best first."""

    names: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = [n for n in self.names if n not in BY_NAME]
        if unknown or not self.names:
            raise ValueError(f"a role names catalogue fields: {unknown}")

    @property
    def name(self) -> str:
        """The field that serves the role best (for a role of one field, that field)."""
        return self.names[0]

    def __or__(self, other: Role) -> Role:
        """This role's fields, else the other's."""
        return Role(self.names + other.names)


POWER_INSTANT = Role(("DCGM_FI_DEV_POWER_USAGE_INSTANT",))
POWER_AVERAGE = Role(("DCGM_FI_DEV_POWER_USAGE",))  # the driver's 1 s average, what a scrape sees
POWER = POWER_INSTANT | POWER_AVERAGE  # power draw: instant power, else the 1 s average
# the limit in force: the enforced one where selected, else the one set
POWER_LIMIT = Role(("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_POWER_MGMT_LIMIT"))
POWER_VIOLATION = Role(("DCGM_FI_DEV_POWER_VIOLATION",))
ENERGY = Role(("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",))
FB_USED = Role(("DCGM_FI_DEV_FB_USED",))
FB_FREE = Role(("DCGM_FI_DEV_FB_FREE",))
GPU_UTIL = Role(("DCGM_FI_DEV_GPU_UTIL",))
GPU_TEMP = Role(("DCGM_FI_DEV_GPU_TEMP",))
SM_CLOCK = Role(("DCGM_FI_DEV_SM_CLOCK",))
CLOCK_EVENTS = Role(("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",))  # throttle reasons, NVML's bits


def pick(role: Role, fields: Iterable[Field]) -> Field | None:
    """The field among ``fields`` that serves ``role``: the first of its names there, else None.

    Of several fields with one name (instances), the first is picked.
    """
    have: dict[str, Field] = {}
    for f in fields:
        have.setdefault(f.name, f)
    return next((have[n] for n in role.names if n in have), None)


def locate(role: Role, groups: Sequence[Sequence[Field]]) -> tuple[int, int] | None:
    """Where ``pick`` finds the role's field among several groups: (group, position), or None."""
    field = pick(role, (f for g in groups for f in g))
    at = ((g, j) for g, fields in enumerate(groups) for j, f in enumerate(fields) if f is field)
    return next(at, None)


def select(selectors: Iterable[str] | None, key: str = "fields") -> tuple[Field, ...]:
    """The catalogue entries named by ``selectors``: field names, groups (fast, slow, gpm), ``all``.

    Names may omit the ``DCGM_FI_DEV_`` (or ``DCGM_FI_PROF_``) prefix and are case-insensitive.
    Catalogue order is kept. Without selectors: every field but the opt-in ones (per-link
    NVLink: up to 18 links times 12 series per GPU, more than the rest of a GPU's series
    together, so a fleet upgrading gets them when it asks, as with dcgm-exporter's defaults;
    and the fields new to hfsampler that dcgm-exporter's counters files leave commented out);
    a group leaves them out too, ``all`` and their names select them. A field counted from
    others (``requires``) brings them along. ``key``: the config key a mistake names.
    """
    if selectors is None:
        return DEFAULT_SELECTION
    wanted: set[str] = set()
    for raw in selectors:
        token = raw.strip()
        if not token:
            continue
        low = token.lower()
        if low == "all":
            wanted.update(BY_NAME)
        elif low in DEFAULT_GROUP_INTERVALS_S:
            wanted.update(f.name for f in DEFAULT_SELECTION if f.group == low)
        else:
            found = next((_BY_LOWER[c] for c in (low, "dcgm_fi_dev_" + low,
                          "dcgm_fi_prof_" + low) if c in _BY_LOWER), None)  # fmt: skip
            if found is None:
                raise ConfigError(
                    key,
                    f"unknown field {token!r}",
                    "use a catalogue name such as DCGM_FI_DEV_POWER_USAGE, a group "
                    "(fast, slow, gpm) or all; `hfsampler fields` lists them",
                )
            wanted.add(found)
    if not wanted:
        raise ConfigError(key, "selects no field", "name at least one field or group")
    wanted.update(r for name in list(wanted) for r in BY_NAME[name].requires)
    return tuple(f for f in CATALOGUE if f.name in wanted)


def regroup(fields: Sequence[Field], overrides: dict[str, str]) -> tuple[Field, ...]:
    """Move fields to other groups (``{field name: group}``), validating both sides."""
    out = []
    for f in fields:
        group = overrides.get(f.name, f.group)
        out.append(f if group == f.group else replace(f, group=group))
    unknown = set(overrides) - set(BY_NAME)
    if unknown:
        raise ConfigError(
            "field_groups", f"unknown field {sorted(unknown)[0]!r}", "use a catalogue name"
        )
    return tuple(out)


# NVML's clock event (throttle) reason bits, nvmlClocksEventReason*
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


# dcgm-exporter's port: the `instance` a scrape of it would have given the series.
DEFAULT_INSTANCE_PORT = 9400


# The labels gpu_labels gives every GPU series besides the host's.
GPU_LABEL_NAMES = ("gpu", "UUID", "device", "modelName", "pci_bus_id", "DCGM_FI_DRIVER_VERSION")
# And a MIG instance's.
MIG_LABEL_NAMES = ("GPU_I_ID", "GPU_I_PROFILE", "MIG_UUID")

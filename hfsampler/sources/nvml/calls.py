"""The one module that imports ``pynvml``: every NVML call hfsampler makes goes through here.

The other NVML modules (``nvml``, ``nvml_gpm``, ``nvml_xid``) and ``benchmarks/gpu_check.py`` ask
this one: it wraps the library calls they make (init, discovery, field values, events, GPM) and
re-exports the few constants and structs they need, so a pynvml version difference is met in one
place. It holds the one table that turns an NVML return code into hfsampler's exception classes.
The catalogue names a per-device call by key (``Field.nvml_call``); this module says which pynvml
function answers it, which older function answers it on an older driver (tried in order at open,
the first that answers kept for the device), and how one field's number is taken out of what the
call returns (several fields share one call: memory, utilization). NVLink's link state is asked
here too. Last, the layout of ``c_nvmlFieldValue_t`` as a numpy dtype for the batched hot path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pynvml

from hfsampler.errors import DriverNotFoundError, FieldNotSupportedError, GpuLostError, SourceError

Reader = Callable[[Any], Any]  # device handle -> what the pynvml call returns
Extract = Callable[[Any], float | None]  # that result -> one field's NVML value (None: none)

# The codes that say "this device or driver does not have it": the field is skipped, not an error.
UNSUPPORTED_CODES = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,  # an old driver refusing a field id it does not know
        pynvml.NVML_ERROR_NO_PERMISSION,  # some fields need root; skipping them is all we can do
    }
)
LOST_CODES = frozenset(
    {
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_GPU_NOT_FOUND,
        pynvml.NVML_ERROR_RESET_REQUIRED,
    }
)
DRIVER_CODES = frozenset(
    {
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        pynvml.NVML_ERROR_UNINITIALIZED,
    }
)
UNKNOWN_CODE: int = pynvml.NVML_ERROR_UNKNOWN
SUCCESS: int = pynvml.NVML_SUCCESS
NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
FUNCTION_NOT_FOUND: int = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
LIBRARY_NOT_FOUND: int = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
DRIVER_NOT_LOADED: int = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
NO_PERMISSION: int = pynvml.NVML_ERROR_NO_PERMISSION
NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT

# What every call below raises (pynvml's own class; ``int(e.value)`` is the return code). Where a
# failure leaves the nvml source, ``translate`` turns it into one of hfsampler's exceptions.
NvmlError: Any = pynvml.NVMLError
PYNVML_VERSION: str = getattr(pynvml, "__version__", "?")


def error_class(code: int) -> type[SourceError]:
    """hfsampler's exception class for an NVML return code: the one place codes are mapped."""
    if code in LOST_CODES:
        return GpuLostError
    if code in UNSUPPORTED_CODES:
        return FieldNotSupportedError
    if code in DRIVER_CODES:
        return DriverNotFoundError
    return SourceError


def error_text(code: int) -> str:
    """NVML's own short text for a code, without asking the (maybe absent) library."""
    # NVMLError.__str__ calls into libnvidia-ml for codes pynvml does not name.
    known: dict[int, str] = pynvml.NVMLError._errcode_to_string
    return known.get(code, f"NVML error {code}")


def translate(err: pynvml.NVMLError, context: str) -> SourceError:
    """An ``NVMLError`` as the hfsampler exception to raise (``raise translate(e, ...) from e``)."""
    code = int(err.value)
    return error_class(code)(f"{context}: {error_text(code)} (NVML code {code})")


# -- the library: what the nvml source, its GPM and XID parts, and gpu_check call ------------------


def init() -> None:
    """``nvmlInit``: load libnvidia-ml and take a reference (one ``shutdown`` per ``init``)."""
    pynvml.nvmlInit()


def shutdown() -> None:
    pynvml.nvmlShutdown()


def device_count() -> int:
    return int(pynvml.nvmlDeviceGetCount())


def device_handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def driver_version() -> str:
    return text(pynvml.nvmlSystemGetDriverVersion())


def device_name(handle: Any) -> str:
    return text(pynvml.nvmlDeviceGetName(handle))


def device_uuid(handle: Any) -> str:
    return text(pynvml.nvmlDeviceGetUUID(handle))


def pci_bus_id(handle: Any) -> str:
    """The PCI bus id, from the v3 struct's ``busId`` or, where that is empty, the legacy one."""
    pci = pynvml.nvmlDeviceGetPciInfo(handle)
    return text(getattr(pci, "busId", b"") or getattr(pci, "busIdLegacy", b""))


def minor_number(handle: Any) -> int:
    """The /dev/nvidiaN number (raises ``NvmlError`` on Windows/WSL, where there is none)."""
    return int(pynvml.nvmlDeviceGetMinorNumber(handle))


def field_values(handle: Any, ids: Sequence[int | tuple[int, int]]) -> Any:
    """pynvml's ``nvmlDeviceGetFieldValues``: a new array of entries (for probing, not per tick).

    An id may be a (field id, scope id) pair: the scope names a link for NVLink's fields.
    """
    return pynvml.nvmlDeviceGetFieldValues(handle, ids)


def compute_processes(handle: Any) -> list[tuple[int, int | None]]:
    """Each compute process on the device: its pid and the device memory it holds, in bytes
    (None where the driver does not say, as under WDDM)."""
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in procs]  # fmt: skip


# NVML's three process lists; the graphics and MPS ones may be missing from an older driver
PROCESS_LISTS = (
    ("compute", "nvmlDeviceGetComputeRunningProcesses_v3"),
    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses_v3"),
    ("mps", "nvmlDeviceGetMPSComputeRunningProcesses_v3"),
)
_NO_INSTANCE = 0xFFFFFFFF  # a process's gpuInstanceId outside MIG


def running_processes(handle: Any, kind: str) -> list[tuple[int, int | None, int | None]]:
    """One of the device's process lists (``kind``: compute, graphics or mps): each process's
    pid, the device memory it holds in bytes (None where the driver does not say) and its MIG
    GPU instance id (None outside MIG; on a MIG-enabled GPU's handle, the instance it is in)."""
    procs = getattr(pynvml, dict(PROCESS_LISTS)[kind])(handle)
    return [
        (
            int(p.pid),
            None if p.usedGpuMemory is None else int(p.usedGpuMemory),
            None if int(p.gpuInstanceId) == _NO_INSTANCE else int(p.gpuInstanceId),
        )
        for p in procs
    ]


def process_utilization(handle: Any, since_us: int) -> list[tuple[int, int, int]]:
    """Per-process samples newer than ``since_us`` (the CPU clock, µs): pid, the sample's
    timestamp, its SM utilisation in percent; [] when the driver has none yet."""
    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except pynvml.NVMLError as e:
        # NOT_FOUND: no sample since then; SUCCESS: pynvml raises it for an empty first answer
        if int(e.value) in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):
            return []
        raise
    return [(int(x.pid), int(x.timeStamp), int(x.smUtil)) for x in samples]


def c_function(name: str) -> Any:
    """The C entry point itself, for the hot path: pynvml's wrappers allocate on every call.

    Called with ctypes arguments, it returns the NVML return code instead of raising. Raises
    ``NvmlError`` (FUNCTION_NOT_FOUND) where it cannot be looked up, a pynvml without the private
    helper included.
    """
    lookup = getattr(pynvml, "_nvmlGetFunctionPointer", None)
    if lookup is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    return lookup(name)


def field_values_into(handle: Any, count: int, entries: Any) -> int:
    """``nvmlDeviceGetFieldValues``'s C entry point, done with pynvml's public call instead.

    For when ``c_function`` cannot look the entry point up: ``entries`` (``count`` FieldValue,
    their ``fieldId`` set) are filled in place and the NVML return code returned, as the C
    function does. Slower: pynvml builds a new array on every call.
    """
    ids = [int(entries[k].fieldId) for k in range(count)]
    try:
        out = pynvml.nvmlDeviceGetFieldValues(handle, ids)
    except pynvml.NVMLError as e:
        return int(e.value)
    ctypes.memmove(entries, out, FIELD_VALUE_SIZE * count)
    return SUCCESS


# -- MIG (A100, H100, H200) -----------------------------------------------------------------------


def mig_enabled(handle: Any) -> bool:
    """Whether MIG mode is on now (raises ``NvmlError``, NOT_SUPPORTED, on a GPU without MIG)."""
    current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def max_mig_devices(handle: Any) -> int:
    """How many MIG devices the GPU can hold at most (7 on A100/H100/H200)."""
    return int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))


def mig_device_handle(handle: Any, index: int) -> Any:
    """The MIG device at ``index`` (raises ``NvmlError``, NOT_FOUND, where there is none)."""
    return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)


def gpu_instance_id(mig_handle: Any) -> int:
    return int(pynvml.nvmlDeviceGetGpuInstanceId(mig_handle))


def compute_instance_id(mig_handle: Any) -> int:
    return int(pynvml.nvmlDeviceGetComputeInstanceId(mig_handle))


def mig_profile(mig_handle: Any) -> str:
    """The instance's profile as NVML names it (``3g.71gb``), from the MIG device's name.

    NVML names a MIG device ``<GPU name> MIG <profile>`` (``NVIDIA H200 MIG 3g.71gb``), the
    name nvidia-smi and dcgm-exporter's ``GPU_I_PROFILE`` show; a name without that part is
    given whole rather than guessed at.
    """
    name = text(pynvml.nvmlDeviceGetName(mig_handle))
    _, sep, profile = name.rpartition(" MIG ")
    return profile.strip() if sep and profile.strip() else name


def gpm_mig_sample_function() -> Any:
    """``nvmlGpmMigSampleGet``'s C entry point: (parent handle, GPU instance id, sample)."""
    return c_function("nvmlGpmMigSampleGet")


# -- NVLink ----------------------------------------------------------------------------------------

# Links NVML may number on a device; the probe stops at the first link the driver does not know.
NVLINK_MAX_LINKS: int = int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))


def nvlink_active(handle: Any, link: int) -> bool:
    """``nvmlDeviceGetNvLinkState``: whether ``link`` is up (raises for a link there is not)."""
    state = int(pynvml.nvmlDeviceGetNvLinkState(handle, link))
    return state == int(pynvml.NVML_FEATURE_ENABLED)


# -- XID events ------------------------------------------------------------------------------------

XID_CRITICAL: int = pynvml.nvmlEventTypeXidCriticalError


def event_set() -> Any:
    return pynvml.nvmlEventSetCreate()


def register_events(handle: Any, event_types: int, events: Any) -> None:
    pynvml.nvmlDeviceRegisterEvents(handle, event_types, events)


def wait_event(events: Any, timeout_ms: int) -> Any:
    """The next event (``device``, ``eventType``, ``eventData``); raises on timeout."""
    return pynvml.nvmlEventSetWait(events, timeout_ms)


def free_event_set(events: Any) -> None:
    pynvml.nvmlEventSetFree(events)


# -- GPM (Hopper and newer) ------------------------------------------------------------------------


def gpm_metric_id(constant: str) -> int | None:
    """The value of a pynvml ``NVML_GPM_METRIC_*`` constant, or None where this pynvml lacks it."""
    return _int_constant(constant)


def gpm_supported(handle: Any) -> bool:
    """Whether the device has GPM (raises ``NvmlError`` where the driver cannot say)."""
    return bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)


def gpm_sample_alloc() -> Any:
    return pynvml.nvmlGpmSampleAlloc()


def gpm_sample_free(sample: Any) -> None:
    pynvml.nvmlGpmSampleFree(sample)


def gpm_sample_get(handle: Any, sample: Any) -> None:
    pynvml.nvmlGpmSampleGet(handle, sample)


def gpm_metrics_get(request: Any) -> None:
    """Compute ``request``'s metrics between its two samples (per metric ``nvmlReturn``)."""
    pynvml.nvmlGpmMetricsGet(request)


def gpm_metrics_request(metric_ids: Sequence[int]) -> Any:
    """A ``c_nvmlGpmMetricsGet_t`` with its version, count and metric ids set, samples unset."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(metric_ids)
    for i, metric in enumerate(metric_ids):
        request.metrics[i].metricId = metric
    return request


# -- the catalogue's per-device calls --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CallField:
    """How one catalogue call key is read: the shared reader's key and the extractor."""

    reader: str
    extract: Extract


def _value(raw: Any) -> float:
    return float(raw)


def _first(raw: Any) -> float:
    # Encoder/decoder utilization come back as [percent, sampling period us].
    return float(raw[0])


def _attr(name: str) -> Extract:
    def extract(raw: Any) -> float | None:
        v = getattr(raw, name, None)
        return None if v is None else float(v)

    return extract


@dataclass(frozen=True, slots=True)
class Stamped:
    """A call's reading with the driver's timestamp of it (µs), for a field that is a rate."""

    value: float
    timestamp_us: int


# nvml.h: a throughput field's scopeId names the link, UINT_MAX sums every link
ALL_LINKS = 0xFFFFFFFF
# (valueType, its name in FIELD_VALUE_DTYPE: c_nvmlValue_t's member without "Val")
VALUE_TYPES: tuple[tuple[int, str], ...] = (
    (pynvml.NVML_VALUE_TYPE_DOUBLE, "d"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "ui"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, "ul"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ull"),
    (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sll"),
    (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "si"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "us"),
)
_VALUE_NAMES = dict(VALUE_TYPES)


def _nvlink_data_kib(handle: Any) -> Stamped:
    """NVLink data moved over every link, TX and RX summed (KiB since the driver loaded).

    DCGM's DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL is made from the same two counters (NVML's
    ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX`` and ``_RX``, payload without protocol headers),
    summed and differenced between its polls. Raises with the driver's code where either
    answers an error (NOT_SUPPORTED on a GPU without NVLink).
    """
    ids = [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
           (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS)]  # fmt: skip
    total, stamp = 0.0, 0
    for entry in pynvml.nvmlDeviceGetFieldValues(handle, ids):
        if entry.nvmlReturn != SUCCESS:
            raise pynvml.NVMLError(int(entry.nvmlReturn))
        member = _VALUE_NAMES.get(int(entry.valueType), "ull") + "Val"  # c_nvmlValue_t's
        total += float(getattr(entry.value, member))
        stamp = max(stamp, int(entry.timestamp))
    return Stamped(total, stamp)


CALL_FIELDS: dict[str, CallField] = {
    "clock_sm": CallField("clock_sm", _value),
    "clock_mem": CallField("clock_mem", _value),
    "temperature_gpu": CallField("temperature_gpu", _value),
    "power_usage": CallField("power_usage", _value),
    "total_energy": CallField("total_energy", _value),
    "power_limit": CallField("power_limit", _value),  # the enforced one
    "power_mgmt_limit": CallField("power_mgmt_limit", _value),  # the one set
    "util_gpu": CallField("utilization", _attr("gpu")),
    "util_mem": CallField("utilization", _attr("memory")),
    "util_enc": CallField("encoder", _first),
    "util_dec": CallField("decoder", _first),
    "xid": CallField("xid", _value),  # the reader is the source's event-set poll
    "xid_count": CallField("xid", _value),  # per code: read from the watcher, not extracted
    "fb_total": CallField("memory", _attr("total")),
    "fb_free": CallField("memory", _attr("free")),
    "fb_used": CallField("memory", _attr("used")),
    "fb_reserved": CallField("memory", _attr("reserved")),  # v1 struct has none: unsupported
    "clocks_event_reasons": CallField("clocks_event_reasons", _value),
    "fan": CallField("fan", _value),
    "pstate": CallField("pstate", _value),
    "nvlink_data_kib": CallField("nvlink_data", _attr("value")),
}


def _memory_v2(handle: Any) -> Any:
    return pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)


def _memory_v1(handle: Any) -> Any:
    return pynvml.nvmlDeviceGetMemoryInfo(handle)


def _clocks_event_reasons(handle: Any) -> Any:
    return pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)


def _clocks_throttle_reasons(handle: Any) -> Any:
    # The same bits under the name drivers before 535 export.
    return pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)


# Per reader key, the calls to try in order: the first one the driver answers is kept for the
# device (version differences probed once at open, never on the hot path).
READERS: dict[str, tuple[Reader, ...]] = {
    "clock_sm": (lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),),
    "clock_mem": (lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),),
    "temperature_gpu": (lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),),
    "power_usage": (lambda h: pynvml.nvmlDeviceGetPowerUsage(h),),
    "total_energy": (lambda h: pynvml.nvmlDeviceGetTotalEnergyConsumption(h),),
    "power_limit": (lambda h: pynvml.nvmlDeviceGetEnforcedPowerLimit(h),),
    "power_mgmt_limit": (lambda h: pynvml.nvmlDeviceGetPowerManagementLimit(h),),
    "utilization": (lambda h: pynvml.nvmlDeviceGetUtilizationRates(h),),
    "encoder": (lambda h: pynvml.nvmlDeviceGetEncoderUtilization(h),),
    "decoder": (lambda h: pynvml.nvmlDeviceGetDecoderUtilization(h),),
    "memory": (_memory_v2, _memory_v1),
    "clocks_event_reasons": (_clocks_event_reasons, _clocks_throttle_reasons),
    "fan": (lambda h: pynvml.nvmlDeviceGetFanSpeed(h),),
    "pstate": (lambda h: pynvml.nvmlDeviceGetPerformanceState(h),),
    "nvlink_data": (_nvlink_data_kib,),
}


def field_id(constant: str) -> int | None:
    """The value of a pynvml ``NVML_FI_*`` constant, or None where this pynvml lacks it."""
    return _int_constant(constant)


def _int_constant(name: str) -> int | None:
    # Looked up when asked, not at import: a catalogue entry may name a newer pynvml's constant.
    value = getattr(pynvml, name, None)
    return value if isinstance(value, int) else None


def text(raw: Any) -> str:
    """A pynvml string result as str (pynvml returns bytes from some calls and versions)."""
    if isinstance(raw, bytes):
        return raw.decode(errors="replace")
    return str(raw)


FieldValue: Any = pynvml.c_nvmlFieldValue_t  # one entry of a batched field-value read
FIELD_VALUE_SIZE = ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
_VALUE_OFFSET = pynvml.c_nvmlFieldValue_t.value.offset
_ULONG = "<u8" if ctypes.sizeof(ctypes.c_ulong) == 8 else "<u4"
# c_nvmlFieldValue_t as numpy sees it, the value union as overlapping fields, so a whole
# [gpu, field] block converts in a few vectorised operations instead of per-entry ctypes access.
_ENTRY_HEAD = (  # (member, format) of the entry before its value union
    ("fieldId", "<u4"),
    ("scopeId", "<u4"),
    ("timestamp", "<i8"),
    ("valueType", "<u4"),
    ("nvmlReturn", "<u4"),
)
FIELD_VALUE_DTYPE = np.dtype(
    {
        "names": [*(n for n, _ in _ENTRY_HEAD), *(n for _, n in VALUE_TYPES)],
        "formats": [*(f for _, f in _ENTRY_HEAD), "<f8", "<u4", _ULONG, "<u8", "<i8", "<i4", "<u2"],
        "offsets": [
            *(getattr(pynvml.c_nvmlFieldValue_t, n).offset for n, _ in _ENTRY_HEAD),
            *([_VALUE_OFFSET] * len(VALUE_TYPES)),
        ],
        "itemsize": FIELD_VALUE_SIZE,
    }
)

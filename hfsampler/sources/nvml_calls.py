"""NVML's per-device calls and error codes, as the nvml source sees them.

The catalogue names a call by key (``Field.nvml_call``); this module says which pynvml function
answers it, which older function answers it on an older driver, and how one field's number is
taken out of what the call returns (several fields share one call: memory, utilization). It also
holds the one table that turns an NVML return code into hfsampler's exception classes, and the
layout of ``c_nvmlFieldValue_t`` as a numpy dtype.

Only this module and ``hfsampler.sources.nvml`` import ``pynvml``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
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


CALL_FIELDS: dict[str, CallField] = {
    "clock_sm": CallField("clock_sm", _value),
    "clock_mem": CallField("clock_mem", _value),
    "temperature_gpu": CallField("temperature_gpu", _value),
    "power_usage": CallField("power_usage", _value),
    "total_energy": CallField("total_energy", _value),
    "power_limit": CallField("power_limit", _value),
    "util_gpu": CallField("utilization", _attr("gpu")),
    "util_mem": CallField("utilization", _attr("memory")),
    "util_enc": CallField("encoder", _first),
    "util_dec": CallField("decoder", _first),
    "xid": CallField("xid", _value),  # the reader is the source's event-set poll
    "fb_free": CallField("memory", _attr("free")),
    "fb_used": CallField("memory", _attr("used")),
    "fb_reserved": CallField("memory", _attr("reserved")),  # v1 struct has none: unsupported
    "clocks_event_reasons": CallField("clocks_event_reasons", _value),
    "fan": CallField("fan", _value),
    "pstate": CallField("pstate", _value),
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
    "utilization": (lambda h: pynvml.nvmlDeviceGetUtilizationRates(h),),
    "encoder": (lambda h: pynvml.nvmlDeviceGetEncoderUtilization(h),),
    "decoder": (lambda h: pynvml.nvmlDeviceGetDecoderUtilization(h),),
    "memory": (_memory_v2, _memory_v1),
    "clocks_event_reasons": (_clocks_event_reasons, _clocks_throttle_reasons),
    "fan": (lambda h: pynvml.nvmlDeviceGetFanSpeed(h),),
    "pstate": (lambda h: pynvml.nvmlDeviceGetPerformanceState(h),),
}


def field_id(constant: str) -> int | None:
    """The value of a pynvml ``NVML_FI_*`` constant, or None where this pynvml lacks it."""
    value = getattr(pynvml, constant, None)
    return value if isinstance(value, int) else None


def text(raw: Any) -> str:
    """A pynvml string result as str (pynvml returns bytes from some calls and versions)."""
    if isinstance(raw, bytes):
        return raw.decode(errors="replace")
    return str(raw)


FIELD_VALUE_SIZE = ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
_VALUE_OFFSET = pynvml.c_nvmlFieldValue_t.value.offset
_ULONG = "<u8" if ctypes.sizeof(ctypes.c_ulong) == 8 else "<u4"
# (valueType, name of its union member in FIELD_VALUE_DTYPE)
VALUE_TYPES: tuple[tuple[int, str], ...] = (
    (pynvml.NVML_VALUE_TYPE_DOUBLE, "d"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "ui"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, "ul"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ull"),
    (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sll"),
    (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "si"),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "us"),
)
# c_nvmlFieldValue_t as numpy sees it, the value union as overlapping fields, so a whole
# [gpu, field] block converts in a few vectorised operations instead of per-entry ctypes access.
FIELD_VALUE_DTYPE = np.dtype(
    {
        "names": ["fieldId", "timestamp", "valueType", "nvmlReturn", *(n for _, n in VALUE_TYPES)],
        "formats": ["<u4", "<i8", "<u4", "<u4", "<f8", "<u4", _ULONG, "<u8", "<i8", "<i4", "<u2"],
        "offsets": [
            pynvml.c_nvmlFieldValue_t.fieldId.offset,
            pynvml.c_nvmlFieldValue_t.timestamp.offset,
            pynvml.c_nvmlFieldValue_t.valueType.offset,
            pynvml.c_nvmlFieldValue_t.nvmlReturn.offset,
            *([_VALUE_OFFSET] * len(VALUE_TYPES)),
        ],
        "itemsize": FIELD_VALUE_SIZE,
    }
)

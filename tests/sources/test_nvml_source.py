"""The NVML source against a fake libnvidia-ml under the real pynvml."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pynvml
import pytest
from fake_nvml import FakeNvml, FakeReading, install, make_fake, nvlink_gpu, remove_library

from hfsampler import fields as F
from hfsampler.errors import DriverNotFoundError, FieldNotSupportedError, GpuLostError, SourceError
from hfsampler.fields import Field
from hfsampler.sources.base import SourceSpec
from hfsampler.sources.nvml import calls as nvml_calls
from hfsampler.sources.nvml.health import UNKNOWN_LIMIT
from hfsampler.sources.nvml.source import NvmlSource, probe_driver
from hfsampler.sources.registry import open_source

FAST = tuple(f for f in F.CATALOGUE if f.group == F.FAST and f.nvml_readable)
POWER = F.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]  # field id with a call fallback
INSTANT = F.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"]  # field id only
MEM_TEMP = F.BY_NAME["DCGM_FI_DEV_MEMORY_TEMP"]
SM_CLOCK = F.BY_NAME["DCGM_FI_DEV_SM_CLOCK"]
FB_USED = F.BY_NAME["DCGM_FI_DEV_FB_USED"]
FB_RESERVED = F.BY_NAME["DCGM_FI_DEV_FB_RESERVED"]
REASONS = F.BY_NAME["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]
XID = F.BY_NAME["DCGM_FI_DEV_XID_ERRORS"]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    f = install(monkeypatch, make_fake(3))
    f.clock_us = lambda: 5_000_000
    return f


@pytest.fixture
def source() -> Iterator[NvmlSource]:
    s = NvmlSource()
    yield s
    s.close()


def read(
    s: NvmlSource, fields: Sequence[Field], now_ns: int = 7_000_000_000
) -> tuple[np.ndarray, np.ndarray]:
    values = np.zeros((len(s.gpu_up), len(fields)))
    ts = np.zeros((len(s.gpu_up), len(fields)), dtype=np.int64)
    s.read(fields, values, ts, now_ns)
    return values, ts


def test_discovery_and_labels(fake: FakeNvml, source: NvmlSource) -> None:
    inv = source.open(F.CATALOGUE)
    assert [d.index for d in inv.devices] == [0, 1, 2]
    d = inv.devices[1]
    assert d.uuid == "GPU-00000001-1111-2222-3333-444455556666"
    assert d.model_name == "NVIDIA H100 80GB HBM3"
    assert d.pci_bus_id == "00000000:18:00.0"
    assert d.driver_version == "570.133.20"
    assert d.minor_number == 1
    assert d.device == "nvidia1"
    assert inv.supported.shape == (3, len(F.CATALOGUE))
    # every field NVML has a way to read; a Jetson's rails and zones are not NVML's, and these
    # GPUs have no NVLink: the per-link fields stay unexpanded, supported nowhere, and the
    # all-links data counters (scopeId UINT_MAX) answer NOT_SUPPORTED
    nvlink = [f.per == "link" or f.nvml_call == "nvlink_data_kib" for f in F.CATALOGUE]
    readable = [f.nvml_readable and not n for f, n in zip(F.CATALOGUE, nvlink, strict=True)]
    assert (inv.supported.all(axis=0) == readable).all()
    assert source.gpu_up.tolist() == [True, True, True]


def test_indices_select_gpus(fake: FakeNvml) -> None:
    s = NvmlSource(indices=(2,))
    try:
        inv = s.open((INSTANT,))
        assert [d.index for d in inv.devices] == [2]
        values, _ = read(s, (INSTANT,))
        assert values[0, 0] == pytest.approx(310.002)  # GPU 2: base 310_002 mW
    finally:
        s.close()


def test_batched_values_scale_and_timestamps(fake: FakeNvml, source: NvmlSource) -> None:
    source.open(FAST)
    fake.calls.clear()
    values, ts = read(source, FAST)
    # One batched call per GPU per tick for the field ids, whatever their number.
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3
    col = {f.name: k for k, f in enumerate(FAST)}
    # 5 s on the fake clock: POWER_INSTANT refreshes every 20 ms, 250 refreshes -> step 0.
    assert values[0, col[INSTANT.name]] == pytest.approx(310.0)  # mW * 1e-3
    assert values[1, col[INSTANT.name]] == pytest.approx(310.001)
    assert ts[0, col[INSTANT.name]] == 5_000_000
    assert values[0, col[SM_CLOCK.name]] == pytest.approx(1980.0 - 15 * (500 % 3))
    assert values[0, col[FB_USED.name]] == pytest.approx(1024 * (10 + 5000 % 7))  # bytes -> MiB
    assert values[0, col[FB_RESERVED.name]] == pytest.approx(512.0)
    # Call-based fields carry the read time, for want of a driver timestamp.
    assert ts[0, col[SM_CLOCK.name]] == 7_000_000
    assert not np.isnan(values).any()


def test_every_value_type_converts(fake: FakeNvml, source: NvmlSource) -> None:
    for vt, v in [
        (pynvml.NVML_VALUE_TYPE_DOUBLE, 45.5),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 4_000_000_000),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, 2**40),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 2**50),
        (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, -(2**40)),
        (pynvml.NVML_VALUE_TYPE_SIGNED_INT, -7),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, 65535),
    ]:
        fake.gpus[0].fields[pynvml.NVML_FI_DEV_MEMORY_TEMP] = FakeReading(v, 1000, vt)
        if vt == pynvml.NVML_VALUE_TYPE_DOUBLE:
            source.open((MEM_TEMP,))
        values, _ = read(source, (MEM_TEMP,))
        assert values[0, 0] == v, vt


def test_not_supported_field_skipped_with_one_log_line(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    for gpu in fake.gpus:
        del gpu.fields[pynvml.NVML_FI_DEV_MEMORY_TEMP]
    fields = (INSTANT, MEM_TEMP)
    with caplog.at_level(logging.INFO, logger="hfsampler.sources.nvml.source"):
        inv = source.open(fields)
        for _ in range(5):
            values, ts = read(source, fields)
    assert inv.supported[:, 1].tolist() == [False, False, False]
    assert inv.supported[:, 0].all()
    lines = [r.getMessage() for r in caplog.records if MEM_TEMP.name in r.getMessage()]
    assert len(lines) == 1, lines
    assert "GPU 0,1,2" in lines[0]
    assert "Not Supported" in lines[0]
    assert np.isnan(values[:, 1]).all()
    assert (ts[:, 1] == 0).all()
    assert not np.isnan(values[:, 0]).any()
    assert source.read_errors.tolist() == [0, 0, 0]  # known-unsupported is not an error


def test_a_jetsons_own_fields_are_not_nvmls_and_cost_no_warning(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hfsampler.sources.nvml.source"):
        inv = source.open(F.CATALOGUE)
    jetson_only = [k for k, f in enumerate(F.CATALOGUE) if not f.nvml_readable]
    assert jetson_only
    assert not inv.supported[:, jetson_only].any()
    assert not [r for r in caplog.records if "hfsampler_jetson" in r.getMessage()]


def test_field_id_function_not_found_falls_back_to_call(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    fake.missing.add("nvmlDeviceGetFieldValues")  # a driver from before field values
    with caplog.at_level(logging.INFO, logger="hfsampler.sources.nvml.source"):
        inv = source.open((POWER, INSTANT))
    assert inv.supported[:, 0].all()  # read with nvmlDeviceGetPowerUsage instead
    assert not inv.supported[:, 1].any()  # no call to fall back to
    fake.calls.clear()
    values, _ = read(source, (POWER, INSTANT))
    assert values[:, 0] == pytest.approx([300.0, 300.001, 300.002])
    assert np.isnan(values[:, 1]).all()
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum(POWER.name in m and "power_usage" in m for m in messages) == 1
    assert sum(INSTANT.name in m and "Function Not Found" in m for m in messages) == 1


def test_entry_not_supported_on_one_gpu_falls_back_there_only(
    fake: FakeNvml, source: NvmlSource
) -> None:
    fake.gpus[1].fields[pynvml.NVML_FI_DEV_POWER_AVERAGE].ret = pynvml.NVML_ERROR_NOT_SUPPORTED
    source.open((POWER,))
    fake.calls.clear()
    values, ts = read(source, (POWER,))
    assert values[:, 0] == pytest.approx([300.0, 300.001, 300.002])
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1
    assert ts[1, 0] == 7_000_000
    assert ts[0, 0] == 5_000_000


def test_call_function_not_found_uses_older_call(fake: FakeNvml, source: NvmlSource) -> None:
    fake.missing.add("nvmlDeviceGetCurrentClocksEventReasons")
    fake.gpus[0].readings["clocks_event_reasons"].value = 0x4
    inv = source.open((REASONS,))
    assert inv.supported.all()
    values, _ = read(source, (REASONS,))
    assert values[:, 0].tolist() == [4.0, 0.0, 0.0]
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] >= 3


def test_call_missing_everywhere_is_unsupported(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    fake.missing |= {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetMemoryInfo_v2"}
    fake.missing.add("nvmlDeviceGetCurrentClocksThrottleReasons")
    with caplog.at_level(logging.WARNING, logger="hfsampler.sources.nvml.source"):
        inv = source.open((REASONS, FB_USED, FB_RESERVED))
    assert inv.supported.tolist() == [[False, True, False]] * 3  # v1 memory struct: no reserved
    assert len([r for r in caplog.records if REASONS.name in r.getMessage()]) == 1
    values, _ = read(source, (REASONS, FB_USED, FB_RESERVED))
    assert np.isnan(values[:, 0]).all()
    assert np.isnan(values[:, 2]).all()
    assert not np.isnan(values[:, 1]).any()


def test_repeated_driver_timestamps_are_kept(fake: FakeNvml, source: NvmlSource) -> None:
    now = [5_000_000]
    fake.clock_us = lambda: now[0]
    source.open((INSTANT,))
    seen = []
    for t in (5_000_000, 5_001_000, 5_019_999, 5_020_000):
        now[0] = t
        _, ts = read(source, (INSTANT,))
        seen.append(int(ts[0, 0]))
    # POWER_INSTANT refreshes every 20 ms: the first three reads see the same sample.
    assert seen == [5_000_000, 5_000_000, 5_000_000, 5_020_000]


def test_entry_error_is_nan_and_counted(fake: FakeNvml, source: NvmlSource) -> None:
    source.open((INSTANT, MEM_TEMP))
    fake.gpus[2].fields[pynvml.NVML_FI_DEV_POWER_INSTANT].ret = pynvml.NVML_ERROR_TIMEOUT
    values, ts = read(source, (INSTANT, MEM_TEMP))
    assert np.isnan(values[2, 0])
    assert ts[2, 0] == 0
    assert not np.isnan(values[2, 1])
    assert not np.isnan(values[:2]).any()
    assert source.read_errors.tolist() == [0, 0, 1]
    assert source.gpu_up.all()


def test_gpu_lost_mid_run(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    fields = (INSTANT, SM_CLOCK, FB_USED)
    source.open(fields)
    read(source, fields)
    fake.gpus[1].lost = True
    with caplog.at_level(logging.ERROR, logger="hfsampler.sources.nvml.source"):
        for _ in range(3):
            values, _ = read(source, fields)
    assert source.gpu_up.tolist() == [True, False, True]
    assert np.isnan(values[1]).all()
    assert not np.isnan(values[[0, 2]]).any()
    assert len([r for r in caplog.records if "stopped answering" in r.getMessage()]) == 1
    fake.calls.clear()
    read(source, fields)
    assert fake.calls["nvmlDeviceGetFieldValues"] == 2  # the lost GPU is no longer asked


def test_gpu_lost_on_a_call(fake: FakeNvml, source: NvmlSource) -> None:
    source.open((SM_CLOCK, FB_USED))
    fake.gpus[0].errors["nvmlDeviceGetClockInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    values, _ = read(source, (SM_CLOCK, FB_USED))
    assert source.gpu_up.tolist() == [False, True, True]
    assert np.isnan(values[0]).all()
    assert not np.isnan(values[1:]).any()


def test_repeated_unknown_takes_gpu_down(fake: FakeNvml, source: NvmlSource) -> None:
    source.open((INSTANT,))
    fake.gpus[0].errors["nvmlDeviceGetFieldValues"] = pynvml.NVML_ERROR_UNKNOWN
    for _ in range(UNKNOWN_LIMIT - 1):
        values, _ = read(source, (INSTANT,))
        assert np.isnan(values[0, 0])
    assert source.gpu_up[0]
    read(source, (INSTANT,))
    assert not source.gpu_up[0]
    assert source.gpu_up[1:].all()


def test_unknown_streak_resets_on_success(fake: FakeNvml, source: NvmlSource) -> None:
    source.open((INSTANT,))
    errors = fake.gpus[0].errors
    for _ in range(3):
        errors["nvmlDeviceGetFieldValues"] = pynvml.NVML_ERROR_UNKNOWN
        for _ in range(UNKNOWN_LIMIT - 1):
            read(source, (INSTANT,))
        del errors["nvmlDeviceGetFieldValues"]
        read(source, (INSTANT,))
    assert source.gpu_up.all()


def test_xid_events(fake: FakeNvml, source: NvmlSource) -> None:
    source.open((XID,))
    values, _ = read(source, (XID,))
    assert values[:, 0].tolist() == [0.0, 0.0, 0.0]
    fake.gpus[1].xids += [13, 79]
    values, _ = read(source, (XID,))
    assert values[:, 0].tolist() == [0.0, 79.0, 0.0]
    values, _ = read(source, (XID,))
    assert values[:, 0].tolist() == [0.0, 79.0, 0.0]  # the last XID stays


XID_EVENTS = F.BY_NAME["hfsampler_xid_events_total"]


def _xid_column(fields: Sequence[Field], label: str) -> int:
    return next(k for k, f in enumerate(fields) if f.labels == (("xid", label),))


def test_xid_bursts_counted_per_code(fake: FakeNvml, source: NvmlSource) -> None:
    inv = source.open(F.expand_xid((XID, XID_EVENTS)))
    opened = inv.fields
    assert opened[0] is XID
    assert [dict(f.labels)["xid"] for f in opened[1:]] == list(F.XID_LABELS)
    assert inv.supported.all()
    c79, c48, other = (_xid_column(opened, x) for x in ("79", "48", F.XID_OTHER))
    values, ts = read(source, opened)
    assert (values[:, 1:] == 0).all()  # every tracked code is there at 0 before its first event
    assert (ts[:, 1:] == 7_000_000).all()
    # a burst on two GPUs between two reads: every event is counted, under its own code
    fake.xid_burst(1, 48, 3)
    fake.xid_burst(1, 79, 5)
    fake.xid_burst(1, 200, 2)  # not a tracked code
    fake.xid_burst(2, 94, 1)
    values, _ = read(source, opened)
    assert values[:, 0].tolist() == [0.0, 200.0, 94.0]  # the last code, as before
    assert values[1, [c48, c79, other]].tolist() == [3.0, 5.0, 2.0]
    assert values[2, _xid_column(opened, "94")] == 1.0
    assert values[1].sum() - values[1, 0] == 10.0
    assert values[0, 1:].sum() == 0.0
    # cumulative: the next burst adds to what was counted, a read without events keeps it
    fake.xid_burst(1, 79, 4)
    read(source, opened)
    values, _ = read(source, opened)
    assert values[1, [c48, c79, other]].tolist() == [3.0, 9.0, 2.0]


def test_xid_counts_of_a_subset_and_a_lost_gpu(fake: FakeNvml, source: NvmlSource) -> None:
    opened = source.open(F.expand_xid((XID_EVENTS, POWER))).fields
    c79 = _xid_column(opened, "79")
    fake.xid_burst(0, 79, 2)
    fake.xid_burst(2, 79, 1)
    only = (opened[c79],)  # a group holding one code's counter still drains every event
    values, _ = read(source, only)
    assert values[:, 0].tolist() == [2.0, 0.0, 1.0]
    fake.gpus[2].lost = True
    values, ts = read(source, opened)
    assert not source.gpu_up[2]
    assert np.isnan(values[2]).all()
    assert (ts[2] == 0).all()
    assert values[0, c79] == 2.0


def test_xid_bursts_across_two_windows_lose_nothing(fake: FakeNvml, source: NvmlSource) -> None:
    from hfsampler.sampling.ring import RingRows
    from hfsampler.sampling.window import LAST, reduce

    opened = source.open(F.expand_xid((XID_EVENTS,))).fields
    c79 = _xid_column(opened, "79")
    rows = []
    # 20 ticks of 10 ms, two windows of ten; bursts land between ticks, one on the boundary
    bursts = {3: 4, 9: 2, 10: 5, 17: 1}
    for tick in range(20):
        fake.xid_burst(0, 79, bursts.get(tick, 0))
        rows.append(read(source, opened, now_ns=7_000_000_000 + tick * 10_000_000))
    values = np.stack([v for v, _ in rows])
    ts = np.stack([t for _, t in rows])
    t = 7_000_000_000 + np.arange(20, dtype=np.int64) * 10_000_000
    lasts = []
    for w in (slice(0, 10), slice(10, 20)):
        window = RingRows(t[w], np.zeros(10, dtype=np.int64), values[w], ts[w])
        lasts.append(reduce(window, opened, int(t[w][0]), int(t[w][-1]) + 1)[LAST][0, c79])
    assert lasts == [6.0, 12.0]  # the second window's increase is its 6 events
    assert lasts[1] == sum(bursts.values())


def test_xid_counter_unexpanded_counts_every_code(fake: FakeNvml, source: NvmlSource) -> None:
    source.open((XID_EVENTS,))
    fake.xid_burst(0, 79, 2)
    fake.xid_burst(0, 200, 1)
    values, _ = read(source, (XID_EVENTS,))
    assert values[:, 0].tolist() == [3.0, 0.0, 0.0]


def test_xid_counts_unsupported_without_events(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    fake.missing.add("nvmlEventSetCreate")
    with caplog.at_level(logging.WARNING):
        inv = source.open(F.expand_xid((XID_EVENTS, POWER)))
    told = [r for r in caplog.records if "hfsampler_xid_events_total" in r.getMessage()]
    assert len(told) == 1  # once, not once per code
    assert not inv.supported[:, :-1].any()
    assert inv.supported[:, -1].all()
    values, _ = read(source, inv.fields)
    assert np.isnan(values[:, :-1]).all()


def test_unopened_field_is_an_error(fake: FakeNvml, source: NvmlSource) -> None:
    source.open((INSTANT,))
    with pytest.raises(SourceError, match="not opened"):
        read(source, (MEM_TEMP,))


def test_no_driver_open_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    remove_library(monkeypatch)
    with pytest.raises(DriverNotFoundError, match="Library Not Found"):
        NvmlSource().open(FAST)


def test_driver_not_loaded_open_raises(fake: FakeNvml) -> None:
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(DriverNotFoundError, match="Driver Not Loaded"):
        NvmlSource().open(FAST)


def test_probe_driver_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, make_fake(1))
    assert probe_driver() is None
    assert fake.initialised == 0  # shut down again
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert probe_driver() == "NVIDIA driver not loaded"
    fake.init_error = pynvml.NVML_ERROR_NO_PERMISSION
    assert "permission" in (probe_driver() or "")
    fake.init_error = None
    fake.gpus.clear()
    assert "no GPU" in (probe_driver() or "")
    remove_library(monkeypatch)
    reason = probe_driver()
    assert reason is not None
    assert "libnvidia-ml" in reason


def test_close_shuts_down_once(fake: FakeNvml) -> None:
    s = NvmlSource()
    s.open(FAST)
    assert fake.initialised == 1
    s.close()
    s.close()
    assert fake.initialised == 0


def test_error_mapping() -> None:
    assert nvml_calls.error_class(pynvml.NVML_ERROR_GPU_IS_LOST) is GpuLostError
    assert nvml_calls.error_class(pynvml.NVML_ERROR_NOT_SUPPORTED) is FieldNotSupportedError
    assert nvml_calls.error_class(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND) is FieldNotSupportedError
    assert nvml_calls.error_class(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND) is DriverNotFoundError
    assert nvml_calls.error_class(pynvml.NVML_ERROR_TIMEOUT) is SourceError
    err = nvml_calls.translate(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST), "GPU 3")
    assert isinstance(err, GpuLostError)
    assert isinstance(err, RuntimeError)
    assert str(err) == "GPU 3: GPU is lost (NVML code 15)"


def test_constant_missing_from_pynvml(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    from dataclasses import replace

    newer = replace(POWER, name="X_WITH_CALL", nvml_field="NVML_FI_DEV_FROM_A_NEWER_PYNVML")
    only_id = replace(INSTANT, name="X_ID_ONLY", nvml_field="NVML_FI_DEV_FROM_A_NEWER_PYNVML")
    with caplog.at_level(logging.INFO, logger="hfsampler.sources.nvml.source"):
        inv = source.open((newer, only_id))
    assert inv.supported.tolist() == [[True, False]] * 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum("X_ID_ONLY" in m and "pynvml lacks" in m for m in messages) == 1
    values, _ = read(source, (newer, only_id))
    assert values[:, 0] == pytest.approx([300.0, 300.001, 300.002])


def test_pcie_throughput_is_the_byte_counters_rate(fake: FakeNvml, source: NvmlSource) -> None:
    tx = F.BY_NAME["DCGM_FI_DEV_PCIE_TX_THROUGHPUT"]
    rx = F.BY_NAME["DCGM_FI_DEV_PCIE_RX_THROUGHPUT"]
    now = [5_000_000]
    fake.clock_us = lambda: now[0]
    source.open((tx, rx))
    first, _ = read(source, (tx, rx))
    assert np.isnan(first).all()  # a rate needs two samples
    now[0] = 5_040_000
    second, _ = read(source, (tx, rx))
    # the fake counts 2000 and 4000 bytes per µs: 2 GB/s and 4 GB/s, exported in KB/s
    np.testing.assert_allclose(second[0], [2e9 / 1024, 4e9 / 1024])
    now[0] = 5_045_000  # inside the same 20 ms refresh: a repeat, no new rate
    _, ts = read(source, (tx, rx))
    assert ts[0, 0] == 5_040_000
    assert "nvmlDeviceGetPcieThroughput" not in fake.calls  # the 20 ms blocking call is never made


def _direct_lookup_fails(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``name``'s C entry point cannot be looked up from outside pynvml, while pynvml's own
    wrapper still reaches it (a lookup that failed at open, or a pynvml whose wrappers no longer
    go through the private helper hfsampler calls)."""
    real = pynvml._nvmlGetFunctionPointer

    def lookup(fn_name: str) -> Any:
        if fn_name == name and sys._getframe(1).f_globals.get("__name__") != "pynvml":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return real(fn_name)

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)


def test_field_values_through_pynvml_when_the_entry_point_cannot_be_looked_up(
    fake: FakeNvml,
    source: NvmlSource,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It used to crash the sampler loop: 'NoneType' object is not callable."""
    _direct_lookup_fails(monkeypatch, "nvmlDeviceGetFieldValues")
    fields = (INSTANT, MEM_TEMP, SM_CLOCK)
    with caplog.at_level(logging.INFO, logger="hfsampler.sources.nvml.source"):
        inv = source.open(fields)
        fake.calls.clear()
        for _ in range(3):
            values, ts = read(source, fields)
    assert inv.supported.all()
    assert values[:, 0] == pytest.approx([310.0, 310.001, 310.002])
    assert values[:, 1] == pytest.approx([45.0, 46.0, 47.0])
    assert (ts[:, 0] == 5_000_000).all()
    assert not np.isnan(values).any()
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3 * 3  # still one batched call per GPU
    lines = [r.getMessage() for r in caplog.records if "nvmlDeviceGetFieldValues" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "pynvml" in lines[0]
    # the driver's answers still count: an entry error, then a lost GPU
    fake.gpus[2].fields[pynvml.NVML_FI_DEV_POWER_INSTANT].ret = pynvml.NVML_ERROR_TIMEOUT
    values, _ = read(source, fields)
    assert np.isnan(values[2, 0])
    assert source.read_errors.tolist() == [0, 0, 1]
    fake.gpus[1].lost = True
    values, _ = read(source, fields)
    assert source.gpu_up.tolist() == [True, False, True]
    assert np.isnan(values[1]).all()


def test_a_pynvml_without_the_lookup_helper_is_function_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(pynvml, "_nvmlGetFunctionPointer")
    with pytest.raises(nvml_calls.NvmlError) as caught:
        nvml_calls.c_function("nvmlDeviceGetFieldValues")
    assert int(caught.value.value) == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND


def test_a_field_failing_on_one_gpu_is_said_once_and_again_when_it_reads(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    """A batched entry and a per-device call that keep failing on GPU 1 (not a lost GPU): one
    warning each when the run of failures starts, one line when they read again."""
    fields = (INSTANT, SM_CLOCK)
    source.open(fields)
    read(source, fields)
    entry = fake.gpus[1].fields[pynvml.NVML_FI_DEV_POWER_INSTANT]
    entry.ret = pynvml.NVML_ERROR_TIMEOUT
    fake.gpus[1].errors["nvmlDeviceGetClockInfo"] = pynvml.NVML_ERROR_UNKNOWN
    with caplog.at_level(logging.INFO, logger="hfsampler.sources.nvml.source"):
        for _ in range(3):  # fewer than the unknown errors that take a GPU down
            values, _ = read(source, fields)
        assert np.isnan(values[1]).all()
        entry.ret = pynvml.NVML_SUCCESS
        del fake.gpus[1].errors["nvmlDeviceGetClockInfo"]
        values, _ = read(source, fields)
        read(source, fields)
    assert not np.isnan(values).any()
    assert source.gpu_up.all()
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 2, failed
    assert any(INSTANT.name in m and "Timeout" in m for m in failed), failed
    assert any(SM_CLOCK.name in m and "Unknown Error" in m for m in failed), failed
    again = [r.getMessage() for r in caplog.records if "reads again" in r.getMessage()]
    assert len(again) == 2, again


def test_the_sampler_processs_reopen_logs_what_open_finds_at_debug_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Discovery in the service process said it; the sampler process's open must not again."""
    caplog.set_level(logging.DEBUG)
    fake = install(monkeypatch, FakeNvml(gpus=[nvlink_gpu(0, 4, down=(3,))]))
    fake.gpus[0].errors["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.gpus[0].gpm_supported = False
    fields = F.CATALOGUE

    def opened(spec: SourceSpec) -> list[logging.LogRecord]:
        caplog.clear()
        s = open_source(spec)
        try:
            s.open(fields)
        finally:
            s.close()
        return [r for r in caplog.records if r.name.startswith("hfsampler.sources")]

    first = opened(SourceSpec("nvml"))
    said = {r.getMessage() for r in first if r.levelno >= logging.INFO}
    assert any(m.startswith("DCGM_FI_DEV_GPU_UTIL not supported on GPU 0") for m in said)
    assert any("NVLink link(s) 3 not up at start" in m for m in said)
    assert any(m.startswith("GPM activity metrics") for m in said)
    again = opened(SourceSpec("nvml", reopened=True))
    assert not [r.getMessage() for r in again if r.levelno >= logging.INFO]
    assert {r.getMessage() for r in again} >= said  # at debug, for whoever looks

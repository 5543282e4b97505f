"""MIG instances: discovery at the pynvml boundary, per-instance reads, layout changes, series.

The fake libnvidia-ml answers the MIG calls with pynvml's real structs and NVML's real codes
(NOT_SUPPORTED on a GPU without MIG, NOT_FOUND for an empty MIG device index); every test drives
hfsampler through the real pynvml.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pynvml
import pytest
from fake_nvml import FakeNvml, enable_mig, install, make_fake, mig_instance

from hfsampler import fields as F
from hfsampler.config.loader import from_mapping
from hfsampler.errors import ConfigError
from hfsampler.export import attribution
from hfsampler.export.attribution_pb import podresources_pb2 as pb
from hfsampler.export.metrics import MetricModel
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.lanes import STOP, run_lanes
from hfsampler.sampling.sampler import LayoutTimeline, Sampler
from hfsampler.sampling.window import STATS, WindowStats
from hfsampler.selfmetrics import SelfMetrics
from hfsampler.series import is_stale
from hfsampler.sources.base import DeviceInfo, MigInstance, SourceSpec, physical
from hfsampler.sources.nvml.source import NvmlSource

NOW_NS = 7_000_000_000
LAYOUT = [(1, "3g.40gb"), (5, "2g.20gb"), (13, "1g.10gb")]
FIELDS = F.expand_mig(F.CATALOGUE, F.DEFAULT_GROUP_INTERVALS_S)
TWINS = tuple(f for f in FIELDS if f.mig_instance)
FB_TWINS = tuple(f for f in TWINS if not f.gpm_metric)
GPM_TWINS = tuple(f for f in TWINS if f.gpm_metric)
POWER = F.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]
FB_USED = F.BY_NAME["DCGM_FI_DEV_FB_USED"]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """GPU 0 with MIG on and three instances of mixed profiles; GPU 1 with MIG off."""
    f = install(monkeypatch, make_fake(2))
    enable_mig(f.gpus[0], 0, LAYOUT)
    f.gpus[1].mig_capable = True  # an H100 that could, with MIG mode off
    now_us = [5_000_000]
    f.clock_us = lambda: now_us[0]
    f.now_us = now_us  # type: ignore[attr-defined]
    return f


@pytest.fixture
def source() -> Iterator[NvmlSource]:
    s = NvmlSource()
    yield s
    s.close()


def _read(s: NvmlSource, fields: tuple[F.Field, ...], now_ns: int) -> np.ndarray:
    values = np.zeros((len(s.gpu_up), len(fields)))
    ts = np.zeros(values.shape, dtype=np.int64)
    s.read(fields, values, ts, now_ns)
    return values


def _col(fields: tuple[F.Field, ...], name: str) -> int:
    return next(k for k, f in enumerate(fields) if f.name == name)


def test_discovery_gives_a_slot_row_per_possible_instance(
    fake: FakeNvml, source: NvmlSource
) -> None:
    inv = source.open(FIELDS)
    assert physical(inv.devices) == [0, 1]
    slots = inv.devices[2:]
    assert len(slots) == 7  # nvmlDeviceGetMaxMigDeviceCount; GPU 1 (MIG off) has none
    assert {d.index for d in slots} == {0}
    assert all(d.uuid == inv.devices[0].uuid for d in slots)  # the parent's UUID
    found = [d.mig for d in slots if d.mig is not None]
    assert [(m.gpu_instance_id, m.profile) for m in found] == LAYOUT
    assert found[0].uuid == "MIG-00000000-0001-4444-5555-666677778888"
    assert list(source.gpu_up) == [True, True, True, True, True] + [False] * 4
    twin_cols = [k for k, f in enumerate(inv.fields) if f.mig_instance]
    gpu_cols = [k for k, f in enumerate(inv.fields) if not f.mig_instance]
    assert not inv.supported[:2, twin_cols].any()  # GPUs: no per-instance fields
    assert inv.supported[2:, twin_cols].all()  # every slot, empty or not
    assert not inv.supported[2:, gpu_cols].any()  # power, clocks, ECC: the GPU's alone


def test_no_mig_where_the_gpu_or_driver_has_none(
    monkeypatch: pytest.MonkeyPatch, source: NvmlSource
) -> None:
    f = install(monkeypatch, make_fake(2))
    f.missing.add("nvmlDeviceGetMigMode")  # GPU 0's driver predates MIG: FUNCTION_NOT_FOUND
    inv = source.open(FIELDS)  # GPU 1 answers NOT_SUPPORTED (mig_capable False)
    assert len(inv.devices) == 2
    assert not inv.supported[:, [k for k, f in enumerate(inv.fields) if f.mig_instance]].any()


def test_per_instance_memory_and_gpm(fake: FakeNvml, source: NvmlSource) -> None:
    source.open(FIELDS)
    _read(source, TWINS, NOW_NS)  # GPM: the first sample of each pair
    fake.now_us[0] += 200_000  # type: ignore[attr-defined]
    v = _read(source, TWINS, NOW_NS + 200_000_000)
    total = _col(TWINS, "DCGM_FI_DEV_FB_TOTAL")
    used, free = _col(TWINS, "DCGM_FI_DEV_FB_USED"), _col(TWINS, "DCGM_FI_DEV_FB_FREE")
    reserved = _col(TWINS, "DCGM_FI_DEV_FB_RESERVED")
    assert list(v[2:5, total]) == [40 * 1024, 20 * 1024, 10 * 1024]  # MiB, from the profile
    np.testing.assert_allclose(v[2:5, used] + v[2:5, free] + v[2:5, reserved], v[2:5, total])
    assert np.isnan(v[:2]).all()
    assert np.isnan(v[5:]).all()
    sm = _col(TWINS, "DCGM_FI_PROF_SM_ACTIVE")
    # the fake's instance activity is its GPU's scaled by its share of the seven slices
    assert v[2, sm] == pytest.approx(v[4, sm] * 3, rel=1e-6)
    assert source.read_errors.sum() == 0


def test_an_instance_without_gpm_is_skipped_quietly(fake: FakeNvml, source: NvmlSource) -> None:
    fake.gpus[0].mig[1] = mig_instance(fake.gpus[0], 0, 5, "2g.20gb", gpm=False)
    source.open(FIELDS)
    _read(source, GPM_TWINS, NOW_NS)
    fake.now_us[0] += 200_000  # type: ignore[attr-defined]
    v = _read(source, GPM_TWINS, NOW_NS + 200_000_000)
    assert not np.isnan(v[2]).any()
    assert not np.isnan(v[4]).any()
    assert np.isnan(v[3]).all()
    assert source.read_errors.sum() == 0  # NOT_SUPPORTED from nvmlGpmMigSampleGet: no error


def test_seven_one_slice_instances(monkeypatch: pytest.MonkeyPatch, source: NvmlSource) -> None:
    f = install(monkeypatch, make_fake(1))
    enable_mig(f.gpus[0], 0, [(gi, "1g.10gb") for gi in range(7, 14)])
    inv = source.open(FIELDS)
    assert [d.mig.gpu_instance_id for d in inv.devices[1:] if d.mig] == list(range(7, 14))
    assert source.gpu_up.all()


def test_a_layout_change_is_found_and_keeps_unchanged_instances_in_their_slots(
    fake: FakeNvml, source: NvmlSource
) -> None:
    source.open(FIELDS)
    before = source.devices
    _read(source, FB_TWINS, NOW_NS)
    assert source.devices is before  # nothing changed: the same tuple, nothing to publish
    gpu = fake.gpus[0]
    gpu.mig = [m for m in gpu.mig if m.gpu_instance_id != 5]  # `nvidia-smi mig -dgi -gi 5`
    gpu.mig.append(mig_instance(gpu, 0, 6, "1g.10gb"))
    gpu.mig.append(mig_instance(gpu, 0, 3, "2g.20gb"))
    v = _read(source, FB_TWINS, NOW_NS + 500_000_000)  # the gone instance's call fails...
    assert np.isnan(v[3]).all()
    assert source.devices is before  # ...and the layout is looked at on the next read
    v = _read(source, FB_TWINS, NOW_NS + 600_000_000)
    after = source.devices
    assert after is not before
    held = [(d.mig.gpu_instance_id, d.mig.profile) if d.mig else None for d in after[2:]]
    assert held == [
        (1, "3g.40gb"),
        (3, "2g.20gb"),
        (13, "1g.10gb"),
        (6, "1g.10gb"),
        None,
        None,
        None,
    ]
    assert after[2] == before[2]
    assert after[4] == before[4]
    assert list(source.gpu_up[2:]) == [True] * 4 + [False] * 3
    total = _col(FB_TWINS, "DCGM_FI_DEV_FB_TOTAL")
    assert list(v[2:6, total]) == [40 * 1024, 20 * 1024, 10 * 1024, 10 * 1024]
    # every instance destroyed: every slot empty, the GPU itself still sampled
    gpu.mig.clear()
    _read(source, FB_TWINS, NOW_NS + 2_000_000_000)
    assert not source.gpu_up[2:].any()
    assert source.gpu_up[:2].all()
    assert all(d.mig is None for d in source.devices[2:])


def test_mig_twins_never_sample_in_the_fastest_group() -> None:
    twins = [f for f in FIELDS if f.mig_instance]
    assert {f.name for f in twins} == F.MIG_INSTANCE_FIELDS
    assert all(f.group != F.FAST for f in twins)
    fb = next(f for f in twins if f.name == "DCGM_FI_DEV_FB_USED")
    assert fb.group == F.SLOW  # FB_USED itself is fast on the GPU
    only_fast = F.expand_mig([FB_USED], {"fast": 0.001})
    assert only_fast[1].group == "fast"  # one group, no slow lane: it stays


# -- series ------------------------------------------------------------------------------------


def _devices(fake_source: NvmlSource) -> tuple[DeviceInfo, ...]:
    return fake_source.open(FIELDS).devices


def _window(fields: tuple[F.Field, ...], filled: dict[int, float], rows: int) -> WindowStats:
    m = np.full((rows, len(fields)), np.nan)
    for r, v in filled.items():
        for k, f in enumerate(fields):
            if f.mig_instance == (r >= 2):
                m[r, k] = v
    c = np.where(np.isnan(m), 0, 10).astype(np.int64)
    return WindowStats(0, 1, fields, {s.name: m for s in STATS}, c)


def _model(devices: tuple[DeviceInfo, ...], fields: tuple[F.Field, ...], **kw: bool) -> MetricModel:
    return MetricModel(devices, {"g": fields}, SelfMetrics(), hostname="node1", **kw)


def test_instance_series_carry_dcgm_exporters_labels(fake: FakeNvml, source: NvmlSource) -> None:
    devices = _devices(source)
    fields = (POWER, FB_USED, *(f for f in TWINS if f.name == FB_USED.name))
    model = _model(devices, fields)
    up = source.gpu_up.copy()
    snap = model.snapshot(
        {"g": _window(fields, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}, 9)}, up, 1
    )
    fb = [dict(s.labels) for s in snap.series if s.name == "DCGM_FI_DEV_FB_USED"]
    instances = [lab for lab in fb if "GPU_I_ID" in lab]
    assert sorted((lab["GPU_I_ID"], lab["GPU_I_PROFILE"]) for lab in instances) == [
        ("1", "3g.40gb"),
        ("13", "1g.10gb"),
        ("5", "2g.20gb"),
    ]
    for lab in instances:
        assert lab["UUID"] == devices[0].uuid
        assert lab["gpu"] == "0"
        assert lab["MIG_UUID"].startswith("MIG-")
        assert lab["modelName"] == devices[0].model_name
        assert lab["device"] == "nvidia0"
        assert lab["hostname"] == "node1"
    assert len([lab for lab in fb if "GPU_I_ID" not in lab]) == 2  # each GPU's whole memory
    power = [dict(s.labels) for s in snap.series if s.name == "DCGM_FI_DEV_POWER_USAGE"]
    assert len(power) == 2
    assert not any("GPU_I_ID" in lab for lab in power)
    for s in snap.series:  # byte order with __name__ in its place, as receivers check
        names = [k for k, _ in s.all_labels()]
        assert names == sorted(names)


def test_copy_device_fields_puts_gpu_fields_on_every_instance(
    fake: FakeNvml, source: NvmlSource
) -> None:
    devices = _devices(source)
    fields = (POWER, FB_USED, *(f for f in TWINS if f.name == FB_USED.name))
    model = _model(devices, fields, copy_device_fields=True)
    up = source.gpu_up.copy()
    snap = model.snapshot(
        {"g": _window(fields, {0: 300.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}, 9)}, up, 1
    )
    power = sorted((dict(s.labels).get("GPU_I_ID", ""), v) for s, v in snap.items()
                   if s.name == "DCGM_FI_DEV_POWER_USAGE")  # fmt: skip
    # each GPU once, and GPU 0's on each of its instances
    assert power == [("", 2.0), ("", 300.0), ("1", 300.0), ("13", 300.0), ("5", 300.0)]
    fb = [(dict(s.labels).get("GPU_I_ID"), v) for s, v in snap.items()
          if s.name == "DCGM_FI_DEV_FB_USED"]  # fmt: skip
    # an instance's own memory, never the GPU's copied over it
    assert sorted(x for x in fb if x[0]) == [("1", 3.0), ("13", 5.0), ("5", 4.0)]
    keys = [(s.name, s.labels) for s in snap.series]
    assert len(keys) == len(set(keys))


def test_copying_leaves_hfsampler_s_own_counters_on_the_gpu(
    fake: FakeNvml, source: NvmlSource
) -> None:
    """An XID on a MIG GPU counts once: hfsampler's own per-GPU counters are not copied."""
    devices = _devices(source)
    xid = next(f for f in F.expand_xid(F.CATALOGUE) if f.name == "hfsampler_xid_events_total")
    fields = (POWER, xid)
    model = _model(devices, fields, copy_device_fields=True)
    snap = model.snapshot({"g": _window(fields, {0: 1.0, 1: 1.0}, 9)}, source.gpu_up.copy(), 1)
    counts = [dict(s.labels) for s in snap.series if s.name == xid.name]
    assert counts
    assert not any("GPU_I_ID" in labels for labels in counts)
    power = [dict(s.labels) for s in snap.series if s.name == POWER.name]
    assert any("GPU_I_ID" in labels for labels in power)  # dcgm-exporter's fields are copied


def test_a_new_layout_ends_the_old_instances_series(fake: FakeNvml, source: NvmlSource) -> None:
    devices = _devices(source)
    fields = tuple(f for f in TWINS if f.name == FB_USED.name)
    model = _model(devices, fields)
    window = _window(fields, {2: 3.0, 3: 4.0, 4: 5.0}, 9)
    model.snapshot({"g": window}, source.gpu_up.copy(), 1_000_000)
    gpu = fake.gpus[0]
    gpu.mig = [m for m in gpu.mig if m.gpu_instance_id != 5] + [mig_instance(gpu, 0, 6, "1g.10gb")]
    _read(source, fields, NOW_NS)  # the call on the gone instance fails: rescan next read
    _read(source, fields, NOW_NS + 1)
    model.set_devices(source.devices)
    snap = model.snapshot({"g": window}, source.gpu_up.copy(), 2_000_000)
    by_gi = {dict(s.labels)["GPU_I_ID"]: v for s, v in snap.items() if s.name == FB_USED.name}
    assert is_stale(by_gi["5"])  # the destroyed instance's series ends
    assert by_gi["6"] == 4.0
    assert by_gi["1"] == 3.0
    assert by_gi["13"] == 5.0
    later = model.snapshot({"g": window}, source.gpu_up.copy(), 3_000_000)
    assert "5" not in {dict(s.labels).get("GPU_I_ID") for s in later.series}  # marked once


# -- config and attribution --------------------------------------------------------------------


def test_copy_device_fields_config() -> None:
    assert from_mapping({"mig": {"copy_device_fields": True}}).mig_copy_device_fields
    assert not from_mapping({}).mig_copy_device_fields
    with pytest.raises(ConfigError, match=r"^mig\.copy_device_fields: .*e\.g\. "):
        from_mapping({"mig": {"copy_device_fields": "yes"}})
    with pytest.raises(ConfigError, match=r"^mig\.copy: unknown key"):
        from_mapping({"mig": {"copy": True}})


def test_pod_resources_mig_ids_map_to_their_instance(fake: FakeNvml, source: NvmlSource) -> None:
    devices = _devices(source)
    first = devices[2].mig
    third = devices[4].mig
    assert first is not None
    assert third is not None
    response = pb.ListPodResourcesResponse()
    for pod, resource, ids in (
        ("train", "nvidia.com/gpu", [devices[1].uuid]),
        ("a", "nvidia.com/mig-3g.40gb", [first.uuid]),
        ("b", "nvidia.com/mig-1g.10gb", [f"MIG-{devices[0].uuid}/13/0"]),  # older plugins
    ):
        p = response.pod_resources.add(name=pod, namespace="ml")
        p.containers.add(name="c").devices.add(resource_name=resource, device_ids=ids)
    got = attribution.pod_labels_from_response(response, devices)
    assert got[0] == {}
    assert got[1]["pod"] == "train"
    assert got[2]["pod"] == "a"
    assert got[4]["pod"] == "b"
    assert got[3] == {}


def test_job_files_named_gpu_dot_instance(
    fake: FakeNvml, source: NvmlSource, tmp_path: Path
) -> None:
    devices = _devices(source)
    (tmp_path / "0").write_text("whole-gpu\n")
    (tmp_path / "0.5").write_text("slice-job\n")
    labeller = attribution.JobMappingLabeller(str(tmp_path), devices)
    got = labeller.labels()
    assert got[0] == {"hpc_job": "whole-gpu"}
    assert got[3] == {"hpc_job": "slice-job"}
    assert got[2] == {}
    assert got[5] == {}
    gpu = fake.gpus[0]
    gpu.mig = [m for m in gpu.mig if m.gpu_instance_id != 5]
    _read(source, FB_TWINS, NOW_NS)
    _read(source, FB_TWINS, NOW_NS + 1)
    labeller.set_devices(source.devices)
    assert labeller.labels()[3] == {}


def test_mig_handles_are_real_pynvml_handles(fake: FakeNvml) -> None:
    pynvml.nvmlInit()
    try:
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetMigMode(gpu) == [1, 1]
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
        assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == 5
        assert pynvml.nvmlDeviceGetName(mig).endswith("MIG 2g.20gb")
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 3)
        other = pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceGetMigMode(other) == [0, 0]
        fake.gpus[1].mig_capable = False  # an L40S: no MIG at all
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(other)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):  # not a MIG device handle
            pynvml.nvmlDeviceGetGpuInstanceId(gpu)
    finally:
        pynvml.nvmlShutdown()


# -- from the sampler process to the windows ---------------------------------------------------


def test_the_slow_lane_publishes_a_new_layout_with_the_time_of_its_read(
    fake: FakeNvml, source: NvmlSource
) -> None:
    """run_lanes on a thread over the fake: the layout change reaches ``publish`` once, timed."""
    fake.clock_us = lambda: time.time_ns() // 1000
    inventory = source.open(FIELDS)
    fast = tuple(f for f in inventory.fields if f.name == POWER.name)
    slow = tuple(f for f in inventory.fields if f.mig_instance and not f.gpm_metric)
    groups = [GroupPlan("fast", 0.001, fast), GroupPlan("slow", 0.01, slow)]
    got: list[tuple[int, tuple[DeviceInfo, ...]]] = []
    with Sampler(SourceSpec("nvml"), inventory, groups, window_s=1.0, spin_s=0.0) as sampler:
        assert sampler.status is not None
        s = sampler.status.array
        rings = [sampler.rings[g.name] for g in groups]
        thread = threading.Thread(
            target=run_lanes,
            args=(sampler.plan, source, rings, s, os.getpid(), lambda t, d: got.append((t, d))),
            daemon=True,
        )
        thread.start()
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        gpu = fake.gpus[0]
        changed_ns = time.time_ns()
        gpu.mig = [m for m in gpu.mig if m.gpu_instance_id != 5]
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        s[STOP] = 1
        thread.join(10)
    assert len(got) == 2  # the first read's devices, then the change: nothing in between
    since_ns, devices = got[1]
    assert since_ns >= changed_ns
    assert devices[3].mig is None
    assert devices[2] == got[0][1][2]


def test_a_window_takes_the_layout_that_held_in_it() -> None:
    gpu = DeviceInfo(0, "GPU-0", "H100", "0:17", "570", 0)
    a = MigInstance(5, 0, "2g.20gb", "MIG-a")
    b = MigInstance(6, 0, "1g.10gb", "MIG-b")
    old = (gpu, replace(gpu, mig_slot=0, mig=a))
    new = (gpu, replace(gpu, mig_slot=0, mig=b))
    timeline = LayoutTimeline(old)
    timeline.add(2_500, new)  # found by the read at t = 2.5 s (ns units scaled down)
    devices, mixed = timeline.window(1_000, 2_000)  # asked late: still the old instance
    assert devices == old
    assert not mixed.any()
    devices, mixed = timeline.window(2_000, 3_000)  # a and b in one window: left out
    assert devices == new
    assert list(mixed) == [False, True]
    devices, mixed = timeline.window(3_000, 4_000)
    assert devices == new
    assert not mixed.any()
    with pytest.raises(ValueError, match="number of rows"):
        timeline.add(5_000, new[:1])


def test_a_gpu_whose_own_gpm_is_refused_in_mig_mode_keeps_its_instances(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    fake.gpus[0].errors["nvmlGpmSampleGet"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    inv = source.open(FIELDS)
    gpm = tuple(f for f in inv.fields if f.gpm_metric)
    for step in range(3):
        fake.now_us[0] += 200_000  # type: ignore[attr-defined]
        v = _read(source, gpm, NOW_NS + step * 200_000_000)
    own = [k for k, f in enumerate(gpm) if not f.mig_instance]
    twins = [k for k, f in enumerate(gpm) if f.mig_instance]
    assert np.isnan(v[0, own]).all()  # GPU 0's own: refused, skipped
    assert not np.isnan(v[1, own]).any()  # GPU 1, MIG off: as before
    assert not np.isnan(v[2:5][:, twins]).any()  # GPU 0's instances
    assert source.read_errors.sum() == 0
    assert sum("GPM samples of GPU row 0" in r.message for r in caplog.records) == 1


def test_instances_whose_driver_refuses_memory_v2_are_read_with_v1(
    fake: FakeNvml, source: NvmlSource
) -> None:
    for m in fake.gpus[0].mig:
        m.errors["nvmlDeviceGetMemoryInfo_v2"] = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    inv = source.open(FIELDS)
    fb = tuple(f for f in inv.fields if f.mig_instance and not f.gpm_metric)
    v = _read(source, fb, NOW_NS)
    assert v[2, _col(fb, "DCGM_FI_DEV_FB_TOTAL")] == 40 * 1024
    assert not np.isnan(v[2:5, _col(fb, "DCGM_FI_DEV_FB_USED")]).any()
    reserved = [k for k, f in enumerate(inv.fields) if f.name == "DCGM_FI_DEV_FB_RESERVED"]
    assert not inv.supported[2:, reserved[-1]].any()  # the v1 struct has no reserved memory
    assert source.read_errors.sum() == 0


# -- an instance that fails, a layout that cannot be read --------------------------------------


def _fail_memory(m: object, code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
    errors = m.errors  # type: ignore[attr-defined]
    errors["nvmlDeviceGetMemoryInfo_v2"] = errors["nvmlDeviceGetMemoryInfo"] = code


def test_an_instance_that_stops_answering_is_named_and_comes_back_when_it_answers(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    source.open(FIELDS)
    used = _col(FB_TWINS, "DCGM_FI_DEV_FB_USED")
    first = fake.gpus[0].mig[0]
    _fail_memory(first)
    t = NOW_NS
    for _ in range(12):  # UNKNOWN_LIMIT answers of UNKNOWN take the slot down
        t += 100_000_000
        v = _read(source, FB_TWINS, t)
    assert list(source.gpu_up[:5]) == [True, True, False, True, True]  # GPU 0 itself stays up
    assert np.isnan(v[2]).all()
    assert not np.isnan(v[3:5, used]).any()
    errors = [r.message for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert f"GPU 0 MIG instance GPU_I_ID=1 ({first.uuid}) stopped answering" in errors[0]
    assert "GPU 0 and its other instances continue" in errors[0]
    t += 2_000_000_000  # still failing: the rescans ask, it stays down, nothing said again
    _read(source, FB_TWINS, t)
    assert not source.gpu_up[2]
    first.errors.clear()  # it answers again: the next rescan (once a second) brings it back
    t += 1_100_000_000
    v = _read(source, FB_TWINS, t)
    assert source.gpu_up[2]
    assert v[2, used] > 0
    assert f"GPU 0 MIG instance GPU_I_ID=1 ({first.uuid}) answers again" in caplog.text
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1


def test_a_lost_gpus_instances_stay_down_with_it(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    source.open(FIELDS)
    fake.gpus[0].lost = True
    _read(source, FB_TWINS, NOW_NS)  # the instances find it lost first: the GPU goes down
    assert list(source.gpu_up[:5]) == [False, True, False, False, False]
    errors = [r.message for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert errors[0].startswith(f"GPU 0 ({fake.gpus[0].uuid}) stopped answering")
    fake.gpus[0].lost = False  # the GPU is not taken back; nor are its instances
    _read(source, FB_TWINS, NOW_NS + 2_000_000_000)
    assert list(source.gpu_up[:5]) == [False, True, False, False, False]


def test_an_instance_that_cannot_say_its_id_hides_only_itself(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    source.open(FIELDS)
    _read(source, FB_TWINS, NOW_NS)
    gpu = fake.gpus[0]
    gpu.mig[2].errors["nvmlDeviceGetGpuInstanceId"] = pynvml.NVML_ERROR_UNKNOWN  # a known one
    new = mig_instance(gpu, 0, 6, "1g.10gb")
    new.errors["nvmlDeviceGetGpuInstanceId"] = pynvml.NVML_ERROR_UNKNOWN
    gpu.mig = [m for m in gpu.mig if m.gpu_instance_id != 5] + [
        new,
        mig_instance(gpu, 0, 3, "2g.20gb"),
    ]
    t = NOW_NS + 1_000_000_000
    for _ in range(3):  # three rescans: the layout change is seen, the failing index said once
        _read(source, FB_TWINS, t)
        t += 1_000_000_000
    held = [d.mig.gpu_instance_id if d.mig else None for d in source.devices[2:]]
    assert held == [1, 3, 13, None, None, None, None]  # 5 went, 3 came, 13 is known by UUID
    warned = [r.message for r in caplog.records if "cannot say which instance" in r.message]
    assert len(warned) == 1
    assert warned[0].startswith("GPU 0: MIG device(s) at index 2 ")
    new.errors.clear()
    _read(source, FB_TWINS, t)
    held = [d.mig.gpu_instance_id if d.mig else None for d in source.devices[2:]]
    assert held == [1, 3, 13, 6, None, None, None]
    assert "GPU 0: its MIG layout reads whole again" in caplog.text


def test_a_slot_failing_on_every_read_forces_a_rescan_a_second_at_most(
    fake: FakeNvml, source: NvmlSource
) -> None:
    source.open(FIELDS)
    _fail_memory(fake.gpus[0].mig[1], pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)  # not a streak
    before = fake.calls["nvmlDeviceGetMigMode"]
    for k in range(1000):  # 10 s of reads every 10 ms, each failing on that slot
        _read(source, FB_TWINS, NOW_NS + k * 10_000_000)
    assert source.gpu_up[3]  # a code that is no sign of a lost instance keeps it up
    # one rescan a second, plus the one forced when the slot started failing; not one a read
    assert fake.calls["nvmlDeviceGetMigMode"] - before <= 11


def test_a_destroyed_instances_last_reads_warn_nothing_and_its_successor_starts_clean(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    source.open(FIELDS)  # says what a MIG GPU refuses (its utilization): not what is tried here
    caplog.clear()
    _read(source, FB_TWINS, NOW_NS)
    gpu = fake.gpus[0]
    gpu.mig = [m for m in gpu.mig if m.gpu_instance_id != 5]  # its handle: INVALID_ARGUMENT
    _read(source, FB_TWINS, NOW_NS + 100_000_000)
    gpu.mig.append(mig_instance(gpu, 0, 6, "1g.10gb"))  # created before the rescan looks
    for k in range(2, 5):
        v = _read(source, FB_TWINS, NOW_NS + k * 100_000_000)
    assert source.devices[3].mig is not None
    assert source.devices[3].mig.gpu_instance_id == 6
    assert v[3, _col(FB_TWINS, "DCGM_FI_DEV_FB_TOTAL")] == 10 * 1024
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "reads again" not in caplog.text  # the newcomer never failed
    assert "MIG layout changed: GPU 0 MIG slot 1: GPU instance 6" in caplog.text


def test_an_instance_still_there_whose_reads_fail_is_warned_by_its_gpu_instance_id(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    source.open(FIELDS)  # says what a MIG GPU refuses (its utilization): not what is tried here
    caplog.clear()
    _read(source, FB_TWINS, NOW_NS)
    m = fake.gpus[0].mig[2]
    _fail_memory(m, pynvml.NVML_ERROR_INVALID_ARGUMENT)  # as a gone one's would, yet it is there
    for k in range(1, 4):
        _read(source, FB_TWINS, NOW_NS + k * 100_000_000)
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert warned[0].startswith(f"GPU 0 MIG instance GPU_I_ID=13 ({m.uuid}): reading ")
    m.errors.clear()
    _read(source, FB_TWINS, NOW_NS + 500_000_000)
    assert f"GPU 0 MIG instance GPU_I_ID=13 ({m.uuid}): DCGM_FI_DEV_FB_" in caplog.text
    assert "reads again" in caplog.text

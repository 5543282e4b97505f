"""MIG outside the nvml source: the sim's layout, the flag, the config key, `record`'s choice of
instances by MIG UUID and the recording header that keeps them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hfsampler import fields as F
from hfsampler.cli.main import main
from hfsampler.errors import ConfigError
from hfsampler.profiling.record import choose, visible_gpus
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.profiling.replay import RawBatches, raw_snapshots, window_snapshots
from hfsampler.profiling.summary import summarize
from hfsampler.sampling.probe import probe
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.window import reduce
from hfsampler.sources.base import SourceSpec, physical
from hfsampler.sources.sim.mig import parse_layout
from hfsampler.sources.sim.source import SimSource

FIELDS = F.expand_mig(F.CATALOGUE, F.DEFAULT_GROUP_INTERVALS_S)


def _open(layout: str, gpus: int = 2) -> tuple[SimSource, tuple[F.Field, ...]]:
    s = SimSource(gpus, seed=3, mig=parse_layout(layout))
    inv = s.open(FIELDS)
    return s, inv.fields


def _col(fields: tuple[F.Field, ...], name: str, twin: bool) -> int:
    return next(k for k, f in enumerate(fields) if f.name == name and f.mig_instance == twin)


def test_sim_layout_is_deterministic_and_adds_up() -> None:
    s, fields = _open("3g,2g,1g,1g")
    devices = s.devices
    assert physical(devices) == [0, 1]
    held = [(d.index, d.mig.gpu_instance_id, d.mig.profile) for d in devices if d.mig]
    assert held == [(g, gi, p) for g in (0, 1) for gi, p in
                    ((1, "3g.71gb"), (3, "2g.35gb"), (7, "1g.18gb"), (8, "1g.18gb"))]  # fmt: skip
    assert devices == _open("3g,2g,1g,1g")[0].devices  # same seed, same UUIDs
    assert list(s.gpu_up) == [True, True] + ([True] * 4 + [False] * 3) * 2
    values = np.zeros((len(devices), len(fields)))
    ts = np.zeros(values.shape, dtype=np.int64)
    s.read(fields, values, ts, 5_000_000_000)
    rows = [r for r, d in enumerate(devices) if d.mig and d.index == 0]
    for name in ("DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"):
        gpu, twin = _col(fields, name, False), _col(fields, name, True)
        # a full layout: the instances' memory is the GPU's, slice by slice
        assert values[rows, twin].sum() == pytest.approx(values[0, gpu])
        assert np.isnan(values[:2, twin]).all()
    sm = _col(fields, "DCGM_FI_PROF_SM_ACTIVE", True)
    assert values[rows[0], sm] == pytest.approx(
        values[0, _col(fields, "DCGM_FI_PROF_SM_ACTIVE", False)] * 3 / 7
    )
    power = _col(fields, "DCGM_FI_DEV_POWER_USAGE", False)
    assert np.isnan(values[2:, power]).all()  # a GPU's power is not an instance's


def test_sim_without_mig_has_no_instance_rows() -> None:
    s = SimSource(2)
    inv = s.open(FIELDS)
    assert len(inv.devices) == 2
    twins = [k for k, f in enumerate(inv.fields) if f.mig_instance]
    assert not inv.supported[:, twins].any()


@pytest.mark.parametrize(
    ("layout", "message"),
    [("3g,4g,1g", "needs 8/7 compute"), ("5g", "unknown MIG profile '5g'"), (",", "names no")],
)
def test_bad_sim_mig_exits_2(layout: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_layout(layout)
    try:
        code = main(["run", "--source", "sim", "--sim-mig", layout, "--duration", "1s"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "--sim-mig" in err
    assert "Traceback" not in err


def test_copy_device_fields_bad_value_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("mig: {copy_device_fields: maybe}\n")
    done = subprocess.run([sys.executable, "-m", "hfsampler", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2
    assert "mig.copy_device_fields" in done.stderr
    assert "e.g. mig.copy_device_fields: true" in done.stderr


def test_record_takes_mig_uuids_from_cuda_visible_devices() -> None:
    s, _ = _open("3g,2g,1g,1g")
    devices = s.devices
    second = next(d for d in devices if d.mig and d.index == 1 and d.mig.gpu_instance_id == 3)
    assert second.mig is not None
    wanted = visible_gpus(None, {"CUDA_VISIBLE_DEVICES": second.mig.uuid})
    assert wanted == [second.mig.uuid]
    keep = choose(devices, wanted)
    assert keep == [1, devices.index(second)]  # the instance and the GPU it is part of
    whole = choose(devices, ["0"])
    assert whole == [0, *range(2, 9)]  # a whole GPU: with its slots
    with pytest.raises(ConfigError, match="MIG instances MIG-"):
        choose(devices, ["MIG-nope"])


def test_recording_header_keeps_the_instances(tmp_path: Path) -> None:
    s, _ = _open("3g,2g,1g,1g", gpus=1)
    path = tmp_path / "mig.hfs"
    RecordingWriter(path, {"start_ns": 0}, s.devices, []).close()
    assert Recording(path).devices == s.devices


def test_record_and_report_a_mig_gpu(tmp_path: Path) -> None:
    """`record --sim-mig`: the instances are recorded; the report's summary is per GPU."""
    path, page = tmp_path / "mig.hfs", tmp_path / "mig.html"
    args = ["record", "--source", "sim", "--sim-mig", "3g,2g,1g,1g", "--quiet", "-o", str(path)]
    assert main([*args, "--duration", "2s"]) == 0
    rec = Recording(path)
    assert len(physical(rec.devices)) == 2
    assert sum(d.mig is not None for d in rec.devices) == 8
    summary = summarize(rec)
    assert [g.index for g in summary.gpus] == [0, 1]
    assert all(np.isfinite(g.memory_high_water_mib) for g in summary.gpus)
    assert main(["report", str(path), "-o", str(page)]) == 0
    assert "GPU 1" in page.read_text()


def test_replay_of_a_mig_recording_labels_instances(tmp_path: Path) -> None:
    path = tmp_path / "mig.hfs"
    args = ["record", "--source", "sim", "--sim-mig", "3g,1g", "--gpus", "1", "--quiet"]
    assert main([*args, "-o", str(path), "--duration", "2s"]) == 0
    rec = Recording(path)
    raw = list(raw_snapshots(rec, {}))
    # the array path of `replay --raw` sends what the snapshot path does, empty slots left out
    assert sum(b.samples for b in RawBatches(rec, {}, n_shards=2)) == sum(len(r) for r in raw)
    for snaps in (window_snapshots(rec, {}), raw):
        assert snaps
        instances = set()
        for snap in snaps:
            keys = [(s.name, s.labels) for s in snap.series]
            assert len(keys) == len(set(keys))  # one value per series and timestamp
            instances |= {dict(s.labels).get("GPU_I_PROFILE") for s in snap.series}
        assert instances == {None, "3g.71gb", "1g.18gb"}


def test_reducing_only_the_rows_with_samples_gives_the_same_window() -> None:
    """The service reduces a group's rows that can have samples (not a MIG GPU's empty slots
    in the fast group); the window is the one a reduce of every row gives."""
    s, fields = _open("3g,2g,1g,1g", gpus=1)
    fast = tuple(f for f in fields if f.group == F.FAST)
    n = 200
    values = np.zeros((n, len(s.devices), len(fast)))
    ts = np.zeros(values.shape, dtype=np.int64)
    for k in range(n):
        s.read(fast, values[k], ts[k], 5_000_000_000 + k * 1_000_000)
    times = 5_000_000_000 + np.arange(n, dtype=np.int64) * 1_000_000
    rows = RingRows(times, np.zeros(n, dtype=np.int64), values, ts)
    full = reduce(rows, fast, 0, 1)
    part = reduce(rows, fast, 0, 1, only=[0])
    np.testing.assert_array_equal(part.count, full.count)
    for name, v in full.values.items():
        np.testing.assert_array_equal(part.values[name], v)


def test_probe_reports_gpus_not_instance_slots() -> None:
    result = probe(SourceSpec("sim", gpus=1, sim_mig=("3g", "2g")), F.CATALOGUE, duration_s=0.5)
    assert result.gpus == ("hfsampler sim H200",)
    assert all(len(p.refresh_s) == 1 for p in result.fields if p.supported)


def test_a_layout_is_placed_largest_first_and_one_that_cannot_be_is_refused() -> None:
    """``3g,4g`` is a layout a GPU holds (the 4g first, as the driver places it); a layout that
    has no place for an instance is a ConfigError naming the flag, never a traceback."""
    from hfsampler.errors import ConfigError
    from hfsampler.sources.sim.mig import instances, parse_layout

    assert parse_layout("3g,4g") == ("3g", "4g")
    found = instances(("3g", "4g"), 0, 0)
    assert [i.profile for i in found] == ["3g.71gb", "4g.71gb"]  # in the order given
    assert len({i.gpu_instance_id for i in found}) == 2
    with pytest.raises(ConfigError, match="--sim-mig"):
        parse_layout("4g,4g")

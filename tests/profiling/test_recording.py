"""The recording format: round trip of raw samples and windows, and a torn tail after a crash."""

from __future__ import annotations

import struct
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest

from hfsampler.cli.main import main
from hfsampler.fields import BY_NAME, Kind
from hfsampler.profiling.recording import Recording
from hfsampler.profiling.recording_format import FORMAT_VERSION, MAGIC, RecordingError
from hfsampler.profiling.recording_writer import RecordingWriter
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.window import MAX, reduce
from hfsampler.sources.base import DeviceInfo

FIELDS = (
    BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"],
    BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"],
)
DEVICES = tuple(DeviceInfo(i, f"GPU-{i}", "test", f"0:{i}", "1.0", i) for i in range(2))


def _rows(n: int, t0_ns: int, rng: np.random.Generator) -> RingRows:
    time_ns = t0_ns + np.arange(n, dtype=np.int64) * 1_000_000
    values = np.empty((n, 2, 2))
    values[:, :, 0] = np.round(rng.uniform(300, 700, (n, 2)), 3)
    values[:, :, 1] = 1e12 + np.cumsum(rng.uniform(0, 1000, (n, 2)), axis=0)
    values[::3, 1, 0] = np.nan  # repeats
    driver = np.repeat((time_ns // 1000)[:, None, None], 2, axis=1).repeat(2, axis=2)
    return RingRows(time_ns, np.zeros(n, np.int64), values, driver)


def _write(path: Path, windows: int = 3) -> list[RingRows]:
    rng = np.random.default_rng(1)
    w = RecordingWriter(path, {"start_ns": 10**18, "command": ["x"]}, DEVICES,
                        [GroupPlan("fast", 0.001, FIELDS)])  # fmt: skip
    parts = []
    for k in range(windows):
        rows = _rows(1000, 10**18 + k * 10**9, rng)
        parts.append(rows)
        w.add_rows(0, rows)
        w.add_window(0, reduce(rows, FIELDS, 10**18 + k * 10**9, 10**18 + (k + 1) * 10**9))
    w.close({"end_ns": 10**18 + windows * 10**9, "exit_code": 0})
    return parts


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "r.hfs"
    parts = _write(path)
    rec = Recording(path)
    assert rec.complete
    assert not rec.torn
    assert [d.uuid for d in rec.devices] == ["GPU-0", "GPU-1"]
    rows = RingRows.concat(parts)
    for gpu in range(2):
        ts, v = rec.raw("DCGM_FI_DEV_POWER_USAGE_INSTANT", gpu)
        ok = ~np.isnan(rows.values[:, gpu, 0])
        assert np.array_equal(ts, rows.driver_ts_us[ok, gpu, 0])
        # gauges are float32: exact to float32's precision
        assert np.array_equal(v, rows.values[ok, gpu, 0].astype(np.float32).astype(np.float64))
        _, energy = rec.raw("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu)
        assert np.array_equal(energy, rows.values[:, gpu, 1])  # counters are exact
    w = rec.windows(0)
    assert len(w.t1_ns) == 3
    assert np.array_equal(w[MAX][1], reduce(parts[1], FIELDS, 0, 1)[MAX])


def test_torn_tail_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "r.hfs"
    _write(path)
    data = path.read_bytes()
    for cut in (len(data) - 5, len(data) - 200):
        path.write_bytes(data[:cut])
        rec = Recording(path)
        assert rec.torn
        assert not rec.complete
        assert len(rec.windows(0).t1_ns) >= 2
    corrupt = bytearray(data)
    corrupt[-30] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    assert Recording(path).torn


def test_not_a_recording(tmp_path: Path) -> None:
    path = tmp_path / "x.hfs"
    path.write_bytes(b"hello")
    with pytest.raises(RecordingError):
        Recording(path)


def test_per_instance_fields_keep_their_labels(tmp_path: Path) -> None:
    """A Jetson's rails are one catalogue field each with its own label: a recording keeps them."""
    rail = BY_NAME["hfsampler_jetson_rail_power_watts"]
    plan = GroupPlan("fast", 0.001, (rail.instance("VDD_GPU_SOC"), rail.instance("VDD_SOC")))
    w = RecordingWriter(tmp_path / "j.hfs", {"start_ns": 10**18, "command": ["x"]}, DEVICES[:1],
                        [plan])  # fmt: skip
    w.close({"end_ns": 10**18, "exit_code": 0})
    (group,) = Recording(tmp_path / "j.hfs").groups
    assert group.fields == plan.fields


def _with_format(path: Path, version: object) -> Path:
    """A recording whose header says format ``version``: the documented layout, by hand."""
    head = orjson.dumps({"format_version": version, "start_ns": 10**18, "command": ["x"],
                         "stats": [], "devices": [], "groups": [], "blobs": []})  # fmt: skip
    payload = zlib.compress(struct.pack("<I", len(head)) + head)
    frame = struct.pack("<4sII", b"HEAD", len(payload), zlib.crc32(payload))
    path.write_bytes(MAGIC + frame + payload)
    return path


@pytest.mark.parametrize("version", [1, 3, None])
def test_another_format_is_refused_in_one_line_naming_the_file_and_version(
    tmp_path: Path, version: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the current format is read (nothing released wrote another); report and replay
    exit 2 with one line that names the file and the version found."""
    path = _with_format(tmp_path / "old.hfs", version)
    with pytest.raises(RecordingError, match=rf"^{path}: recording format {version} "):
        Recording(path)
    url = "http://127.0.0.1:1/api/v1/write"
    for argv in (["report", str(path)], ["report", str(path), "--format", "json"],
                 ["replay", str(path), "--remote-write", url]):  # fmt: skip
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1, captured.err
        assert lines[0].startswith(f"hfsampler: error: {path}: recording format {version} ")
        assert f"reads format {FORMAT_VERSION} only" in lines[0]
        assert captured.out == ""


def test_markers_round_trip_in_time_order(tmp_path: Path) -> None:
    from hfsampler.profiling.recording_format import Marker

    path = tmp_path / "m.hfs"
    w = RecordingWriter(path, {"start_ns": 0}, [], [])
    late = Marker(2_000, "step", "step", step=7, pid=12)
    early = Marker(1_000, "begin", "epoch 3", source="output")
    w.add_markers([late, early])
    w.add_markers([])
    w.close({"end_ns": 3_000})
    assert Recording(path).markers() == [early, late]


def test_marker_kind_is_checked() -> None:
    from hfsampler.profiling.recording_format import Marker

    with pytest.raises(ValueError, match="marker kind"):
        Marker(0, "pause", "x")


def test_a_recording_from_before_the_header_said_widths_reads_as_it_was_written(
    tmp_path: Path,
) -> None:
    """DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL was a counter (float64 in raw chunks) until it became
    DCGM's rate; a recording written then, its header without ``float64``, reads back exact."""
    total = BY_NAME["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"]
    then = (FIELDS[0], replace(total, kind=Kind.COUNTER))  # as the catalogue had it
    path = tmp_path / "then.hfs"
    w = RecordingWriter(path, {"start_ns": 10**18, "command": ["x"]}, DEVICES,
                        [GroupPlan("slow", 0.1, then)])  # fmt: skip
    rows = _rows(200, 10**18, np.random.default_rng(2))
    w.add_rows(0, rows)
    w.close({"end_ns": 10**18 + 10**9, "exit_code": 0})
    # the header as the writer of then wrote it: no widths
    data = path.read_bytes()
    at = len(MAGIC)
    tag, length, _ = struct.unpack("<4sII", data[at : at + 12])
    assert tag == b"HEAD"
    payload = zlib.decompress(data[at + 12 : at + 12 + length])
    (size,) = struct.unpack("<I", payload[:4])
    head = orjson.loads(payload[4 : 4 + size])
    assert [g.pop("float64") for g in head["groups"]] == [[False, True]]
    body = orjson.dumps(head)
    new = zlib.compress(struct.pack("<I", len(body)) + body + payload[4 + size :])
    frame = struct.pack("<4sII", b"HEAD", len(new), zlib.crc32(new))
    path.write_bytes(MAGIC + frame + new + data[at + 12 + length :])

    rec = Recording(path)
    assert rec.groups[0].fields[1].kind is Kind.GAUGE  # today's catalogue
    for gpu in range(2):
        _, v = rec.raw(total.name, gpu)
        assert np.array_equal(v, rows.values[:, gpu, 1])  # float64, exact, as written
        _, p = rec.raw(FIELDS[0].name, gpu)
        ok = ~np.isnan(rows.values[:, gpu, 0])
        assert np.array_equal(p, rows.values[ok, gpu, 0].astype(np.float32).astype(np.float64))

"""The committed protobuf modules match proto/ and import with the installed runtime."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generated_modules_are_not_stale(tmp_path: Path) -> None:
    """Every committed *_pb2.py is what scripts/gen_proto.sh makes of proto/ today, and every
    .proto has its module."""
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip(
            "grpc_tools is not importable: pip install 'hfsampler[proto]' to run this check"
        )
    if shutil.which("bash") is None:
        pytest.skip("bash is needed to run scripts/gen_proto.sh")
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2.py"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "hfsampler").rglob("*_pb2.py"))
    protos = sorted((ROOT / "proto").rglob("*.proto"))
    assert fresh == committed
    assert len(fresh) == len(protos) >= 6
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), (
            f"{rel} is stale: run scripts/gen_proto.sh and commit the result"
        )


def test_generated_modules_import_with_installed_runtime() -> None:
    from hfsampler.remote_write.prompb import remote_pb2, types_pb2

    req = remote_pb2.WriteRequest()
    ts = req.timeseries.add()
    ts.labels.add(name="__name__", value="up")
    ts.samples.add(value=1.0, timestamp=1)
    req.metadata.add(type=types_pb2.MetricMetadata.GAUGE, metric_family_name="up")
    back = remote_pb2.WriteRequest.FromString(req.SerializeToString())
    assert back == req


def test_field_numbers_match_prometheus() -> None:
    from hfsampler.remote_write.prompb import remote_pb2, types_pb2

    def numbers(msg: type) -> dict[str, int]:
        return {f.name: f.number for f in msg.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(remote_pb2.WriteRequest) == {"timeseries": 1, "metadata": 3}
    assert numbers(types_pb2.TimeSeries) == {"labels": 1, "samples": 2, "histograms": 4}
    assert numbers(types_pb2.Histogram) == {
        "count_int": 1,
        "count_float": 2,
        "sum": 3,
        "schema": 4,
        "zero_threshold": 5,
        "zero_count_int": 6,
        "zero_count_float": 7,
        "negative_spans": 8,
        "negative_deltas": 9,
        "negative_counts": 10,
        "positive_spans": 11,
        "positive_deltas": 12,
        "positive_counts": 13,
        "reset_hint": 14,
        "timestamp": 15,
        "custom_values": 16,
    }
    assert numbers(types_pb2.BucketSpan) == {"offset": 1, "length": 2}
    assert numbers(types_pb2.Label) == {"name": 1, "value": 2}
    assert numbers(types_pb2.Sample) == {"value": 1, "timestamp": 2}
    assert numbers(types_pb2.MetricMetadata) == {
        "type": 1,
        "metric_family_name": 2,
        "help": 4,
        "unit": 5,
    }
    enum = types_pb2.MetricMetadata.MetricType
    assert [enum.Name(i) for i in range(8)] == [
        "UNKNOWN",
        "COUNTER",
        "GAUGE",
        "HISTOGRAM",
        "GAUGEHISTOGRAM",
        "SUMMARY",
        "INFO",
        "STATESET",
    ]

"""The conformance receiver catches each rule: hand-built requests, one planted fault each.

Requests are built independently of hfsampler's encoder: with the generated prompb classes (1.0's
remote_pb2, 2.0's writev2_pb2), or byte by byte where protobuf cannot express the fault (a field
sent twice, invalid UTF-8, refs sent unpacked).
"""

from __future__ import annotations

import math
import os
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import snappy
from conformance import (
    MIMIR_TENANT_HEADER,
    THANOS_TENANT_HEADER,
    ConformanceReceiver,
    Limits,
    Reply,
    Written,
    is_stale_marker,
)

from hfsampler.remote_write.prompb import remote_pb2, types_pb2, writev2_pb2

NOW_S = 1_700_000_000.0
NOW_MS = int(NOW_S * 1000)
STALE = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]
HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": "conformance-test/1.0",
}
# Sorted byte-wise: upper case < "_" < lower case, so __name__ sits between UUID and device.
GOOD = (
    ("DCGM_FI_DRIVER_VERSION", "550.54.15"),
    ("Hostname", "node-1"),
    ("UUID", "GPU-0"),
    ("__name__", "DCGM_FI_DEV_POWER_USAGE"),
    ("device", "nvidia0"),
    ("gpu", "0"),
)
# What a naive encoder sends: __name__ first, then the other labels sorted.
NAIVE = (GOOD[3], *GOOD[:3], *GOOD[4:])
CONFORMANCE = Path(__file__).resolve().parents[1] / "support" / "conformance.py"

Series = tuple[Sequence[tuple[str, str]], Sequence[tuple[int, float]]]


def request(*series: Series) -> bytes:
    """A snappy-compressed WriteRequest built with the generated prompb classes."""
    req = remote_pb2.WriteRequest()
    for labels, samples in series:
        ts = req.timeseries.add()
        for name, value in labels:
            ts.labels.add(name=name, value=value)
        for t, v in samples:
            ts.samples.add(timestamp=t, value=v)
    return bytes(snappy.compress(req.SerializeToString()))


def receiver(**kwargs: Any) -> ConformanceReceiver:
    kwargs.setdefault("clock", lambda: NOW_S)
    return ConformanceReceiver(**kwargs)


async def exchange(
    rx: ConformanceReceiver, body: bytes, headers: Mapping[str, str] = HEADERS, method: str = "POST"
) -> tuple[int, str, dict[str, str]]:
    """Status, body, and the X-Prometheus-Remote-Write-*-Written headers the answer carried."""
    # No automatic User-Agent or Content-Type: each test sends exactly the headers it names.
    async with (
        aiohttp.ClientSession(skip_auto_headers=("User-Agent", "Content-Type")) as session,
        session.request(method, rx.url, data=body, headers=dict(headers)) as resp,
    ):
        written = {k: v for k, v in resp.headers.items() if k.endswith("-Written")}
        return resp.status, await resp.text(), written


async def post(
    rx: ConformanceReceiver, body: bytes, headers: Mapping[str, str] = HEADERS, method: str = "POST"
) -> tuple[int, str]:
    status, text, _ = await exchange(rx, body, headers, method)
    return status, text


def rules(rx: ConformanceReceiver) -> list[str]:
    return [v.rule for v in rx.violations]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def ld(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def raw_sample(ts: int, value: float) -> bytes:
    return ld(2, b"\x09" + struct.pack("<d", value) + b"\x10" + varint(ts))


def raw_label(name: bytes, value: bytes) -> bytes:
    return ld(1, ld(1, name) + ld(2, value))


async def test_conformant_request_is_stored_with_nan_bits() -> None:
    assert [n for n, _ in GOOD] == sorted(n for n, _ in GOOD)
    other = (("__name__", "DCGM_FI_DEV_GPU_TEMP"), ("gpu", "0"))
    body = request((GOOD, [(NOW_MS, 1.5), (NOW_MS + 1000, STALE)]), (other, [(NOW_MS, math.nan)]))
    async with receiver() as rx:
        assert await post(rx, body) == (200, "")
    assert rx.violations == []
    assert rx.samples[GOOD][0] == (NOW_MS, 1.5)
    assert rx.samples[GOOD][1][0] == NOW_MS + 1000
    assert is_stale_marker(rx.samples[GOOD][1][1])
    assert not is_stale_marker(rx.samples[other][0][1])  # a NaN, but not the stale marker
    assert rx.series_named("DCGM_FI_DEV_POWER_USAGE", gpu="0") == {GOOD: rx.samples[GOOD]}
    assert rx.headers[0]["User-Agent"] == "conformance-test/1.0"
    assert rx.report() == {
        "requests": 1,
        "statuses": {200: 1},
        "series": 2,
        "samples": 3,
        "stale_markers": 1,
        "metadata": 0,
        "violations": {},
        "protocols": {"1.0": 1, "2.0": 0},
    }
    assert rx.protocols == ["1.0"]
    assert rx.written == [None]  # a 1.0 answer carries no Written headers
    rx.assert_conformant()


def with_label(labels: Sequence[tuple[str, str]], name: str, value: str) -> tuple[Any, ...]:
    return tuple(sorted([*(lb for lb in labels if lb[0] != name), (name, value)]))


LONG_NAME = "a" * 1025
MANY = (("__name__", "m"), *((f"l{i:02}", "v") for i in range(30)))  # 31 labels
# (labels, rule, Thanos' status, part of Thanos' body, part of Mimir's body)
LABEL_CASES = {
    "name-first": (
        NAIVE,
        "labels-not-sorted",
        409,
        "add 1 series: out of order labels",
        "received a series where the label names are not alphabetically sorted, "
        "label: 'DCGM_FI_DRIVER_VERSION' series: '{__name__=\"DCGM_FI_DEV_POWER_USAGE\", "
        'DCGM_FI_DRIVER_VERSION="550.54.15"',
    ),
    "duplicate-name": (
        (*GOOD, ("gpu", "1")),
        "duplicate-label-names",
        409,
        "add 1 series: label set contains duplicate label names",
        "received a series with duplicate label name, label: 'gpu' series:",
    ),
    "empty-value": (
        with_label(GOOD, "device", ""),
        "label-value-empty",
        409,
        "add 1 series: label set contains a label with empty name or value",
        "label 'device' has an empty value series: '{",
    ),
    "31-labels": (
        MANY,
        "max-label-names-per-series",
        400,
        "add 1 series: max-label-names-per-series: 31 labels, limit 30",
        "received a series whose number of labels exceeds the limit (actual: 31, limit: 30) "
        'series: \'{__name__="m", l00="v"',
    ),
    "value-2049-bytes": (
        with_label(GOOD, "device", "x" * 2049),
        "label-value-too-long",
        400,
        "label 'device' value of 2049 bytes, limit 2048",
        "received a series whose label value length exceeds the limit, label: 'device', value: "
        "'xxx",
    ),
    "name-1025-bytes": (
        with_label(GOOD, LONG_NAME, "v"),
        "label-name-too-long",
        400,
        "label name 'aaa",
        "(err-mimir-label-name-too-long). To adjust the related per-tenant limit, configure "
        "-validation.max-length-label-name, or contact your service administrator.",
    ),
    "bad-label-name": (
        with_label(GOOD, "gpu-id", "0"),
        "label-name-invalid",
        400,
        "label name 'gpu-id' does not match",
        "received a series with an invalid label: 'gpu-id' series:",
    ),
    "bad-metric-name": (
        with_label(GOOD, "__name__", "dcgm-power"),
        "metric-name-invalid",
        400,
        "metric name 'dcgm-power' does not match",
        "received a series with invalid metric name: 'dcgm-power' (err-mimir-metric-name-invalid)",
    ),
    "no-metric-name": (
        GOOD[:3] + GOOD[4:],
        "missing-metric-name",
        400,
        "series has no __name__ label",
        "received series has no metric name (err-mimir-missing-metric-name)",
    ),
}


@pytest.mark.parametrize("flavour", ["thanos", "mimir"])
@pytest.mark.parametrize("case", LABEL_CASES)
async def test_bad_label_set_is_refused_and_not_stored(case: str, flavour: str) -> None:
    labels, rule, thanos_status, thanos_body, mimir_body = LABEL_CASES[case]
    async with receiver(flavour=flavour) as rx:
        status, body = await post(rx, request((labels, [(NOW_MS, 1.0)])))
    assert rules(rx) == [rule]
    assert rx.violations[0].labels == tuple(labels)
    assert rx.violations[0].samples == 1
    assert rx.samples == {}
    if flavour == "thanos":
        assert status == thanos_status
        assert thanos_body in body
    else:
        assert status == 400
        assert mimir_body in body


async def test_limits_are_inclusive() -> None:
    at_limits = [
        (tuple(MANY[:30]), [(NOW_MS, 1.0)]),
        (with_label(GOOD, "device", "x" * 2048), [(NOW_MS, 1.0)]),
        (with_label(GOOD, "a" * 1024, "v"), [(NOW_MS, 1.0)]),
    ]
    async with receiver() as rx:
        assert await post(rx, request(*at_limits)) == (200, "")
    assert len(rx.samples) == 3
    rx.assert_conformant()


async def test_seconds_instead_of_milliseconds() -> None:
    async with receiver() as rx:
        status, body = await post(rx, request((GOOD, [(int(NOW_S), 1.0)])))
    assert (status, body) == (409, "add 1 samples: out of bounds")
    assert rules(rx) == ["sample-too-old"]
    assert "looks like seconds, not milliseconds" in rx.violations[0].message
    assert rx.samples == {}


async def test_mimir_words_a_too_old_sample_as_its_ingester_does() -> None:
    async with receiver(flavour="mimir") as rx:
        status, body = await post(rx, request((GOOD, [(int(NOW_S), 1.0)])))
    assert status == 400
    assert body.startswith(
        "the sample has been rejected because its timestamp is too old "
        "(err-mimir-sample-timestamp-too-old). The affected sample has timestamp "
        "1970-01-20T16:13:20.000Z and is from series {DCGM_FI_DRIVER_VERSION="
    )


@pytest.mark.parametrize(
    ("offset_ms", "rule"),
    [(601_000, "sample-too-far-in-future"), (-601_000, "sample-too-old"), (599_000, None)],
)
async def test_time_window_is_ten_minutes_each_way(offset_ms: int, rule: str | None) -> None:
    async with receiver() as rx:
        status, _ = await post(rx, request((GOOD, [(NOW_MS + offset_ms, 1.0)])))
    assert rules(rx) == ([rule] if rule else [])
    assert status == {None: 200, "sample-too-old": 409, "sample-too-far-in-future": 400}[rule]


async def test_future_sample_in_mimir_flavour() -> None:
    async with receiver(flavour="mimir") as rx:
        status, body = await post(rx, request((GOOD, [(NOW_MS + 3_600_000, 1.0)])))
    assert status == 400
    assert body.startswith(
        f"received a sample whose timestamp is too far in the future, timestamp: "
        f"{NOW_MS + 3_600_000} series: '{{DCGM_FI_DRIVER_VERSION="
    )
    assert "(err-mimir-too-far-in-future)" in body


async def test_window_checks_can_be_turned_off() -> None:
    async with receiver(limits=Limits(past_window_s=None, future_window_s=None)) as rx:
        assert (await post(rx, request((GOOD, [(1000, 1.0), (NOW_MS * 1000, 2.0)]))))[0] == 200
    assert rx.samples[GOOD] == [(1000, 1.0), (NOW_MS * 1000, 2.0)]


async def test_resent_sample_is_a_duplicate() -> None:
    body = request((GOOD, [(NOW_MS, 1.0)]))
    async with receiver() as rx:
        assert await post(rx, body) == (200, "")
        status, text = await post(rx, body)
        changed = await post(rx, request((GOOD, [(NOW_MS, 2.0)])))
    assert (status, text) == (
        409,
        "add 1 samples: duplicate sample for timestamp (identical resend)",
    )
    assert changed == (409, "add 1 samples: duplicate sample for timestamp")
    assert rules(rx) == ["sample-duplicate", "sample-duplicate-timestamp"]
    assert [v.request for v in rx.violations] == [2, 3]
    assert rx.samples[GOOD] == [(NOW_MS, 1.0)]


async def test_out_of_order_within_one_request() -> None:
    samples = [(NOW_MS, 1.0), (NOW_MS - 1000, 2.0), (NOW_MS - 2000, 3.0), (NOW_MS + 1000, 4.0)]
    async with receiver(flavour="mimir") as rx:
        status, body = await post(rx, request((GOOD, samples)))
    assert status == 400
    assert "(err-mimir-sample-out-of-order). The affected sample has timestamp" in body
    assert rules(rx) == ["sample-out-of-order"]
    assert rx.violations[0].samples == 2
    assert rx.samples[GOOD] == [(NOW_MS, 1.0), (NOW_MS + 1000, 4.0)]


async def test_out_of_order_across_requests() -> None:
    async with receiver() as rx:
        await post(rx, request((GOOD, [(NOW_MS, 1.0)])))
        assert await post(rx, request((GOOD, [(NOW_MS - 1, 1.0)]))) == (
            409,
            "add 1 samples: out of order sample",
        )
    assert rules(rx) == ["sample-out-of-order"]


@pytest.mark.parametrize("flavour", ["thanos", "mimir"])
async def test_valid_series_of_a_partly_bad_request_are_stored(flavour: str) -> None:
    other = (("__name__", "DCGM_FI_DEV_GPU_TEMP"), ("gpu", "0"))
    body = request((other, [(NOW_MS, 40.0)]), (NAIVE, [(NOW_MS, 1.0)]), (GOOD, [(NOW_MS, 2.0)]))
    async with receiver(flavour=flavour) as rx:
        status, text = await post(rx, body)
    assert rx.samples == {other: [(NOW_MS, 40.0)], GOOD: [(NOW_MS, 2.0)]}
    assert rules(rx) == ["labels-not-sorted"]
    if flavour == "mimir":
        assert status == 400
        assert text.startswith("received a series where the label names are not alphabetically")
        assert "(err-mimir-labels-not-sorted)" in text
    else:
        assert (status, text) == (409, "add 1 series: out of order labels")


async def test_framed_snappy_is_refused() -> None:
    framed = snappy.StreamCompressor().add_chunk(
        snappy.uncompress(request((GOOD, [(NOW_MS, 1.0)])))
    )
    assert framed.startswith(b"\xff\x06\x00\x00sNaPpY")
    async with receiver() as rx:
        status, _ = await post(rx, framed)
    assert (status, rules(rx)) == (400, ["snappy-framed"])


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        (b"\x05abc", "snappy-invalid"),
        (b"", "snappy-invalid"),
        (snappy.compress(b"\x0a\xff"), "proto-malformed"),  # length runs past the end
        (snappy.compress(b"\x0b"), "proto-malformed"),  # wire type 3 (a group)
    ],
)
async def test_undecodable_body_is_refused(body: bytes, rule: str) -> None:
    async with receiver() as rx:
        status, _ = await post(rx, body)
    assert (status, rules(rx)) == (400, [rule])


C415 = ("header-content-type", 415)
V400 = ("header-version", 400)  # a 2.0 Content-Type, and the 1.0 version header


@pytest.mark.parametrize(
    ("header", "value", "rule", "status"),
    [
        ("Content-Encoding", None, "header-content-encoding", 415),
        ("Content-Encoding", "gzip", "header-content-encoding", 415),
        ("Content-Type", None, "header-content-type", 415),
        ("Content-Type", "application/json", "header-content-type", 415),
        ("Content-Type", "application/x-protobuf;proto=io.prometheus.write.v3.Request", *C415),
        ("Content-Type", "application/x-protobuf;proto=prometheus.WriteRequest;v=1", *C415),
        ("Content-Type", "application/x-protobuf; proto=io.prometheus.write.v2.Request", *V400),
        ("X-Prometheus-Remote-Write-Version", None, "header-version", 400),
        ("X-Prometheus-Remote-Write-Version", "2.0.0", "header-version", 400),
        ("User-Agent", None, "header-user-agent", 400),
        ("User-Agent", "Python/3.11 aiohttp/3.9.5", "header-user-agent", 400),
    ],
)
async def test_protocol_headers(header: str, value: str | None, rule: str, status: int) -> None:
    headers = {k: v for k, v in HEADERS.items() if k != header}
    if value is not None:
        headers[header] = value
    async with receiver() as rx:
        got, _ = await post(rx, request((GOOD, [(NOW_MS, 1.0)])), headers)
    assert (got, rules(rx)) == (status, [rule])
    assert rx.samples == {}


async def test_content_type_may_name_the_v1_message() -> None:
    headers = {**HEADERS, "Content-Type": "application/x-protobuf;proto=prometheus.WriteRequest"}
    async with receiver() as rx:
        assert (await post(rx, request((GOOD, [(NOW_MS, 1.0)])), headers))[0] == 200


async def test_every_header_problem_is_recorded_and_the_method_decides() -> None:
    async with receiver() as rx:
        status, _ = await post(rx, b"", {}, method="GET")
    assert status == 405
    assert rules(rx) == [
        "http-method",
        "header-content-encoding",
        "header-content-type",
        "header-version",
        "header-user-agent",
    ]


@pytest.mark.parametrize(
    ("flavour", "header", "status", "body"),
    [
        ("thanos", THANOS_TENANT_HEADER, 400, "tenant-missing: no THANOS-TENANT header"),
        ("mimir", MIMIR_TENANT_HEADER, 401, "no org id"),
    ],
)
async def test_tenant_header_when_required(
    flavour: str, header: str, status: int, body: str
) -> None:
    payload = request((GOOD, [(NOW_MS, 1.0)]))
    async with receiver(flavour=flavour, tenant_header=header) as rx:
        assert await post(rx, payload) == (status, body)
        assert (await post(rx, payload, {**HEADERS, header: "team-a"}))[0] == 200
    assert rules(rx) == ["tenant-missing"]
    assert rx.headers[1][header] == "team-a"
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}


async def test_compressed_body_over_the_limit_is_413() -> None:
    body = request((GOOD, [(NOW_MS + i, float(i)) for i in range(50)]))
    async with receiver(limits=Limits(max_compressed_bytes=len(body) - 1)) as rx:
        assert await post(rx, body) == (413, "write request too large")
    assert rules(rx) == ["body-compressed-too-large"]
    async with receiver(limits=Limits(max_compressed_bytes=len(body))) as rx:
        assert (await post(rx, body))[0] == 200


async def test_decoded_body_over_the_limit_is_413() -> None:
    body = request(*((GOOD, [(NOW_MS, 1.0)]) for _ in range(20)))  # compresses well
    decoded = len(snappy.uncompress(body))
    async with receiver(flavour="mimir", limits=Limits(max_decoded_bytes=decoded - 1)) as rx:
        status, text = await post(rx, body)
    assert len(body) < decoded - 1
    assert status == 413
    assert "err-mimir-distributor-max-write-message-size" in text
    assert rules(rx) == ["body-decoded-too-large"]


async def test_duplicate_and_unknown_protobuf_fields() -> None:
    name = raw_label(b"__name__", b"up")
    twice = ld(1, ld(1, b"gpu") + ld(2, b"0") + ld(2, b"1"))  # Label.value sent twice
    exemplar = ld(3, b"")  # TimeSeries.exemplars: not Remote-Write 1.0
    sample = raw_sample(NOW_MS, 1.0)
    fixed32 = varint(15 << 3 | 5) + b"\x00\x00\x00\x00"  # WriteRequest field 15, wire type 5
    body = ld(1, name + twice + sample) + ld(1, name + exemplar + sample) + fixed32
    async with receiver() as rx:
        status, _ = await post(rx, snappy.compress(body))
    assert status == 400
    assert rules(rx) == ["proto-unknown-field", "proto-duplicate-field", "proto-unknown-field"]
    assert [v.message for v in rx.violations] == [
        "WriteRequest has fields [15]",
        "Label field 2 sent twice",
        "TimeSeries has field 3",
    ]


@pytest.mark.parametrize("flavour", ["thanos", "mimir"])
async def test_unknown_top_level_field_alone_is_refused(flavour: str) -> None:
    body = snappy.uncompress(request((GOOD, [(NOW_MS, 1.0)]))) + ld(5, b"symbols")  # RW 2.0's
    async with receiver(flavour=flavour) as rx:
        status, text = await post(rx, snappy.compress(body))
    assert status == 400
    assert "WriteRequest has fields [5]" in text
    assert rules(rx) == ["proto-unknown-field"]
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}


async def test_invalid_utf8_names_the_label() -> None:
    body = ld(
        1, raw_label(b"__name__", b"up") + raw_label(b"gpu", b"\xff\xfe") + raw_sample(NOW_MS, 1.0)
    )
    async with receiver(flavour="mimir") as rx:
        status, text = await post(rx, snappy.compress(body))
    assert status == 400
    assert rules(rx) == ["label-value-invalid-utf8"]
    assert (
        "received a series with invalid value in label 'gpu': '\ufffd\ufffd' metric: 'up'" in text
    )
    assert "(err-mimir-label-value-invalid)" in text


async def test_metadata_is_counted_not_refused() -> None:
    req = remote_pb2.WriteRequest()
    req.metadata.add(metric_family_name="DCGM_FI_DEV_POWER_USAGE", help="Power draw (in W).")
    async with receiver() as rx:
        assert await post(rx, bytes(snappy.compress(req.SerializeToString()))) == (200, "")
    assert rx.metadata == 1
    rx.assert_conformant()


async def test_scripted_replies_come_first_and_store_nothing() -> None:
    body = request((GOOD, [(NOW_MS, 1.0)]))
    async with receiver(
        script=[Reply(503, "try later"), Reply(429, headers={"Retry-After": "1"})]
    ) as rx:
        assert await post(rx, body) == (503, "try later")
        assert (await post(rx, body))[0] == 429
        assert await post(rx, body) == (200, "")
    assert rx.statuses == [503, 429, 200]
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}
    rx.assert_conformant()


async def test_wait_async_on_the_receivers_own_loop() -> None:
    async with receiver() as rx:
        with pytest.raises(RuntimeError, match="wait_async"):
            rx.wait(lambda r: True)
        await post(rx, request((GOOD, [(NOW_MS, 1.0)])))
        await rx.wait_async(lambda r: len(r.samples) == 1, timeout_s=5)
        with pytest.raises(AssertionError, match="not met within"):
            await rx.wait_async(lambda r: r.requests == 2, timeout_s=0.05)


def test_thread_mode_for_sync_tests() -> None:
    def send(rx: ConformanceReceiver, body: bytes) -> int:
        req = urllib.request.Request(rx.url, data=body, headers=HEADERS, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            err.close()
            return err.code

    with receiver() as rx:
        assert send(rx, request((GOOD, [(NOW_MS, 1.0)]))) == 200
        assert send(rx, request((NAIVE, [(NOW_MS, 1.0)]))) == 409
        rx.wait(lambda r: r.requests == 2, timeout_s=5)
        with pytest.raises(AssertionError, match="not met within"):
            rx.wait(lambda r: r.requests == 3, timeout_s=0.05)
    with pytest.raises(AssertionError, match=r"1 violation\(s\):\nrequest 2: labels-not-sorted"):
        rx.assert_conformant()
    rx.assert_conformant(ignore=["labels-not-sorted"])
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}


def test_standalone_prints_a_report_on_sigint() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, str(CONFORMANCE), "--port", "0", "--past-window-s", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:")
        req = urllib.request.Request(line.split()[-1], headers=HEADERS)
        req.data = request((NAIVE, [(1000, 1.0)]))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        refused.value.close()
        assert refused.value.code == 409
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert '"labels-not-sorted": 1' in out
    assert "request 1: labels-not-sorted: label 'DCGM_FI_DRIVER_VERSION' after '__name__'" in out


# Remote-Write 2.0 (2.0-rc.4): the literals below are the spec's, not the module's constants.
HEADERS_V2 = {
    **HEADERS,
    "Content-Type": "application/x-protobuf;proto=io.prometheus.write.v2.Request",
    "X-Prometheus-Remote-Write-Version": "2.0.0",
}
Metadata = writev2_pb2.Metadata
OTHER = (("__name__", "DCGM_FI_DEV_GPU_TEMP"), ("gpu", "0"))


def written(samples: int, histograms: int = 0, exemplars: int = 0) -> dict[str, str]:
    return {
        "X-Prometheus-Remote-Write-Samples-Written": str(samples),
        "X-Prometheus-Remote-Write-Histograms-Written": str(histograms),
        "X-Prometheus-Remote-Write-Exemplars-Written": str(exemplars),
    }


class V2:
    """An io.prometheus.write.v2.Request whose strings are interned as a sender must; a test then
    plants one fault in ``req`` or in a series that ``series`` returns."""

    def __init__(self) -> None:
        self.req = writev2_pb2.Request(symbols=[""])
        self._refs = {"": 0}

    def ref(self, text: str) -> int:
        if text not in self._refs:
            self._refs[text] = len(self.req.symbols)
            self.req.symbols.append(text)
        return self._refs[text]

    def series(
        self,
        labels: Sequence[tuple[str, str]],
        samples: Sequence[tuple[int, float]] = ((NOW_MS, 1.0),),
        *,
        kind: int = Metadata.METRIC_TYPE_GAUGE,
        help_: str = "Power draw (in W).",
        unit: str = "watts",
        start_ms: int = 0,
    ) -> Any:
        ts = self.req.timeseries.add()
        for name, value in labels:
            ts.labels_refs.extend([self.ref(name), self.ref(value)])
        for t, v in samples:
            ts.samples.add(timestamp=t, value=v, start_timestamp=start_ms)
        ts.metadata.type = kind
        ts.metadata.help_ref = self.ref(help_)
        ts.metadata.unit_ref = self.ref(unit)
        return ts

    def body(self) -> bytes:
        return bytes(snappy.compress(self.req.SerializeToString()))


def v2_request(*series: Series) -> bytes:
    v2 = V2()
    for labels, samples in series:
        v2.series(labels, samples)
    return v2.body()


async def test_v2_conformant_request_is_stored_with_written_headers() -> None:
    energy = (("__name__", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"), ("gpu", "0"))
    v2 = V2()
    v2.series(GOOD, [(NOW_MS, 1.5), (NOW_MS + 1000, STALE)])
    counter = Metadata.METRIC_TYPE_COUNTER
    start = NOW_MS - 60_000
    v2.series(
        energy, [(NOW_MS, 7.0)], kind=counter, help_="Energy (in mJ).", unit="", start_ms=start
    )
    async with receiver() as rx:
        assert await exchange(rx, v2.body(), HEADERS_V2) == (204, "", written(3))
    assert rx.violations == []
    assert rx.samples[GOOD][0] == (NOW_MS, 1.5)
    assert is_stale_marker(rx.samples[GOOD][1][1])
    assert rx.samples[energy] == [(NOW_MS, 7.0)]
    assert rx.metadata_of == {
        GOOD: ("gauge", "Power draw (in W).", "watts"),
        energy: ("counter", "Energy (in mJ).", ""),
    }
    assert rx.start_timestamps == {energy: {start}}
    assert rx.protocols == ["2.0"]
    assert rx.written == [Written(samples=3)]
    assert rx.report()["protocols"] == {"1.0": 0, "2.0": 1}
    rx.assert_conformant()


def _odd(v2: V2, ts: Any) -> None:
    ts.labels_refs.append(v2.ref("gpu"))


def _label_out_of_range(v2: V2, ts: Any) -> None:
    ts.labels_refs[1] = len(v2.req.symbols) + 5


def _help_out_of_range(v2: V2, ts: Any) -> None:
    ts.metadata.help_ref = 999


def _no_samples(v2: V2, ts: Any) -> None:
    ts.ClearField("samples")


def _with_histogram(v2: V2, ts: Any) -> None:
    ts.histograms.add(timestamp=NOW_MS, count_int=1)


def _name_first(v2: V2, ts: Any) -> None:
    ts.ClearField("labels_refs")
    for name, value in NAIVE:
        ts.labels_refs.extend([v2.ref(name), v2.ref(value)])


def _empty_value(v2: V2, ts: Any) -> None:
    ts.labels_refs[-1] = 0  # gpu=""


def _out_of_order(v2: V2, ts: Any) -> None:
    ts.samples.add(timestamp=NOW_MS - 1, value=2.0)


# (fault, rule, Thanos' status): the other series of the request is stored all the same.
V2_SERIES_CASES: dict[str, tuple[Callable[[V2, Any], None], str, int]] = {
    "odd-labels-refs": (_odd, "v2-labels-refs-odd", 400),
    "label-ref-out-of-range": (_label_out_of_range, "v2-ref-out-of-range", 400),
    "help-ref-out-of-range": (_help_out_of_range, "v2-ref-out-of-range", 400),
    "no-samples": (_no_samples, "v2-no-samples", 400),
    "samples-and-histograms": (_with_histogram, "v2-samples-and-histograms", 400),
    "name-first": (_name_first, "labels-not-sorted", 409),
    "empty-value": (_empty_value, "label-value-empty", 409),
}


@pytest.mark.parametrize("case", V2_SERIES_CASES)
async def test_v2_series_rules_drop_the_series_and_count_the_rest(case: str) -> None:
    fault, rule, status = V2_SERIES_CASES[case]
    v2 = V2()
    v2.series(OTHER, [(NOW_MS, 40.0)])
    fault(v2, v2.series(GOOD))
    async with receiver() as rx:
        got = await exchange(rx, v2.body(), HEADERS_V2)
    assert (got[0], got[2]) == (status, written(1))
    assert rules(rx) == [rule]
    assert rx.samples == {OTHER: [(NOW_MS, 40.0)]}
    assert rx.written == [Written(samples=1)]
    assert list(rx.metadata_of) == [OTHER]


async def test_v2_sample_rules_keep_the_rest_of_the_series() -> None:
    async with receiver() as rx:
        samples = [(NOW_MS, 1.0), (NOW_MS - 1, 2.0), (NOW_MS + 1, 3.0)]
        status, _, got = await exchange(rx, v2_request((GOOD, samples)), HEADERS_V2)
    assert (status, got) == (409, written(2))
    assert rules(rx) == ["sample-out-of-order"]
    assert rx.samples[GOOD] == [(NOW_MS, 1.0), (NOW_MS + 1, 3.0)]


@pytest.mark.parametrize(
    ("flavour", "body"),
    [
        ("thanos", "add 1 series: v2-labels-refs-odd: labels_refs has 13 refs, not pairs"),
        ("mimir", "labels_refs has 13 refs, not pairs series: '{DCGM_FI_DRIVER_VERSION="),
    ],
)
async def test_v2_rules_in_each_flavour(flavour: str, body: str) -> None:
    v2 = V2()
    _odd(v2, v2.series(GOOD))
    async with receiver(flavour=flavour) as rx:
        status, text, got = await exchange(rx, v2.body(), HEADERS_V2)
    assert (status, got) == (400, written(0))
    assert text.startswith(body)
    assert text.endswith("(conformance-v2-labels-refs-odd)") == (flavour == "mimir")


@pytest.mark.parametrize("first", ["x", None])
async def test_v2_symbols_must_start_with_the_empty_string(first: str | None) -> None:
    v2 = V2()
    v2.series(GOOD, unit="W")  # no ref to symbol 0, so only the table itself is wrong
    v2.series(OTHER, help_="Temperature.", unit="C")
    if first is None:
        v2.req.ClearField("symbols")
    else:
        v2.req.symbols[0] = first
    async with receiver() as rx:
        status, text, got = await exchange(rx, v2.body(), HEADERS_V2)
    assert (status, got) == (400, written(0))
    assert text.startswith("v2-symbols-first-not-empty: ")
    assert rules(rx) == ["v2-symbols-first-not-empty"]
    assert rx.samples == {}


@pytest.mark.parametrize(
    ("version", "status"),
    [("2.0.0", 204), ("2.1.0", 204), ("0.1.0", 400), ("2.0", 400), (None, 400)],
)
async def test_v2_version_header(version: str | None, status: int) -> None:
    headers = {k: v for k, v in HEADERS_V2.items() if k != "X-Prometheus-Remote-Write-Version"}
    if version is not None:
        headers["X-Prometheus-Remote-Write-Version"] = version
    async with receiver() as rx:
        got, _, counts = await exchange(rx, v2_request((GOOD, [(NOW_MS, 1.0)])), headers)
    assert (got, counts) == (status, written(1 if status == 204 else 0))
    assert rules(rx) == ([] if status == 204 else ["header-version"])


@pytest.mark.parametrize("require", [False, True])
async def test_v2_metadata_on_every_series(require: bool) -> None:
    v2 = V2()
    v2.series(GOOD).ClearField("metadata")
    typeless = Metadata.METRIC_TYPE_UNSPECIFIED
    v2.series(OTHER, help_="Temperature (in C).", unit="celsius", kind=typeless)
    async with receiver(require_metadata=require) as rx:
        status, text, got = await exchange(rx, v2.body(), HEADERS_V2)
    assert rules(rx) == ["v2-metadata-missing", "v2-metadata-missing"]
    assert [v.message for v in rx.violations] == [
        "no metadata: want type, help and unit",
        "metadata without a type: want type, help and unit",
    ]
    if require:  # a receiver MAY reject them
        assert (status, got) == (400, written(0))
        assert rx.samples == {}
        assert [v.samples for v in rx.violations] == [1, 1]
        return
    assert (status, text, got) == (204, "", written(2))  # a SHOULD: stored, and only recorded
    assert set(rx.samples) == {GOOD, OTHER}
    assert rx.metadata_of == {OTHER: ("unknown", "Temperature (in C).", "celsius")}
    with pytest.raises(AssertionError, match="request 1: v2-metadata-missing: no metadata"):
        rx.assert_conformant()
    rx.assert_conformant(ignore=["v2-metadata-missing"])


async def test_v2_histograms_and_exemplars_are_stored_and_counted() -> None:
    latency = (("__name__", "hfsampler_push_seconds"), ("shard", "0"))
    v2 = V2()
    hist = v2.series(latency, [], kind=Metadata.METRIC_TYPE_HISTOGRAM, unit="seconds")
    hist.histograms.add(
        timestamp=NOW_MS, count_int=3, zero_count_int=3, sum=1.5, start_timestamp=NOW_MS - 5000
    )  # valid as Prometheus validates: the count is the buckets' (here the zero bucket's)
    power = v2.series(GOOD)
    power.exemplars.add(
        labels_refs=[v2.ref("trace_id"), v2.ref("ab12")], value=1.0, timestamp=NOW_MS
    )
    power.exemplars.add(value=2.0)  # no timestamp
    async with receiver() as rx:
        status, text, got = await exchange(rx, v2.body(), HEADERS_V2)
    assert (status, got) == (400, written(1, 1, 1))
    assert (
        text
        == "add 1 exemplars: v2-exemplar-timestamp-missing: exemplar of value 2.0 has no timestamp"
    )
    assert rules(rx) == ["v2-exemplar-timestamp-missing"]
    assert rx.histograms == {latency: [(NOW_MS, hist.histograms[0].SerializeToString())]}
    assert rx.exemplars == {GOOD: [((("trace_id", "ab12"),), 1.0, NOW_MS)]}
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}
    assert rx.start_timestamps == {latency: {NOW_MS - 5000}}
    assert rx.metadata_of[latency] == ("histogram", "Power draw (in W).", "seconds")


async def test_v2_wire_details_a_runtime_accepts_and_invalid_utf8() -> None:
    unpacked = b"".join(varint(1 << 3) + varint(ref) for ref in (1, 2))  # refs as single varints
    packed = ld(1, bytes([1, 2, 3, 4]))  # __name__="up", gpu=b"\xff"
    sample, meta = raw_sample(NOW_MS, 1.0), ld(5, b"\x08\x02")  # a gauge
    symbols = b"".join(ld(4, s) for s in (b"", b"__name__", b"up", b"gpu", b"\xff"))
    body = ld(5, unpacked + sample + meta) + ld(5, packed + sample + meta) + symbols
    async with receiver() as rx:
        status, _, got = await exchange(rx, snappy.compress(body), HEADERS_V2)
    assert (status, got) == (400, written(1))  # symbols last, refs unpacked: both fine
    assert rx.samples == {(("__name__", "up"),): [(NOW_MS, 1.0)]}
    assert rules(rx) == ["label-value-invalid-utf8"]


async def test_a_body_of_the_other_message_is_named() -> None:
    async with receiver() as rx:
        v1_as_v2 = await exchange(rx, request((GOOD, [(NOW_MS, 1.0)])), HEADERS_V2)
        v2_as_v1 = await exchange(rx, v2_request((GOOD, [(NOW_MS, 1.0)])), HEADERS)
    assert v1_as_v2 == (
        400,
        "add 1 requests: proto-unknown-field: Request has fields [1] (a 1.0 WriteRequest body?)",
        written(0),
    )
    assert v2_as_v1 == (
        400,
        "add 1 requests: proto-unknown-field: WriteRequest has fields [4, 5] (a 2.0 Request body?)",
        {},
    )
    assert rx.samples == {}


async def test_timestamp_order_spans_1_0_and_2_0_requests() -> None:
    async with receiver() as rx:
        assert await post(rx, request((GOOD, [(NOW_MS, 1.0)]))) == (200, "")
        older = await exchange(rx, v2_request((GOOD, [(NOW_MS - 1000, 2.0)])), HEADERS_V2)
        again = await exchange(rx, v2_request((GOOD, [(NOW_MS, 1.0)])), HEADERS_V2)
        newer = await exchange(rx, v2_request((GOOD, [(NOW_MS + 1000, 3.0)])), HEADERS_V2)
        late = await post(rx, request((GOOD, [(NOW_MS + 500, 4.0)])))
    assert older == (409, "add 1 samples: out of order sample", written(0))
    assert again == (
        409,
        "add 1 samples: duplicate sample for timestamp (identical resend)",
        written(0),
    )
    assert newer == (204, "", written(1))
    assert late == (409, "add 1 samples: out of order sample")
    assert rules(rx) == ["sample-out-of-order", "sample-duplicate", "sample-out-of-order"]
    assert rx.samples == {GOOD: [(NOW_MS, 1.0), (NOW_MS + 1000, 3.0)]}
    assert rx.protocols == ["1.0", "2.0", "2.0", "2.0", "1.0"]
    assert rx.written == [None, Written(), Written(), Written(samples=1), None]
    assert rx.report()["protocols"] == {"1.0": 2, "2.0": 3}


@pytest.mark.parametrize(
    ("accept", "refused"),
    [(["prometheus.WriteRequest"], "2.0"), (["io.prometheus.write.v2.Request"], "1.0")],
)
async def test_a_message_the_receiver_does_not_accept_is_415(
    accept: list[str], refused: str
) -> None:
    v1 = (request((GOOD, [(NOW_MS, 1.0)])), HEADERS)
    v2 = (v2_request((GOOD, [(NOW_MS, 1.0)])), HEADERS_V2)
    first, then = (v2, v1) if refused == "2.0" else (v1, v2)
    async with receiver(accept=accept) as rx:
        status, text, got = await exchange(rx, *first)
        fallback = await exchange(rx, *then)
    assert (status, got) == (415, {})
    assert "is not accepted here" in text
    assert fallback[0] in (200, 204)
    assert rx.violations == []  # trying 2.0 and falling back on 415 is what the spec asks
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}
    assert rx.protocols == [refused, {"1.0": "2.0", "2.0": "1.0"}[refused]]
    assert rx.written[0] is None


async def test_no_written_headers_where_2_0_is_not_negotiated() -> None:
    body = v2_request((GOOD, [(NOW_MS, 1.0)]))
    gzip = {**HEADERS_V2, "Content-Encoding": "gzip"}
    async with receiver(
        accept=["prometheus.WriteRequest"], tenant_header=THANOS_TENANT_HEADER
    ) as rx:
        no_tenant = await exchange(rx, body, HEADERS_V2)
    async with receiver() as rx2:
        gzipped = await exchange(rx2, body, gzip)
        get = await exchange(rx2, body, HEADERS_V2, method="PUT")
    assert (no_tenant[0], no_tenant[2]) == (400, {})  # 2.0 not accepted: never the headers
    assert (gzipped[0], gzipped[2]) == (415, {})  # negotiation failed
    assert (get[0], get[2]) == (405, written(0))  # negotiated, then refused: all zero


async def test_legacy_receiver_reads_a_v2_body_as_an_empty_v1_request() -> None:
    async with receiver(legacy_v1_only=True) as rx:
        v2 = await exchange(rx, v2_request((GOOD, [(NOW_MS, 1.0)])), HEADERS_V2)
        v1 = await exchange(rx, request((GOOD, [(NOW_MS, 1.0)])))
        naive = await exchange(rx, request((NAIVE, [(NOW_MS, 1.0)])))
    assert v2 == (204, "", {})  # no Written headers: how a sender tells it met a 1.x receiver
    assert v1 == (204, "", {})
    assert naive == (409, "add 1 series: out of order labels", {})  # 1.0's rules still hold
    assert rules(rx) == ["labels-not-sorted"]
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}  # from the 1.0 request only
    assert rx.protocols == ["2.0", "1.0", "1.0"]
    assert rx.written == [None, None, None]


def test_bad_configuration_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"Limits\.max_label_value_bytes must be positive"):
        Limits(max_label_value_bytes=0)
    with pytest.raises(ValueError, match="flavour must be 'thanos' or 'mimir'"):
        ConformanceReceiver(flavour="cortex")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accept must name some of"):
        ConformanceReceiver(accept=["io.prometheus.write.v3.Request"])
    with pytest.raises(ValueError, match="accept must name some of"):
        ConformanceReceiver(accept=[])
    with pytest.raises(ValueError, match="accept has no effect with legacy_v1_only"):
        ConformanceReceiver(accept=["prometheus.WriteRequest"], legacy_v1_only=True)


def v1_histograms(labels: Sequence[tuple[str, str]], *hists: Any) -> bytes:
    """A snappy-compressed 1.0 WriteRequest of one series carrying ``hists`` (prompb messages)."""
    req = remote_pb2.WriteRequest()
    ts = req.timeseries.add()
    for name, value in labels:
        ts.labels.add(name=name, value=value)
    for h in hists:
        ts.histograms.add().CopyFrom(h)
    return bytes(snappy.compress(req.SerializeToString()))


def v1_hist(ts: int, count: int, hint: int = 2) -> Any:
    h = types_pb2.Histogram(timestamp=ts, count_int=count, zero_count_int=0, schema=3, sum=9.0)
    h.positive_spans.add(offset=5, length=1)
    h.positive_deltas.append(count)
    h.reset_hint = hint  # type: ignore[assignment]
    return h


HIST = (("__name__", "DCGM_FI_DEV_POWER_USAGE_histogram"), ("gpu", "0"))


async def test_v1_histograms_are_stored_and_checked_as_prometheus_validates() -> None:
    bad = v1_hist(NOW_MS + 2000, 5)
    bad.positive_deltas[0] = 4  # buckets hold 4, count says 5
    async with receiver() as rx:
        assert await post(
            rx, v1_histograms(HIST, v1_hist(NOW_MS, 2, 1), v1_hist(NOW_MS + 1000, 3))
        ) == (200, "")
        status, _ = await post(rx, v1_histograms(HIST, bad))
        assert status == 400
        status, _ = await post(rx, v1_histograms(HIST, v1_hist(NOW_MS + 3000, 1)))
        assert status == 400
        status, _ = await post(rx, request((HIST, [(NOW_MS + 4000, 1.0)])))
        assert status == 400
    assert [ts for ts, _ in rx.histograms[HIST]] == [NOW_MS, NOW_MS + 1000]
    assert rules(rx) == ["histogram-invalid", "histogram-reset-hint", "samples-and-histograms"]
    assert "4 observations found in buckets, but count 5" in rx.violations[0].message
    assert "counts went down" in rx.violations[1].message


async def test_a_receiver_without_histograms_refuses_the_whole_request() -> None:
    body = v1_histograms(HIST, v1_hist(NOW_MS, 2, 1))
    async with receiver(refuse_histograms=(400, "native histograms are disabled")) as rx:
        assert await post(rx, body) == (400, "native histograms are disabled")
        assert await post(rx, request((GOOD, [(NOW_MS, 1.0)]))) == (200, "")
    assert rx.violations == []
    assert rx.histograms == {}
    assert rx.samples == {GOOD: [(NOW_MS, 1.0)]}

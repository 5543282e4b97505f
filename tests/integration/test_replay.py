"""`hfsampler replay` into real Prometheus and VictoriaMetrics: the replayed series are the file's.

One sim recording around a short child command, replayed (window series, then ``--raw``) into
each receiver (Prometheus 2 and 3, VictoriaMetrics); each receiver's stored ``_max`` series must
equal the recording's window maxima at the window ends, and the raw series its distinct samples
(VictoriaMetrics keeps 12 significant digits of a float, so values compare to 1e-11 relative
there; Prometheus's are bit-exact).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import receivers as rx

from hfsampler.profiling.recording import Recording
from hfsampler.sampling.window import MAX

pytestmark = [pytest.mark.integration, pytest.mark.long]

POWER = "DCGM_FI_DEV_POWER_USAGE_INSTANT"


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_id = uuid.uuid4().hex[:12]
    path = tmp_path_factory.mktemp("replay") / "run.hfs"
    done = subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "--label",
         f"run={run_id}", "-o", str(path), "--", sys.executable, "-c",
         "import time; time.sleep(3)"],
        env=rx.hfsampler_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return path, run_id


@pytest.mark.parametrize("name", rx.RECEIVER_NAMES)
def test_replayed_max_equals_recording(
    receivers: dict[str, rx.Receiver], recording: tuple[Path, str], name: str
) -> None:
    receiver = receivers[name]
    path, run_id = recording
    log_at = len(receiver.log_text())
    result = rx.run_cli(["replay", str(path), "--remote-write", receiver.write_url])
    result.check()
    rec = Recording(path)
    group, col = rec.locate(POWER) or (0, 0)
    w = rec.windows(group)
    start_ns, end_ns = rec.time_range_ns()
    got = receiver.raw_samples(f'{POWER}_max{{run="{run_id}"}}', start_ns / 1e9 - 1,
                               end_ns / 1e9 + 2)  # fmt: skip
    assert len(got) == len(rec.devices)
    for labels, samples in got.items():
        gpu = int(dict(labels)["gpu"])
        pos = [d.index for d in rec.devices].index(gpu)
        want = [
            (int(t // 1_000_000), float(v))
            for t, v in zip(w.t1_ns, w[MAX][:, pos, col], strict=True)
            if np.isfinite(v)
        ]
        _same(samples, want)
    assert receiver.log_problems(since=log_at) == []

    raw = rx.run_cli(["replay", str(path), "--raw", "--remote-write", receiver.write_url])
    raw.check()
    got_raw = receiver.raw_samples(f'{POWER}_raw{{run="{run_id}",gpu="0"}}', start_ns / 1e9 - 1,
                                   end_ns / 1e9 + 2)  # fmt: skip
    ts, v = rec.raw(POWER, 0)
    ms = ts // 1000
    keep = np.append(ms[1:] != ms[:-1], True)  # the last sample of each millisecond
    assert len(got_raw) == 1
    _same(next(iter(got_raw.values())), list(zip(ms[keep].tolist(), v[keep].tolist(), strict=True)))


def _same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    """Timestamps exact; values exact but for VictoriaMetrics' 12 significant decimal digits."""
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-11, abs=0)

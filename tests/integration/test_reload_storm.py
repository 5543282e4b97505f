"""A SIGHUP storm: 50 reloads 50 ms apart, alternating two files, converge on the last one with
every window delivered once and in order to the strict receiver.

The two files differ as an operator's edits do: an external label, an endpoint's
``remote_timeout`` (its writer is replaced, its queue handed to the new one) and a second
endpoint that comes and goes. It used to send a spooled endpoint's batch in flight twice (the
old writer was cancelled mid-request and the new one sent the spool again), which the
conformance receiver refuses as a duplicate, and Prometheus as out of order when the two
overlapped.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import receivers as rx
import yaml
from conformance import ConformanceReceiver

pytestmark = [pytest.mark.integration, pytest.mark.long]

POWER_MAX = "DCGM_FI_DEV_POWER_USAGE_max"
STORM = 50
GAP_S = 0.05
# Half-second windows: the waits before and after the storm are counted in windows, and the
# storm's 2.5 s spans five windows instead of two or three (more batches caught mid-reload).
WINDOW_MS = 500


def _config(k: int, a: str, b: str, queue_dir: Path | None) -> dict[str, object]:
    """The file of step ``k``: even steps have one endpoint and dc=a, odd ones two and dc=b."""
    endpoints: list[dict[str, object]] = [
        {"url": a, "name": "a", "remote_timeout": "5s" if k % 2 == 0 else "7s"}
    ]
    if k % 2:
        endpoints.append({"url": b, "name": "b"})
    config: dict[str, object] = {
        "external_labels": {"dc": "a" if k % 2 == 0 else "b"},
        "remote_write": endpoints,
    }
    if queue_dir is not None:
        config["queue_dir"] = str(queue_dir)
    return config


def _write(path: Path, text: str) -> None:
    """Replace the file at once, as an editor or a config manager does (no half-written read)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _gpu0_windows(rx_: ConformanceReceiver, dc: str) -> list[int]:
    found = rx_.series_named(POWER_MAX, gpu="0", dc=dc)
    return sorted(t for samples in found.values() for t, v in samples if v == v)


@pytest.mark.parametrize("spooled", [True, False], ids=["queue_dir", "memory"])
def test_a_sighup_storm_converges_with_each_window_once(tmp_path: Path, spooled: bool) -> None:
    path = tmp_path / "hfsampler.yml"
    log_path = tmp_path / "hfsampler.log"
    queue_dir = tmp_path / "queue" if spooled else None
    with ConformanceReceiver() as a, ConformanceReceiver() as b:
        # the two files, even and odd, written out once: dumping YAML at each step stretched
        # the 50 ms gaps to 80 on a loaded machine
        files = [yaml.safe_dump(_config(k, a.url, b.url, queue_dir)) for k in (0, 1)]
        _write(path, files[0])
        args = ["run", "--source", "sim", "--gpus", "2", "--config", str(path), "--listen", ""]
        proc = rx.spawn_cli([*args, "--window", f"{WINDOW_MS}ms"], log_path)
        try:
            a.wait(lambda r: len(_gpu0_windows(r, "a")) >= 2, 60)
            for k in range(1, STORM + 1):
                _write(path, files[k % 2])
                os.kill(proc.pid, signal.SIGHUP)
                time.sleep(GAP_S)
            # the last file (step 50: dc=a, endpoint a alone) is what runs afterwards
            after = time.time() * 1000
            a.wait(lambda r: sum(t > after for t in _gpu0_windows(r, "a")) >= 3, 30)
        finally:
            code = rx.stop_cli(proc)
    log = log_path.read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    a.assert_conformant()
    b.assert_conformant()
    assert "dropping" not in log, log[-3000:]
    assert "refused" not in log, log[-3000:]
    # every window went to `a` once, under whichever file ran when it was made: one value per
    # timestamp across dc=a and dc=b, none missing from the first to the last
    stamps = sorted(_gpu0_windows(a, "a") + _gpu0_windows(a, "b"))
    every = list(range(stamps[0], stamps[-1] + 1, WINDOW_MS))
    assert stamps == every, "a window lost or sent twice"
    assert log.count("configuration reloaded") >= 1

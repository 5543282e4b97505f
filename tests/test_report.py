"""`hfsampler report` opened in headless Chromium: plots render, the console has no error.

Chromium runs from Debian's ``chromium`` package with a fresh profile; where it is missing the
test skips, except under CI, where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
)  # fmt: skip
CONSOLE_ERROR = re.compile(r"CONSOLE.*(error|uncaught)|Uncaught", re.IGNORECASE)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "chromium not found: apt-get install --no-install-recommends chromium"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {message}", pytrace=False)
        pytest.skip(message)
    return found


def run_chromium(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="hfs-chromium-") as profile:
        return subprocess.run(
            [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL,
        )  # fmt: skip


def decode_png(data: bytes) -> np.ndarray:
    """8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes) to an [h, w, channels] array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8
            assert color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + width * channels)
    out = np.zeros((height, width * channels), np.int64)
    prev = np.zeros(width * channels, np.int64)
    for y in range(height):
        line, kind = raw[y, 1:].astype(np.int64), raw[y, 0]
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) % 256
        else:  # sub, average, paeth: byte by byte
            cur = np.zeros_like(line)
            for x in range(len(line)):
                a = cur[x - channels] if x >= channels else 0
                b, c = prev[x], (prev[x - channels] if x >= channels else 0)
                if kind == 1:
                    pred = a
                elif kind == 3:
                    pred = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (line[x] + pred) % 256
        out[y], prev = cur, cur
    return out.reshape(height, width, channels)


def test_report_renders_in_chromium(tmp_path: Path) -> None:
    browser = chromium()
    del browser
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = tmp_path / "run.hfs"
    recorded = subprocess.run(
        [sys.executable, "-m", "hfsampler", "record", "--source", "sim", "--quiet", "--duration",
         "2s", "-o", str(run)], env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert recorded.returncode == 0, recorded.stderr
    html = tmp_path / "report.html"
    made = subprocess.run([sys.executable, "-m", "hfsampler", "report", str(run), "-o", str(html)],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "http://" not in html.read_text().split("<script", 1)[0]  # no external resource
    url = html.as_uri()

    dom = run_chromium(url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    errors = [line for line in dom.stderr.splitlines() if CONSOLE_ERROR.search(line)]
    assert errors == []
    assert dom.stdout.count('class="main-svg"') >= 3 * 2  # plotly drew every figure (2 GPUs + 1)
    assert "js-plotly-plot" in dom.stdout

    shot = tmp_path / "shot.png"
    taken = run_chromium(url, f"--screenshot={shot}", "--window-size=1200,2000")
    assert taken.returncode == 0, taken.stderr[-2000:]
    pixels = decode_png(shot.read_bytes())[:, :, :3]
    plot_area = pixels[900:, :, :]  # below the tables: the first figure
    coloured = (np.ptp(plot_area, axis=2) > 60).mean()  # saturated, not grey text or white
    assert coloured > 0.002, f"only {coloured:.4%} coloured pixels: the plots did not render"

#!/usr/bin/env bash
# Measure NVML on this GPU machine for hfsampler (read-only; under 5 minutes): call and batched
# latency, refresh periods, tick rate, 1 kHz lateness, GPM (support, latency, finest valid sample
# spacing) and `hfsampler probe` (its table also written as OUT_DIR/probe-HOST-TIME.txt).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default benchmarks/results/)
# Uses the current python if hfsampler imports there; otherwise installs the package, with only
# its own dependencies, into a venv under /tmp and runs from there.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
out="${1:-$root/benchmarks/results}"
python="${PYTHON:-python3}"

# Checked from /tmp, where the script runs, so a checkout in the current directory does not count.
if ! (cd /tmp && "$python" -c 'import hfsampler, pynvml, numpy') 2>/dev/null; then
    venv="${HFSAMPLER_CHECK_VENV:-/tmp/hfsampler-gpu-check-venv}"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import hfsampler' 2>/dev/null; then
        echo "gpu_check: installing hfsampler into $venv"
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        "$venv/bin/python" -m pip install --quiet "$root"
    fi
    python="$venv/bin/python"
fi

# Run from outside the checkout so the installed (or importable) package is the one measured,
# with the script itself taken from the checkout.
cd /tmp
exec timeout 300 "$python" "$here/gpu_check.py" "$out"

"""Puts the fake libnvidia-ml under pynvml in every Python process of an integration run.

On ``PYTHONPATH`` only where a test sets ``HFSAMPLER_FAKE_NVML`` (a JSON scenario), so `hfsampler
run --source nvml` and the sampler process it spawns (a fresh interpreter, which imports this
module too) see the same fake GPUs. The scenario: ``gpus`` (count), ``mig`` ({gpu index: [[GPU
instance id, profile], ...]}: MIG on with those instances), and optionally ``change_file`` with
``mig_after``: once the test writes a wall-clock time (ns) into that file, the layout from that
time on, in every process alike. The test writes it when a receiver holds the first layout, so a
slow start on a loaded machine cannot skip it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

_SCENARIO = os.environ.get("HFSAMPLER_FAKE_NVML")

if _SCENARIO:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # for fake_nvml
    import fake_nvml as _fake
    import pynvml as _pynvml

    _spec = json.loads(_SCENARIO)
    _nvml = _fake.make_fake(int(_spec["gpus"]))

    def _apply(layouts: dict[str, list[list[object]]]) -> None:
        for key, layout in layouts.items():
            i = int(key)
            gpu = _nvml.gpus[i]
            _fake.enable_mig(gpu, i, [(int(gi), str(profile)) for gi, profile in layout])

    _apply(_spec.get("mig", {}))
    for _gpu in _nvml.gpus:
        _gpu.mig_capable = True  # the others: H100s with MIG mode off

    def _change_when_told(path: Path, after: dict[str, list[list[object]]]) -> None:
        while not path.exists():
            time.sleep(0.01)
        delay_s = (int(path.read_text()) - time.time_ns()) / 1e9
        time.sleep(max(delay_s, 0.0))
        _apply(after)

    if "change_file" in _spec:
        threading.Thread(
            target=_change_when_told,
            args=(Path(_spec["change_file"]), _spec["mig_after"]),
            daemon=True,
        ).start()
    _pynvml.nvmlLib = _fake.FakeLib(_nvml)
    _pynvml._nvmlGetFunctionPointer_cache = {}

"""Puts the fake libnvidia-ml under pynvml in every Python process of an integration run.

On ``PYTHONPATH`` only where a test sets ``HFSAMPLER_FAKE_NVML`` (a JSON scenario), so `hfsampler
run --source nvml` and the sampler process it spawns (a fresh interpreter, which imports this
module too) see the same fake GPUs. The scenario: ``gpus`` (count), ``mig`` ({gpu index: [[GPU
instance id, profile], ...]}: MIG on with those instances), and optionally ``change_at_ns`` with
``mig_after``, the layout from that wall-clock time on, in every process alike.
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
    _change_at = _spec.get("change_at_ns")
    if _change_at is not None:
        delay_s = (int(_change_at) - time.time_ns()) / 1e9
        _after = _spec["mig_after"]
        if delay_s <= 0:
            _apply(_after)
        else:
            timer = threading.Timer(delay_s, _apply, (_after,))
            timer.daemon = True
            timer.start()
    _pynvml.nvmlLib = _fake.FakeLib(_nvml)
    _pynvml._nvmlGetFunctionPointer_cache = {}

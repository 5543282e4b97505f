"""NVML's GPM (GPU Performance Monitoring, Hopper and newer) for the nvml source.

GPM gives activity ratios (SM active, tensor pipe, DRAM, FP64/32/16 pipes) and PCIe/NVLink
bandwidth that plain NVML fields lack: a metric is computed from two samples of the GPU's
performance counters taken some time apart. This module probes which devices support it (one
log line for those that do not) and, per field tuple, keeps two sample buffers per GPU and one
``c_nvmlGpmMetricsGet_t`` whose metric ids are set once; each ``read`` takes a new sample and
computes the metrics between it and the previous one. The driver refreshes the counters every
~100 ms (NVML's documentation asks for samples at least that far apart), so a pair inside one
refresh fails or repeats: that tick has no value and the older sample is kept. A MIG instance's
row is sampled with ``nvmlGpmMigSampleGet`` on its GPU and its GPU instance id (the source keeps
that map current as the layout changes); an instance without GPM is skipped, not an error.

Its NVML calls, constants and structs come from ``nvml_calls``, the only module that imports
``pynvml``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, FloatArray, IntArray
from hfsampler.sources.nvml import calls

log = logging.getLogger("hfsampler.sources.nvml.source")

# what nvmlGpmMigSampleGet answers for an instance that has no GPM or is gone: skipped quietly
_NO_INSTANCE_GPM = frozenset({*calls.UNSUPPORTED_CODES, calls.NOT_FOUND})

# (gpu row, NVML return code, cells affected) -> True when the GPU is now taken as lost
OnError = Callable[[int, int, int], bool]


def device_support(
    handles: Sequence[Any], up: BoolArray
) -> tuple[list[bool], dict[str, list[int]]]:
    """Per GPU whether GPM works there, and per reason the GPUs where it does not."""
    ok: list[bool] = []
    why: dict[str, list[int]] = {}
    for g, handle in enumerate(handles):
        if not up[g] or handle is None:
            ok.append(False)
            continue
        try:
            supported = calls.gpm_supported(handle)
        except calls.NvmlError as e:
            why.setdefault(calls.error_text(int(e.value)), []).append(g)
            ok.append(False)
            continue
        if not supported:
            why.setdefault("not a GPM device (Hopper or newer needed)", []).append(g)
        ok.append(supported)
    return ok, why


def probe(
    fields: Sequence[Field],
    cols: list[int],
    handles: Sequence[Any],
    up: BoolArray,
    gpus_text: Callable[[Sequence[int]], str],
    on_error: OnError | None = None,
    *,
    rows: Sequence[int] | None = None,
    mig: dict[int, tuple[Any, int]] | None = None,
    say: Callable[..., object] = log.warning,
    tell: Callable[..., object] = log.info,
) -> tuple[GpmReader | None, list[int]]:
    """A reader and the GPU rows that support GPM; one log line for the rows that do not.

    ``rows``: the GPUs' rows to probe (None: all); ``mig``: the source's live map of MIG slot
    rows to (GPU handle, GPU instance id), which the reader samples those rows by. ``say`` and
    ``tell`` log what the probe finds (debug in the sampler process's reopen: said once).
    """
    names = f"GPM activity metrics ({len(cols)} DCGM_FI_PROF_* fields)"
    probed = list(range(len(handles)) if rows is None else rows)
    found, why = device_support([handles[g] for g in probed], up[probed])
    ok = [False] * len(handles)
    for g, yes in zip(probed, found, strict=True):
        ok[g] = yes
    missing = [g for g in probed if not ok[g]]
    if missing:
        reasons = "; ".join(why) or "GPU down"
        say("%s not supported on GPU %s (%s): skipped", names, gpus_text(missing), reasons)
    supported = [g for g in probed if ok[g]]
    if not supported:
        return None, []
    lacking = [
        fields[c].name for c in cols if calls.gpm_metric_id(fields[c].gpm_metric or "") is None
    ]
    if lacking:
        say("this pynvml lacks the GPM metric of %s: skipped", ", ".join(lacking))
    reader = GpmReader(handles, on_error or (lambda g, code, cells: False), mig)
    try:
        reader.open(tell)
    except calls.NvmlError as e:
        say("%s: %s; skipped", names, calls.error_text(int(e.value)))
        return None, []
    return reader, supported


@dataclass(slots=True)
class GpmPlan:
    """One field tuple's GPM work: its columns, metric ids, buffers and per-GPU sample pairs."""

    cols: list[int]  # columns of ``values`` this plan fills
    scale: FloatArray  # [n]
    mask: BoolArray  # [gpu, n]: cells read through GPM
    rows: list[int]  # GPUs with at least one such cell
    request: Any  # c_nvmlGpmMetricsGet_t with version, numMetrics and metric ids set
    prev: list[Any]  # per GPU, the older sample (c_nvmlGpmSample_t)
    cur: list[Any]  # per GPU, the buffer the next sample goes into
    have_prev: list[bool]
    names: list[str]  # field names, for the log line of a metric a GPU turns out to lack


class GpmReader:
    """GPM for the nvml source's devices; the source owns handles, up flags and error counting."""

    def __init__(
        self,
        handles: Sequence[Any],
        on_error: OnError,
        mig: dict[int, tuple[Any, int]] | None = None,
    ) -> None:
        self.on_error = on_error
        self._handles = handles  # the source's own list: MIG slots' handles change in it
        self._mig = mig if mig is not None else {}
        self._plans: list[GpmPlan] = []
        self._sample: Any = None
        self._mig_sample: Any = None
        self._metrics: Any = None

    def open(self, tell: Callable[..., object] = log.info) -> None:
        # The C entry points, as the field-value batch does: pynvml's wrappers allocate per call.
        self._sample = calls.c_function("nvmlGpmSampleGet")
        self._metrics = calls.c_function("nvmlGpmMetricsGet")
        try:
            self._mig_sample = calls.gpm_mig_sample_function()
        except calls.NvmlError as e:
            reason = calls.error_text(int(e.value))
            tell("nvmlGpmMigSampleGet: %s; no GPM per MIG instance", reason)

    @property
    def mig_sampling(self) -> bool:
        """Whether MIG instances can be sampled (this driver has ``nvmlGpmMigSampleGet``)."""
        return self._mig_sample is not None

    def forget(self, row: int) -> None:
        """Drop ``row``'s older sample: the next is the first of a new pair (a new instance)."""
        for p in self._plans:
            p.have_prev[row] = False

    def plan(self, fields: Sequence[Field], cols: list[int], mask: BoolArray) -> GpmPlan:
        """Buffers for reading ``fields[k] for k in cols`` where ``mask[gpu, i]``."""
        gpus = len(self._handles)
        request = calls.gpm_metrics_request(
            [calls.gpm_metric_id(fields[k].gpm_metric or "") or 0 for k in cols]
        )
        rows = [g for g in range(gpus) if mask[g].any()]
        prev: list[Any] = [None] * gpus
        cur: list[Any] = [None] * gpus
        for g in rows:
            prev[g] = calls.gpm_sample_alloc()
            cur[g] = calls.gpm_sample_alloc()
        p = GpmPlan(
            cols=cols,
            scale=np.array([fields[k].scale for k in cols], dtype=np.float64),
            mask=mask.copy(),
            rows=rows,
            request=request,
            prev=prev,
            cur=cur,
            have_prev=[False] * gpus,
            names=[fields[k].name for k in cols],
        )
        self._plans.append(p)
        return p

    def read(
        self,
        p: GpmPlan,
        up: BoolArray,
        values: FloatArray,
        driver_ts_us: IntArray,
        now_us: int,
    ) -> None:
        """Sample every GPU of the plan and fill its cells from the pair (new, previous)."""
        request = p.request
        by_ref = ctypes.byref(request)
        mig = self._mig
        for g in p.rows:
            if not up[g]:
                continue
            at = mig.get(g)
            if at is None:
                ret = self._sample(self._handles[g], p.cur[g])
            else:
                ret = self._mig_sample(at[0], at[1], p.cur[g])
                if ret and int(ret) in _NO_INSTANCE_GPM:
                    continue  # an instance without GPM, or one destroyed since the last scan
            if ret:
                if at is None and int(ret) in calls.UNSUPPORTED_CODES:
                    # e.g. a GPU in MIG mode, whose counters are its instances' to sample
                    p.mask[g] = False
                    p.rows = [r for r in p.rows if r != g]  # this loop goes on over the old list
                    log.warning(
                        "GPM samples of GPU row %d: %s; its GPM fields skipped",
                        g, calls.error_text(int(ret)),
                    )  # fmt: skip
                    continue
                self.on_error(g, int(ret), int(p.mask[g].sum()))
                continue
            if not p.have_prev[g]:
                p.prev[g], p.cur[g] = p.cur[g], p.prev[g]
                p.have_prev[g] = True
                continue
            request.sample1 = p.prev[g]
            request.sample2 = p.cur[g]
            ret = self._metrics(by_ref)
            if ret:
                if int(ret) in calls.LOST_CODES:
                    self.on_error(g, int(ret), int(p.mask[g].sum()))
                # Most likely a pair inside one counter refresh: keep the older sample, so the
                # next tick measures over a longer stretch instead of none.
                continue
            for i, k in enumerate(p.cols):
                if not p.mask[g, i]:
                    continue
                m = request.metrics[i]
                code = int(m.nvmlReturn)
                if code == 0:
                    values[g, k] = m.value * p.scale[i]
                    driver_ts_us[g, k] = now_us
                elif code in calls.UNSUPPORTED_CODES:
                    p.mask[g, i] = False  # e.g. NVLink metrics on a GPU without NVLink
                    log.warning(
                        "%s not supported by GPM on GPU row %d (%s): skipped",
                        p.names[i], g, calls.error_text(code),
                    )  # fmt: skip
                else:
                    self.on_error(g, code, 1)
            p.prev[g], p.cur[g] = p.cur[g], p.prev[g]

    def close(self) -> None:
        for p in self._plans:
            for sample in (*p.prev, *p.cur):
                if sample is not None:
                    with contextlib.suppress(calls.NvmlError):
                        calls.gpm_sample_free(sample)
        self._plans.clear()

"""The recording's writer: appends chunks as the job runs, each with one ``write``; a write that
fails (a full disk) is cut back to the last whole chunk and stops the writer, which says why in
the end chunk when there is room for one (``recording_format`` has the layout)."""

from __future__ import annotations

import contextlib
import errno
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

import numpy as np

from hfsampler.profiling import recording_format as fmt
from hfsampler.profiling.recording_format import ConsumerWindow, Marker, RecordingWriteError
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.window import STATS, WindowStats
from hfsampler.sources.base import DeviceInfo

# -- writer --------------------------------------------------------------------------------------


class RecordingWriter:
    """Appends chunks to a new recording; each is in the page cache when its call returns."""

    def __init__(
        self,
        path: str | Path,
        header: Mapping[str, Any],
        devices: Sequence[DeviceInfo],
        groups: Sequence[GroupPlan],
    ) -> None:
        self.path = Path(path)
        self.groups = tuple(groups)
        # unbuffered: a write that fails leaves nothing in a buffer for close() to fail on again
        try:
            self._f: IO[bytes] = open(self.path, "wb", buffering=0)  # noqa: SIM115 (close())
        except OSError as exc:
            raise RecordingWriteError(exc.errno, fmt._reason(exc), str(self.path)) from exc
        self.bytes_written = 0  # up to the end of the last whole chunk
        self.samples_written = 0
        self.failed: RecordingWriteError | None = None  # why the writer stopped, if it did
        self._last_chunk = (0, 0)  # where the last whole chunk starts, and its samples
        self._write(fmt.MAGIC)
        meta = {
            **header,
            "format_version": fmt.FORMAT_VERSION,
            "stats": [s.name for s in STATS],
            "devices": [
                {"index": d.index, "uuid": d.uuid, "model_name": d.model_name,
                 "pci_bus_id": d.pci_bus_id, "driver_version": d.driver_version,
                 "minor_number": d.minor_number,
                 # a MIG instance slot, and the instance it held when the recording began
                 **({} if d.is_gpu else {"mig_slot": d.mig_slot, "mig": _mig_header(d)})}
                for d in devices
            ],
            "groups": [
                {"name": g.name, "interval_s": g.interval_s, "fields": [f.name for f in g.fields],
                 # a per-instance field's own labels (a Jetson's rail, zone): [] for the others
                 "labels": [[list(kv) for kv in f.labels] for f in g.fields],
                 # which are a MIG instance's own (fields.expand_mig), read on its slot's row
                 "mig_instance": [f.mig_instance for f in g.fields],
                 # which the raw chunks hold as float64: a later catalogue may change a kind
                 "float64": [fmt.stored_as_float64(f) for f in g.fields]}
                for g in self.groups
            ],
        }  # fmt: skip
        self._chunk(fmt.HEAD, fmt._pack(meta, []))
        self._wide = [
            fmt.stored_widths(h, g.fields) for h, g in zip(meta["groups"], self.groups, strict=True)
        ]

    def _chunk(self, tag: bytes, payload: bytes, samples: int = 0) -> None:
        start = self.bytes_written
        self._write(fmt._FRAME.pack(tag, len(payload), zlib.crc32(payload)) + payload)
        self.samples_written += samples
        self._last_chunk = (start, samples)

    def _write(self, data: bytes) -> None:
        """All of ``data`` or nothing: a failed write is cut back to the last whole chunk (which
        frees what it took of a full disk) and stops the writer (``RecordingWriteError``)."""
        if self.failed is not None:
            raise self.failed
        view = memoryview(data)
        try:
            while view:  # a raw file may take less than asked (a disk filling up)
                n = self._f.write(view)
                if not n:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[n:]
        except OSError as exc:
            self._stop(exc)
        self.bytes_written += len(data)

    def _stop(self, exc: OSError) -> NoReturn:
        self.failed = RecordingWriteError(exc.errno, fmt._reason(exc), str(self.path))
        with contextlib.suppress(OSError):
            os.ftruncate(self._f.fileno(), self.bytes_written)
            self._f.seek(self.bytes_written)
        raise self.failed from exc

    def add_rows(self, group: int, rows: RingRows, gpus: Sequence[int] | None = None) -> int:
        """Store the distinct samples (non-NaN values) of ring rows; returns how many."""
        values, driver = rows.values, rows.driver_ts_us
        if gpus is not None:
            values, driver = values[:, list(gpus)], driver[:, list(gpus)]
        n, g, f = values.shape
        if n == 0:
            return 0
        # cell-major: [gpu, field, row], so each cell's samples are contiguous and time-ordered
        v = np.transpose(values, (1, 2, 0))
        valid = ~np.isnan(v)
        counts = valid.reshape(g * f, n).sum(axis=1)
        keep = np.nonzero(counts)[0]
        if not len(keep):
            return 0
        ts = np.transpose(driver, (1, 2, 0))[valid]
        vals = v[valid]
        wide_cell = np.repeat(np.tile(self._wide[group], g), counts)
        deltas = np.diff(ts, prepend=np.int64(0))
        v32 = vals[~wide_cell].astype(np.float32)
        v64 = vals[wide_cell].astype(np.float64)
        meta = {
            "group": group,
            "cells": len(keep),
            "n": len(ts),
            "n32": len(v32),
            "t0_ns": int(rows.time_ns[0]),
            "t1_ns": int(rows.time_ns[-1]),
        }
        blobs = [
            (keep // f).astype(np.uint16).tobytes(),
            (keep % f).astype(np.uint16).tobytes(),
            counts[keep].astype(np.uint32).tobytes(),
            fmt._shuffle(deltas.astype(np.int64)),
            fmt._xor_pack(v32, np.uint32),
            fmt._xor_pack(v64, np.uint64),
        ]
        self._chunk(fmt.RAW, fmt._pack(meta, blobs), len(ts))
        return len(ts)

    def add_window(
        self,
        group: int,
        stats: WindowStats,
        gpus: Sequence[int] | None = None,
        ticks: int | None = None,
    ) -> None:
        """Store one group's window statistics (only the recorded GPUs' rows) and its ticks."""
        sel = slice(None) if gpus is None else list(gpus)
        meta = {"group": group, "t0_ns": stats.t0_ns, "t1_ns": stats.t1_ns}
        if ticks is not None:
            meta["ticks"] = ticks
        blobs = [np.ascontiguousarray(stats[s][sel], np.float64).tobytes() for s in STATS]
        blobs.append(np.ascontiguousarray(stats.count[sel], np.int64).tobytes())
        self._chunk(fmt.WIN, fmt._pack(meta, blobs))

    def add_processes(
        self, t_ns: int, processes: Mapping[int, Sequence[Mapping[str, Any]]]
    ) -> None:
        """Store the GPU compute processes seen at ``t_ns`` (per recorded GPU index)."""
        meta = {"t_ns": t_ns, "gpus": {str(k): list(v) for k, v in processes.items()}}
        self._chunk(fmt.PROC, fmt._pack(meta, []))

    def add_consumers(self, window: ConsumerWindow) -> None:
        """Store one window's consumers: what the process reads in it saw, and who each pid is."""
        self._chunk(fmt.CONS, fmt._pack(window.to_json(), []))

    def add_markers(self, markers: Sequence[Marker]) -> None:
        """Store markers received since the last call (nothing is written for none)."""
        if markers:
            self._chunk(fmt.MARK, fmt._pack({"markers": [m.to_json() for m in markers]}, []))

    def _end_after_failure(self, end: Mapping[str, Any]) -> None:
        """After a failed write, the end chunk all the same, so the file says why it ends early:
        tried as it is, then (a disk still full) in place of the last data chunk."""
        for attempt in range(2):
            self.failed = None
            try:
                self._chunk(fmt.END, fmt._pack({**end, "samples": self.samples_written}, []))
                return
            except RecordingWriteError:
                start, samples = self._last_chunk
                if attempt or start <= len(fmt.MAGIC):
                    raise
                self.bytes_written, self.samples_written = start, self.samples_written - samples
                self._last_chunk = (0, 0)
                with contextlib.suppress(OSError):
                    os.ftruncate(self._f.fileno(), start)
                    self._f.seek(start)

    def close(self, end: Mapping[str, Any] | None = None) -> None:
        """Write the end chunk (when given), fsync and close; safe to call twice.

        After a failed write the end chunk is still tried (``_end_after_failure``) and nothing
        is raised: the caller knows from ``failed``.
        Otherwise a failure to write or sync raises ``RecordingWriteError``; the file is closed
        in every case.
        """
        if self._f.closed:
            return
        stopped = self.failed
        try:
            if end is not None and stopped is not None:
                self._end_after_failure(end)
            elif end is not None:
                self._chunk(fmt.END, fmt._pack(end, []))
            try:
                os.fsync(self._f.fileno())
            except OSError as exc:
                self._stop(exc)
        except RecordingWriteError:
            if stopped is None:
                raise
        finally:
            self.failed = stopped or self.failed
            self._f.close()


def _mig_header(device: DeviceInfo) -> dict[str, Any] | None:
    m = device.mig
    if m is None:
        return None
    return {"gpu_instance_id": m.gpu_instance_id, "compute_instance_id": m.compute_instance_id,
            "profile": m.profile, "uuid": m.uuid}  # fmt: skip

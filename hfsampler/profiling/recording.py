"""The recording file (``.hfs``): a writer that appends as it goes, a reader that survives a crash.

Layout: 8 magic bytes, then chunks. Each chunk is a 12-byte frame (4-byte tag, payload length,
CRC-32 of the payload) and a zlib-compressed payload; the payload is a small JSON part plus packed
arrays. Tags: ``HEAD`` (the job's context, first), ``RAW_`` (one group's distinct samples over a
stretch of time), ``WIN_`` (one group's window statistics), ``PROC`` (GPU compute processes seen),
``MARK`` (markers and phases the job sent or printed), ``END_`` (end time and exit code, last).
The header names the format's version (``FORMAT_VERSION``: a file of any other is refused, in one
line naming it) and the window statistics each ``WIN_`` chunk holds, in order; the reader takes
them by name. Every chunk is written with one ``write``, so a ``kill -9`` loses at most the chunk
being written, and a write that fails (a full disk) is cut back to the last whole chunk. The
reader skips a damaged frame (its checksum fails) to the next good one, counting what it skipped,
and says so; a torn tail ends the file.

Why this shape: the raw samples are most of the bytes. Driver timestamps are delta-encoded (at a
steady refresh the deltas are one repeated number); values are XOR-ed with the previous value of
the stream and byte-shuffled (equal exponent and high mantissa bytes line up into long runs), then
zlib compresses both. Gauges are stored as float32 (24 bits of mantissa are finer than every NVML
gauge's resolution, from mW to MiB), counters as float64 (an energy counter in mJ outgrows
float32). zlib rather than snappy: the recorder compresses ~1 MB a second at most, where zlib's
better ratio matters more than snappy's speed.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, NoReturn

import numpy as np
import numpy.typing as npt
import orjson

from hfsampler.errors import HfsamplerError
from hfsampler.fields import BY_NAME, Field, Kind, Role, locate
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sampling.window import STATS, Stat, WindowStats
from hfsampler.sources.base import DeviceInfo, MigInstance

MAGIC = b"HFSREC\x00\x01"
FORMAT_VERSION = 2  # the only one read: nothing released ever wrote another
_FRAME = struct.Struct("<4sII")
_SCAN_BYTES = 1 << 20  # the reader's piece size, checking frames and looking past damage
HEAD, RAW, WIN, PROC, MARK, END = b"HEAD", b"RAW_", b"WIN_", b"PROC", b"MARK", b"END_"
_TAGS = (HEAD, RAW, WIN, PROC, MARK, END)  # a frame's tag is kept as its position here
_TAG_CODES = {tag: code for code, tag in enumerate(_TAGS)}
MARKER_KINDS = ("mark", "begin", "end", "step")  # an instant; a phase's edges; step n starts
ZLIB_LEVEL = 6

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class RecordingError(HfsamplerError, ValueError):
    """The file is not a recording, its header is unreadable, or its format is not this one."""


class RecordingWriteError(HfsamplerError, OSError):
    """The recording could not be written (a full disk, a read-only or failing file system): the
    writer has stopped, and the file ends with the last whole chunk."""

    def __str__(self) -> str:
        return f"cannot write the recording {self.filename}: {_reason(self)}"


def _reason(exc: OSError) -> str:
    """An OSError's reason in words, without the ``[Errno N]`` prefix."""
    return exc.strerror or str(exc)


def stored_as_float64(field: Field) -> bool:
    """Counters keep float64; every other field is stored as float32 (see the module docstring)."""
    return field.kind is Kind.COUNTER


# -- packing -------------------------------------------------------------------------------------


def _shuffle(a: npt.NDArray[Any]) -> bytes:
    """Byte planes one after another: byte 0 of every element, then byte 1, ..."""
    return a.view(np.uint8).reshape(-1, a.itemsize).T.tobytes()


def _unshuffle(data: bytes, dtype: type[np.generic], n: int) -> npt.NDArray[Any]:
    size = np.dtype(dtype).itemsize
    planes = np.frombuffer(data, np.uint8, n * size).reshape(size, n)
    out = np.empty((n, size), np.uint8)
    for p in range(size):  # a plane at a time: about twice as fast as copying planes.T at once
        out[:, p] = planes[p]
    return out.view(dtype).reshape(n)


def _xor_pack(values: npt.NDArray[Any], utype: type[np.generic]) -> bytes:
    u = values.view(utype)
    x = u.copy()
    x[1:] ^= u[:-1]
    return _shuffle(x)


def _xor_unpack(data: bytes, utype: type[np.generic], ftype: type[np.generic], n: int) -> Any:
    x = _unshuffle(data, utype, n)
    return np.bitwise_xor.accumulate(x).view(ftype) if n else x.view(ftype)


def _pack(meta: Mapping[str, Any], blobs: Sequence[bytes]) -> bytes:
    head = orjson.dumps({**meta, "blobs": [len(b) for b in blobs]})
    return zlib.compress(struct.pack("<I", len(head)) + head + b"".join(blobs), ZLIB_LEVEL)


def _unpack(payload: bytes, bufsize: int = zlib.DEF_BUF_SIZE) -> tuple[dict[str, Any], list[bytes]]:
    raw = zlib.decompress(payload, bufsize=bufsize)
    (n,) = struct.unpack_from("<I", raw)
    meta: dict[str, Any] = orjson.loads(raw[4 : 4 + n])
    blobs, off = [], 4 + n
    for size in meta.pop("blobs"):
        blobs.append(raw[off : off + size])
        off += size
    return meta, blobs


# -- data ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RawChunk:
    """One group's distinct samples over a stretch of time, cell by cell (``gpu``, ``field``)."""

    group: int
    gpu: IntArray  # [cells] position in the recording's devices
    field: IntArray  # [cells] position in the group's fields
    offsets: IntArray  # [cells + 1] where each cell's samples start in ts_us / values
    ts_us: IntArray  # driver timestamps, µs since the epoch
    values: FloatArray

    def cell(self, gpu: int, field: int) -> tuple[IntArray, FloatArray]:
        """One GPU's samples of one field in this chunk (empty arrays if none)."""
        hit = np.nonzero((self.gpu == gpu) & (self.field == field))[0]
        if not len(hit):
            return np.empty(0, np.int64), np.empty(0)
        a, b = int(self.offsets[hit[0]]), int(self.offsets[hit[0] + 1])
        return self.ts_us[a:b], self.values[a:b]


@dataclass(frozen=True, slots=True)
class Windows:
    """One group's window statistics over the whole recording: ``[window, gpu, field]`` arrays."""

    t0_ns: IntArray
    t1_ns: IntArray
    values: Mapping[str, FloatArray]  # by Stat.name: every statistic the file names
    count: IntArray

    def __getitem__(self, stat: Stat) -> FloatArray:
        return self.values[stat.name]

    def stats(self, i: int, fields: tuple[Field, ...]) -> WindowStats:
        """Window ``i`` as the ``WindowStats`` the metric model takes."""
        values = {name: v[i] for name, v in self.values.items()}
        return WindowStats(int(self.t0_ns[i]), int(self.t1_ns[i]), fields, values, self.count[i])


@dataclass(frozen=True, slots=True)
class WindowChunk:
    """One group's statistics over one window, as stored (``stats`` arrays are ``[gpu, field]``)."""

    group: int
    stats: WindowStats


@dataclass(frozen=True, slots=True)
class Marker:
    """One event of the job: an instant (``mark``), a phase's ``begin`` / ``end``, a ``step``.

    ``t_ns`` is wall-clock time (``time.time_ns``, the clock of the windows); ``step`` is the step
    number of a ``step`` marker; ``source`` says where it came from: ``api`` (``hfsampler.markers``)
    or ``output`` (a line of the child's output matched by ``--mark-pattern``).
    """

    t_ns: int
    kind: str
    name: str
    step: int | None = None
    source: str = "api"
    pid: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in MARKER_KINDS:
            raise ValueError(f"marker kind {self.kind!r} is not one of {', '.join(MARKER_KINDS)}")

    def to_json(self) -> dict[str, Any]:
        return {"t_ns": self.t_ns, "kind": self.kind, "name": self.name, "step": self.step,
                "source": self.source, "pid": self.pid}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Marker:
        step, pid = d.get("step"), d.get("pid")
        return cls(int(d["t_ns"]), str(d["kind"]), str(d["name"]),
                   None if step is None else int(step), str(d.get("source", "api")),
                   None if pid is None else int(pid))  # fmt: skip


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
            raise RecordingWriteError(exc.errno, _reason(exc), str(self.path)) from exc
        self.bytes_written = 0  # up to the end of the last whole chunk
        self.samples_written = 0
        self.failed: RecordingWriteError | None = None  # why the writer stopped, if it did
        self._last_chunk = (0, 0)  # where the last whole chunk starts, and its samples
        self._write(MAGIC)
        meta = {
            **header,
            "format_version": FORMAT_VERSION,
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
                 "mig_instance": [f.mig_instance for f in g.fields]}
                for g in self.groups
            ],
        }  # fmt: skip
        self._chunk(HEAD, _pack(meta, []))
        self._wide = [
            np.array([stored_as_float64(f) for f in g.fields], dtype=np.bool_) for g in self.groups
        ]

    def _chunk(self, tag: bytes, payload: bytes, samples: int = 0) -> None:
        start = self.bytes_written
        self._write(_FRAME.pack(tag, len(payload), zlib.crc32(payload)) + payload)
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
        self.failed = RecordingWriteError(exc.errno, _reason(exc), str(self.path))
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
            _shuffle(deltas.astype(np.int64)),
            _xor_pack(v32, np.uint32),
            _xor_pack(v64, np.uint64),
        ]
        self._chunk(RAW, _pack(meta, blobs), len(ts))
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
        self._chunk(WIN, _pack(meta, blobs))

    def add_processes(
        self, t_ns: int, processes: Mapping[int, Sequence[Mapping[str, Any]]]
    ) -> None:
        """Store the GPU compute processes seen at ``t_ns`` (per recorded GPU index)."""
        meta = {"t_ns": t_ns, "gpus": {str(k): list(v) for k, v in processes.items()}}
        self._chunk(PROC, _pack(meta, []))

    def add_markers(self, markers: Sequence[Marker]) -> None:
        """Store markers received since the last call (nothing is written for none)."""
        if markers:
            self._chunk(MARK, _pack({"markers": [m.to_json() for m in markers]}, []))

    def _end_after_failure(self, end: Mapping[str, Any]) -> None:
        """After a failed write, the end chunk all the same, so the file says why it ends early:
        tried as it is, then (a disk still full) in place of the last data chunk."""
        for attempt in range(2):
            self.failed = None
            try:
                self._chunk(END, _pack({**end, "samples": self.samples_written}, []))
                return
            except RecordingWriteError:
                start, samples = self._last_chunk
                if attempt or start <= len(MAGIC):
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
                self._chunk(END, _pack(end, []))
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


# -- reader --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    tag: bytes
    offset: int
    length: int


def _mig_header(device: DeviceInfo) -> dict[str, Any] | None:
    m = device.mig
    if m is None:
        return None
    return {"gpu_instance_id": m.gpu_instance_id, "compute_instance_id": m.compute_instance_id,
            "profile": m.profile, "uuid": m.uuid}  # fmt: skip


def _devices(header: Mapping[str, Any]) -> tuple[DeviceInfo, ...]:
    out = []
    for d in header["devices"]:
        mig = d.get("mig")
        d = {**d, "mig": MigInstance(**mig) if mig else None}
        out.append(DeviceInfo(**d))
    return tuple(out)


def _groups(header: Mapping[str, Any]) -> tuple[GroupPlan, ...]:
    out = []
    for g in header["groups"]:
        labels = g.get("labels") or [[] for _ in g["fields"]]  # recordings before labels: none
        twins = g.get("mig_instance") or [False for _ in g["fields"]]  # before MIG: none
        fields = tuple(
            replace(
                BY_NAME[n],
                labels=tuple((str(k), str(v)) for k, v in own),
                mig_instance=bool(twin),
            )
            for n, own, twin in zip(g["fields"], labels, twins, strict=True)
        )
        out.append(GroupPlan(g["name"], float(g["interval_s"]), fields))
    return tuple(out)


def _frame_at(fd: int, off: int, size: int) -> tuple[bytes, int] | None:
    """The (tag, payload length) of the whole frame at ``off`` whose checksum holds, else None."""
    head = os.pread(fd, _FRAME.size, off)
    if len(head) < _FRAME.size:
        return None
    tag, length, crc = _FRAME.unpack(head)
    start = off + _FRAME.size
    if start + length > size:
        return None
    check, at = 0, start
    while at < start + length:  # in bounded pieces: a damaged length may claim the whole file
        piece = os.pread(fd, min(_SCAN_BYTES, start + length - at), at)
        if not piece:
            return None
        check, at = zlib.crc32(piece, check), at + len(piece)
    return (tag, length) if check == crc else None


def _next_frame(fd: int, start: int, size: int) -> int | None:
    """Where the next good frame of a known tag begins at or after ``start``, else None."""
    at = start
    while at < size:
        block = os.pread(fd, _SCAN_BYTES + 3, at)  # + 3: a tag across the block's end
        hits = sorted(i for tag in _TAGS for i in _find_all(block, tag) if i < _SCAN_BYTES)
        for i in hits:
            if _frame_at(fd, at + i, size) is not None:
                return at + i
        at += _SCAN_BYTES
    return None


def _find_all(block: bytes, needle: bytes) -> Iterator[int]:
    i = block.find(needle)
    while i >= 0:
        yield i
        i = block.find(needle, i + 1)


class Recording:
    """A recording opened for reading: the header at once, chunks on demand, read frame by frame.

    Opening reads the file once in bounded pieces to check every frame's checksum; what is kept is
    three small arrays per frame (tag, offset, length), never the file, so memory does not grow
    with the recording. A frame that fails its checksum (or claims more bytes than there are) is
    damage: reading goes on from the next good frame (a known tag whose checksum holds), the
    bytes between counted in ``damaged_parts`` and ``damaged_bytes``. With no good frame after
    it, it is the file's torn tail (``torn``: the recorder did not finish).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # compact while scanning: a day of an 8-GPU recording is half a million frames
        tags, offsets, lengths = bytearray(), array.array("q"), array.array("q")
        self.torn = False  # the file ends in a cut-short frame (the recorder did not finish)
        self.damaged_parts = 0  # stretches of damaged bytes skipped, the reading resumed after
        self.damaged_bytes = 0
        with open(self.path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise RecordingError(f"{self.path}: not an hfsampler recording (bad magic)")
            fd = f.fileno()
            size = os.fstat(fd).st_size
            off = len(MAGIC)
            while off < size:
                frame = _frame_at(fd, off, size)
                if frame is None:  # damaged here: go on from the next good frame, if any
                    good = _next_frame(fd, off + 1, size)
                    if good is None:
                        self.torn = True
                        break
                    self.damaged_parts += 1
                    self.damaged_bytes += good - off
                    off = good
                    continue
                tag, length = frame
                tags.append(_TAG_CODES.get(tag, len(_TAGS)))
                offsets.append(off + _FRAME.size)
                lengths.append(length)
                off += _FRAME.size + length
        self._tags = np.frombuffer(bytes(tags), np.uint8)
        self._offsets = np.frombuffer(offsets, np.int64)
        self._lengths = np.frombuffer(lengths, np.int64)
        if not len(self._tags) or self._tags[0] != _TAG_CODES[HEAD]:
            raise RecordingError(f"{self.path}: the header chunk is missing or damaged")
        self._windows: dict[int, Windows] = {}
        self.header, _ = self._load(0)
        found = self.header.get("format_version")
        if found != FORMAT_VERSION:
            raise RecordingError(
                f"{self.path}: recording format {found} (this hfsampler reads format "
                f"{FORMAT_VERSION} only; record the job again)"
            )
        self.devices = _devices(self.header)
        self.groups = _groups(self.header)
        end = self._where(END)
        self.end: dict[str, Any] | None = self._load(int(end[-1]))[0] if len(end) else None

    @property
    def frames(self) -> list[Frame]:
        """Every readable frame, in file order."""
        return [
            Frame(_TAGS[t] if t < len(_TAGS) else b"????", int(o), int(n))
            for t, o, n in zip(self._tags, self._offsets, self._lengths, strict=True)
        ]

    def _where(self, tag: bytes) -> IntArray:
        return np.nonzero(self._tags == _TAG_CODES[tag])[0].astype(np.int64)

    def _load(self, index: int) -> tuple[dict[str, Any], list[bytes]]:
        with open(self.path, "rb") as f:
            return _unpack(os.pread(f.fileno(), int(self._lengths[index]),
                                    int(self._offsets[index])))  # fmt: skip

    def _payloads(
        self, tags: Sequence[bytes]
    ) -> Iterator[tuple[bytes, dict[str, Any], list[bytes]]]:
        """The frames with one of ``tags``, decoded one at a time, in file order."""
        codes = np.array([_TAG_CODES[t] for t in tags], np.uint8)
        # zlib's output buffer starts at 16 KiB and grows block by block; started near the size
        # it will reach (the ratio of the last frame of that tag and size class), a raw chunk
        # inflates about a third faster
        ratios: dict[tuple[int, int], float] = {}
        with open(self.path, "rb") as f:
            fd = f.fileno()
            for k in np.nonzero(np.isin(self._tags, codes))[0]:
                length = int(self._lengths[k])
                key = (int(self._tags[k]), length.bit_length())
                guess = int(length * ratios.get(key, 1.0)) + 64
                payload = os.pread(fd, length, int(self._offsets[k]))
                meta, blobs = _unpack(payload, max(guess, zlib.DEF_BUF_SIZE))
                ratios[key] = (sum(map(len, blobs)) + 64) / max(1, length)
                yield _TAGS[self._tags[k]], meta, blobs

    @property
    def complete(self) -> bool:
        """True when the recorder closed the file (an end chunk and no torn tail) having
        recorded the whole job (no ``stopped_early``)."""
        return self.end is not None and not self.torn and self.stopped_early is None

    @property
    def stopped_early(self) -> str | None:
        """Why the recorder stopped recording before the job ended (a full disk), if it did."""
        return None if self.end is None else self.end.get("incomplete")

    @property
    def problem(self) -> str | None:
        """What is wrong with the file, in one line for a terminal; None when nothing is."""
        parts = []
        if self.damaged_parts:
            parts.append(f"damaged: {self.damaged_bytes:,} bytes in {self.damaged_parts} "
                         "place(s) skipped")  # fmt: skip
        if self.stopped_early is not None:
            parts.append(f"incomplete: the recording stopped before the job ({self.stopped_early})")
        elif self.torn or self.end is None:
            parts.append("incomplete: the recorder did not finish")
        return "; ".join(parts) or None

    def group_index(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if name == g.name:
                return i
        raise KeyError(name)

    def locate(self, field_name: str) -> tuple[int, int] | None:
        """(group, field position) of a recorded field, or None."""
        for i, g in enumerate(self.groups):
            for j, f in enumerate(g.fields):
                if f.name == field_name:
                    return i, j
        return None

    def locate_role(self, role: Role) -> tuple[int, int] | None:
        """(group, field position) of the recorded field that serves ``role``, or None."""
        return locate(role, [g.fields for g in self.groups])

    def raw_chunks(self, group: int | None = None) -> Iterator[RawChunk]:
        """Every raw chunk (of one group, if given), in file (time) order."""
        for _, meta, blobs in self._payloads((RAW,)):
            if group is None or meta["group"] == group:
                yield self._raw(meta, blobs)

    def stream(self) -> Iterator[RawChunk | WindowChunk]:
        """Raw chunks and windows of every group, one at a time in file (time) order: the one
        pass a report makes, holding a single chunk at a time."""
        names: list[str] = list(self.header["stats"])
        for tag, meta, blobs in self._payloads((RAW, WIN)):
            if tag == RAW:
                yield self._raw(meta, blobs)
            else:
                yield self._window(meta, blobs, names)

    def _raw(self, meta: dict[str, Any], blobs: list[bytes]) -> RawChunk:
        g = int(meta["group"])
        gpu = np.frombuffer(blobs[0], np.uint16).astype(np.int64)
        fld = np.frombuffer(blobs[1], np.uint16).astype(np.int64)
        counts = np.frombuffer(blobs[2], np.uint32).astype(np.int64)
        n, n32 = int(meta["n"]), int(meta["n32"])
        ts = np.cumsum(_unshuffle(blobs[3], np.int64, n))
        v32 = _xor_unpack(blobs[4], np.uint32, np.float32, n32).astype(np.float64)
        v64 = _xor_unpack(blobs[5], np.uint64, np.float64, n - n32)
        wide = np.array([stored_as_float64(f) for f in self.groups[g].fields], dtype=np.bool_)
        if n32 == n or n32 == 0:  # one kind of field only (the fast group: all gauges)
            values = v32 if n32 else v64
        else:
            wide_sample = np.repeat(wide[fld], counts)
            values = np.empty(n)
            values[~wide_sample] = v32
            values[wide_sample] = v64
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return RawChunk(g, gpu, fld, offsets, ts, values)

    def raw(self, field_name: str, gpu: int) -> tuple[IntArray, FloatArray]:
        """Every distinct sample of one field on one GPU (position in ``devices``): µs, values."""
        where = self.locate(field_name)
        if where is None:
            return np.empty(0, np.int64), np.empty(0)
        parts = [c.cell(gpu, where[1]) for c in self.raw_chunks(where[0])]
        if not parts:
            return np.empty(0, np.int64), np.empty(0)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def windows(self, group: int) -> Windows:
        """Every window of one group, in time order (decoded once, then cached)."""
        cached = self._windows.get(group)
        if cached is None:
            cached = self._windows[group] = self._read_windows(group)
        return cached

    def _window(self, meta: dict[str, Any], blobs: list[bytes], names: list[str]) -> WindowChunk:
        group = int(meta["group"])
        shape = (len(self.devices), len(self.groups[group].fields))
        values = {name: np.frombuffer(blob, np.float64).reshape(shape)
                  for name, blob in zip(names, blobs[: len(names)], strict=True)}  # fmt: skip
        count = np.frombuffer(blobs[len(names)], np.int64).reshape(shape)
        stats = WindowStats(int(meta["t0_ns"]), int(meta["t1_ns"]), self.groups[group].fields,
                            values, count)  # fmt: skip
        return WindowChunk(group, stats)

    def window_chunks(self, group: int) -> Iterator[WindowChunk]:
        """One group's windows, one at a time in time order."""
        names: list[str] = list(self.header["stats"])
        for _, meta, blobs in self._payloads((WIN,)):
            if meta["group"] == group:
                yield self._window(meta, blobs, names)

    def _read_windows(self, group: int) -> Windows:
        shape = (len(self.devices), len(self.groups[group].fields))
        names: list[str] = list(self.header["stats"])
        t0, t1, counts = [], [], []
        stats: dict[str, list[FloatArray]] = {name: [] for name in names}
        for chunk in self.window_chunks(group):
            w = chunk.stats
            t0.append(w.t0_ns)
            t1.append(w.t1_ns)
            for name in names:
                stats[name].append(w.values[name])
            counts.append(w.count)

        def stack(items: list[Any], dtype: type[np.generic]) -> Any:
            return np.stack(items) if items else np.empty((0, *shape), dtype)

        values = {name: stack(v, np.float64) for name, v in stats.items()}
        return Windows(np.array(t0, np.int64), np.array(t1, np.int64), values,
                       stack(counts, np.int64))  # fmt: skip

    def process_snapshots(self) -> Iterator[dict[str, Any]]:
        """Each process snapshot in turn: ``{"t_ns": ..., "gpus": {gpu index: [process, ...]}}``."""
        for _, meta, _ in self._payloads((PROC,)):
            yield meta

    def processes(self) -> list[dict[str, Any]]:
        """Every process snapshot (see ``process_snapshots``)."""
        return list(self.process_snapshots())

    def markers(self) -> list[Marker]:
        """Every stored marker, in time order."""
        out = [Marker.from_json(m) for stored in self.marker_chunks() for m in stored]
        return sorted(out, key=lambda m: m.t_ns)

    def marker_chunks(self) -> Iterator[list[dict[str, Any]]]:
        """Each marker chunk's markers as stored (``Marker.to_json``), in file order: for a
        reader of a million steps that wants no ``Marker`` object each."""
        for _, meta, _ in self._payloads((MARK,)):
            yield meta["markers"]

    def time_range_ns(self) -> tuple[int, int]:
        """Start from the header; end from the end chunk, else the last window or raw chunk
        (chunks are appended in time order: the last few frames hold the latest end)."""
        start = int(self.header["start_ns"])
        if self.end is not None:
            return start, int(self.end["end_ns"])
        last = start
        data = np.nonzero(np.isin(self._tags, [_TAG_CODES[RAW], _TAG_CODES[WIN]]))[0]
        for k in data[-2 * max(1, len(self.groups)) :]:
            meta, _ = self._load(int(k))
            last = max(last, int(meta.get("t1_ns", last)))
        return start, last

"""The recording file (``.hfs``): a writer that appends as it goes, a reader that survives a crash.

Layout: 8 magic bytes, then chunks. Each chunk is a 12-byte frame (4-byte tag, payload length,
CRC-32 of the payload) and a zlib-compressed payload; the payload is a small JSON part plus packed
arrays. Tags: ``HEAD`` (the job's context, first), ``RAW_`` (one group's distinct samples over a
stretch of time), ``WIN_`` (one group's window statistics), ``PROC`` (GPU compute processes seen),
``MARK`` (markers and phases the job sent or printed), ``CONS`` (one window's consumers: the
process lists and per-process SM samples seen in it, and each pid's consumer), ``END_`` (end
time and exit code, last). A reader skips a tag it does not know, so a tag added later (``CONS``)
keeps the format's version: older recordings simply have none of it.
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
float32); the header says which of each group's fields are float64 (``float64``), so a field
whose kind a later catalogue changed still reads back as written. zlib rather than snappy: the
recorder compresses ~1 MB a second at most, where zlib's better ratio matters more than snappy's
speed.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from hfsampler.consumers.identity import Consumer
from hfsampler.consumers.identity import Kind as ConsumerKind
from hfsampler.consumers.split import WindowUse
from hfsampler.errors import HfsamplerError
from hfsampler.fields import Field, Kind
from hfsampler.sampling.window import Stat, WindowStats

MAGIC = b"HFSREC\x00\x01"
FORMAT_VERSION = 2  # the only one read: nothing released ever wrote another
_FRAME = struct.Struct("<4sII")
_SCAN_BYTES = 1 << 20  # the reader's piece size, checking frames and looking past damage
HEAD, RAW, WIN, PROC, MARK, END = b"HEAD", b"RAW_", b"WIN_", b"PROC", b"MARK", b"END_"
CONS = b"CONS"
# a frame's tag is kept as its position here: new tags go last, so older positions stay
_TAGS = (HEAD, RAW, WIN, PROC, MARK, END, CONS)
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


# Fields a recording whose header does not say each field's width (written before it did) stored
# as float64 though the catalogue no longer makes them counters: DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL
# was NVML's cumulative counter set 0 until it became DCGM's rate, a gauge.
_FLOAT64_BEFORE_HEADER = frozenset({"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"})


def stored_widths(group: Mapping[str, Any], fields: Sequence[Field]) -> npt.NDArray[np.bool_]:
    """Which of a header group's fields its raw chunks hold as float64: as the header says
    (``float64``), or, in a recording from before it said, as the catalogue made them then."""
    said = group.get("float64")
    if said is not None:
        return np.array(said, dtype=np.bool_).reshape(len(fields))
    was = [stored_as_float64(f) or f.name in _FLOAT64_BEFORE_HEADER for f in fields]
    return np.array(was, dtype=np.bool_).reshape(len(fields))


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


def consumer_to_json(consumer: Consumer) -> dict[str, Any]:
    """A consumer as stored: its kind and the fields that kind uses (no empty one)."""
    out: dict[str, Any] = {"kind": consumer.kind.value}
    for name in ("hpc_job", "pod_uid", "container_id", "unit", "command"):
        if value := getattr(consumer, name):
            out[name] = value
    if consumer.uid is not None:
        out["uid"] = consumer.uid
    return out


def consumer_from_json(d: Mapping[str, Any]) -> Consumer:
    """A stored consumer; a kind this hfsampler does not know reads as unknown."""
    try:
        kind = ConsumerKind(d.get("kind"))
    except ValueError:
        return Consumer.unknown()
    uid = d.get("uid")
    return Consumer(kind, str(d.get("hpc_job", "")), str(d.get("pod_uid", "")),
                    str(d.get("container_id", "")), str(d.get("unit", "")),
                    None if uid is None else int(uid), str(d.get("command", "")))  # fmt: skip


@dataclass(frozen=True, slots=True)
class ConsumerWindow:
    """What one window ``[t0_ns, t1_ns)`` saw of the recorded GPUs' consumers: per device
    (position in the recording's devices) the process-list entries and per-process SM samples
    read in it, as ``WindowUse`` with no energy (the report takes the window's energy from the
    millisecond power), and each pid's consumer (read from procfs by the recorder)."""

    t0_ns: int
    t1_ns: int
    uses: Mapping[int, WindowUse]
    consumers: Mapping[int, Consumer]

    def to_json(self) -> dict[str, Any]:
        def nan_none(v: float) -> float | None:
            return None if v != v else v

        return {
            "t0_ns": self.t0_ns,
            "t1_ns": self.t1_ns,
            "gpus": {
                str(row): {
                    "samples": [[int(p), int(t), float(v)] for p, t, v in
                                zip(u.util_pid, u.util_timestamp_us, u.util_sm_pct, strict=True)],
                    "entries": [[int(p), int(r), nan_none(float(m))] for p, r, m in
                                zip(u.mem_pid, u.mem_read, u.mem_used_bytes, strict=True)],
                }
                for row, u in self.uses.items()
            },
            "consumers": {str(pid): consumer_to_json(c) for pid, c in self.consumers.items()},
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ConsumerWindow:
        uses = {
            int(row): WindowUse.of(0.0, [(int(p), int(t), float(v)) for p, t, v in g["samples"]],
                                   [(int(p), int(r), None if m is None else float(m))
                                    for p, r, m in g["entries"]])
            for row, g in d["gpus"].items()
        }  # fmt: skip
        consumers = {int(pid): consumer_from_json(c) for pid, c in d["consumers"].items()}
        return cls(int(d["t0_ns"]), int(d["t1_ns"]), uses, consumers)

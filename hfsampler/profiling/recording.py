"""The recording's reader: frame by frame with ``pread``, every checksum checked; a damaged frame
is skipped to the next good one and counted, a torn tail ends the file, another format version is
refused in one line (``recording_format`` has the layout)."""

from __future__ import annotations

import array
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hfsampler.fields import BY_NAME, Role, locate
from hfsampler.profiling import recording_format as fmt
from hfsampler.profiling.recording_format import (
    ConsumerWindow,
    FloatArray,
    IntArray,
    Marker,
    RawChunk,
    RecordingError,
    WindowChunk,
    Windows,
)
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.window import WindowStats
from hfsampler.sources.base import DeviceInfo, MigInstance

# -- reader --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    tag: bytes
    offset: int
    length: int


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
    head = os.pread(fd, fmt._FRAME.size, off)
    if len(head) < fmt._FRAME.size:
        return None
    tag, length, crc = fmt._FRAME.unpack(head)
    start = off + fmt._FRAME.size
    if start + length > size:
        return None
    check, at = 0, start
    while at < start + length:  # in bounded pieces: a damaged length may claim the whole file
        piece = os.pread(fd, min(fmt._SCAN_BYTES, start + length - at), at)
        if not piece:
            return None
        check, at = zlib.crc32(piece, check), at + len(piece)
    return (tag, length) if check == crc else None


def _next_frame(fd: int, start: int, size: int) -> int | None:
    """Where the next good frame of a known tag begins at or after ``start``, else None."""
    at = start
    while at < size:
        block = os.pread(fd, fmt._SCAN_BYTES + 3, at)  # + 3: a tag across the block's end
        hits = sorted(i for tag in fmt._TAGS for i in _find_all(block, tag) if i < fmt._SCAN_BYTES)
        for i in hits:
            if _frame_at(fd, at + i, size) is not None:
                return at + i
        at += fmt._SCAN_BYTES
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
            if f.read(len(fmt.MAGIC)) != fmt.MAGIC:
                raise RecordingError(f"{self.path}: not an hfsampler recording (bad magic)")
            fd = f.fileno()
            size = os.fstat(fd).st_size
            off = len(fmt.MAGIC)
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
                tags.append(fmt._TAG_CODES.get(tag, len(fmt._TAGS)))
                offsets.append(off + fmt._FRAME.size)
                lengths.append(length)
                off += fmt._FRAME.size + length
        self._tags = np.frombuffer(bytes(tags), np.uint8)
        self._offsets = np.frombuffer(offsets, np.int64)
        self._lengths = np.frombuffer(lengths, np.int64)
        if not len(self._tags) or self._tags[0] != fmt._TAG_CODES[fmt.HEAD]:
            raise RecordingError(f"{self.path}: the header chunk is missing or damaged")
        self._windows: dict[int, Windows] = {}
        self.header, _ = self._load(0)
        found = self.header.get("format_version")
        if found != fmt.FORMAT_VERSION:
            raise RecordingError(
                f"{self.path}: recording format {found} (this hfsampler reads format "
                f"{fmt.FORMAT_VERSION} only; record the job again)"
            )
        self.devices = _devices(self.header)
        self.groups = _groups(self.header)
        self._wide = [fmt.stored_widths(h, g.fields)
                      for h, g in zip(self.header["groups"], self.groups, strict=True)]  # fmt: skip
        end = self._where(fmt.END)
        self.end: dict[str, Any] | None = self._load(int(end[-1]))[0] if len(end) else None

    @property
    def frames(self) -> list[Frame]:
        """Every readable frame, in file order."""
        return [
            Frame(fmt._TAGS[t] if t < len(fmt._TAGS) else b"????", int(o), int(n))
            for t, o, n in zip(self._tags, self._offsets, self._lengths, strict=True)
        ]

    def _where(self, tag: bytes) -> IntArray:
        return np.nonzero(self._tags == fmt._TAG_CODES[tag])[0].astype(np.int64)

    def _load(self, index: int) -> tuple[dict[str, Any], list[bytes]]:
        with open(self.path, "rb") as f:
            return fmt._unpack(os.pread(f.fileno(), int(self._lengths[index]),
                                    int(self._offsets[index])))  # fmt: skip

    def _payloads(
        self, tags: Sequence[bytes]
    ) -> Iterator[tuple[bytes, dict[str, Any], list[bytes]]]:
        """The frames with one of ``tags``, decoded one at a time, in file order."""
        codes = np.array([fmt._TAG_CODES[t] for t in tags], np.uint8)
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
                meta, blobs = fmt._unpack(payload, max(guess, zlib.DEF_BUF_SIZE))
                ratios[key] = (sum(map(len, blobs)) + 64) / max(1, length)
                yield fmt._TAGS[self._tags[k]], meta, blobs

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
        for _, meta, blobs in self._payloads((fmt.RAW,)):
            if group is None or meta["group"] == group:
                yield self._raw(meta, blobs)

    def stream(self) -> Iterator[RawChunk | WindowChunk]:
        """Raw chunks and windows of every group, one at a time in file (time) order: the one
        pass a report makes, holding a single chunk at a time."""
        names: list[str] = list(self.header["stats"])
        for tag, meta, blobs in self._payloads((fmt.RAW, fmt.WIN)):
            if tag == fmt.RAW:
                yield self._raw(meta, blobs)
            else:
                yield self._window(meta, blobs, names)

    def _raw(self, meta: dict[str, Any], blobs: list[bytes]) -> RawChunk:
        g = int(meta["group"])
        gpu = np.frombuffer(blobs[0], np.uint16).astype(np.int64)
        fld = np.frombuffer(blobs[1], np.uint16).astype(np.int64)
        counts = np.frombuffer(blobs[2], np.uint32).astype(np.int64)
        n, n32 = int(meta["n"]), int(meta["n32"])
        ts = np.cumsum(fmt._unshuffle(blobs[3], np.int64, n))
        v32 = fmt._xor_unpack(blobs[4], np.uint32, np.float32, n32).astype(np.float64)
        v64 = fmt._xor_unpack(blobs[5], np.uint64, np.float64, n - n32)
        wide = self._wide[g]
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
        for _, meta, blobs in self._payloads((fmt.WIN,)):
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
        for _, meta, _ in self._payloads((fmt.PROC,)):
            yield meta

    def processes(self) -> list[dict[str, Any]]:
        """Every process snapshot (see ``process_snapshots``)."""
        return list(self.process_snapshots())

    def consumer_spans_ns(self) -> Iterator[tuple[int, int]]:
        """Each consumer window's ``(t0_ns, t1_ns)``, in time order, without its contents."""
        for _, meta, _ in self._payloads((fmt.CONS,)):
            yield int(meta["t0_ns"]), int(meta["t1_ns"])

    def consumer_windows(self) -> Iterator[ConsumerWindow]:
        """Each window's consumers (``CONS``), in time order; none in a recording made before
        `record` kept them, or of a source without process lists."""
        for _, meta, _ in self._payloads((fmt.CONS,)):
            yield ConsumerWindow.from_json(meta)

    def markers(self) -> list[Marker]:
        """Every stored marker, in time order."""
        out = [Marker.from_json(m) for stored in self.marker_chunks() for m in stored]
        return sorted(out, key=lambda m: m.t_ns)

    def marker_chunks(self) -> Iterator[list[dict[str, Any]]]:
        """Each marker chunk's markers as stored (``Marker.to_json``), in file order: for a
        reader of a million steps that wants no ``Marker`` object each."""
        for _, meta, _ in self._payloads((fmt.MARK,)):
            yield meta["markers"]

    def time_range_ns(self) -> tuple[int, int]:
        """Start from the header; end from the end chunk, else the last window or raw chunk
        (chunks are appended in time order: the last few frames hold the latest end)."""
        start = int(self.header["start_ns"])
        if self.end is not None:
            return start, int(self.end["end_ns"])
        last = start
        data = np.nonzero(np.isin(self._tags, [fmt._TAG_CODES[fmt.RAW], fmt._TAG_CODES[fmt.WIN]]))[
            0
        ]
        for k in data[-2 * max(1, len(self.groups)) :]:
            meta, _ = self._load(int(k))
            last = max(last, int(meta.get("t1_ns", last)))
        return start, last

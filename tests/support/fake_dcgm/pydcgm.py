"""Fake of DCGM's ``pydcgm`` bindings: a scripted host engine at the module boundary.

Tests set ``ENGINE`` to a ``FakeEngine``; the classes below have the names, constructor keywords
and methods of pydcgm's (``DcgmHandle``, ``DcgmGroup`` with ``samples.WatchFields`` and
``samples.GetAllSinceLastCall``, ``DcgmFieldGroup``). ``FakeEngine.tick(ts_us)`` makes DCGM take
one sample of every watched field, so a test decides exactly what is cached between two reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dcgm_structs


@dataclass
class FakeValue:
    ts: int
    value: float
    isBlank: bool = False


@dataclass
class FakeEngine:
    gpu_ids: list[int]
    value: Callable[[int, int, int], float]  # (gpu id, field id, ts us) -> value
    watched: dict[int, tuple[int, float, int]] = field(default_factory=dict)  # id -> freq us, ...
    cache: dict[int, dict[int, list[FakeValue]]] = field(default_factory=dict)
    groups: int = 0
    shutdown: bool = False
    fail_connect: bool = False

    def tick(self, ts_us: int) -> None:
        for gid in self.gpu_ids:
            for fid in self.watched:
                self.cache.setdefault(gid, {}).setdefault(fid, []).append(
                    FakeValue(ts_us, self.value(gid, fid, ts_us))
                )


ENGINE: FakeEngine | None = None


def _engine() -> FakeEngine:
    if ENGINE is None:
        raise dcgm_structs.DCGMError(-6)
    return ENGINE


@dataclass
class _Identifiers:
    uuid: str
    deviceName: str
    pciBusId: str
    driverVersion: str


@dataclass
class _Attributes:
    identifiers: _Identifiers


class _Discovery:
    def GetAllSupportedGpuIds(self) -> list[int]:
        return list(_engine().gpu_ids)

    def GetGpuAttributes(self, gpu_id: int) -> _Attributes:
        return _Attributes(
            _Identifiers(f"GPU-dcgm-{gpu_id}", "NVIDIA H200", f"00000000:{gpu_id:02X}:00.0", "570")
        )


class _System:
    discovery = _Discovery()


class DcgmHandle:
    def __init__(self, ipAddress: str = "localhost", opMode: int = 0) -> None:
        if _engine().fail_connect:
            raise dcgm_structs.DCGMError(-2)
        self.address = ipAddress

    def GetSystem(self) -> _System:
        return _System()

    def Shutdown(self) -> None:
        _engine().shutdown = True


class DcgmFieldGroup:
    def __init__(self, handle: DcgmHandle, name: str, fieldIds: list[int]) -> None:
        self.field_ids = list(fieldIds)

    def Delete(self) -> None:
        pass


class DcgmFieldValueCollection:
    def __init__(self, values: dict[int, dict[int, list[FakeValue]]]) -> None:
        self.values = values

    def EmptyValues(self) -> None:
        self.values = {}


class _Samples:
    def WatchFields(
        self,
        fg: DcgmFieldGroup,
        updateFreq: int,
        maxKeepAge: float,
        maxKeepSamples: int,
    ) -> None:
        for fid in fg.field_ids:
            _engine().watched[fid] = (updateFreq, maxKeepAge, maxKeepSamples)

    def UnwatchFields(self, fg: DcgmFieldGroup) -> None:
        for fid in fg.field_ids:
            _engine().watched.pop(fid, None)

    def GetAllSinceLastCall(self, dfvc: Any, fg: DcgmFieldGroup) -> DcgmFieldValueCollection:
        engine = _engine()
        taken, engine.cache = engine.cache, {}
        return DcgmFieldValueCollection(taken)


class DcgmGroup:
    def __init__(self, handle: DcgmHandle, groupName: str, groupType: int) -> None:
        self.gpus: list[int] = []
        self.samples = _Samples()
        _engine().groups += 1

    def AddGpu(self, gpu_id: int) -> None:
        self.gpus.append(gpu_id)

    def Delete(self) -> None:
        _engine().groups -= 1

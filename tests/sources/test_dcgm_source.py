"""The dcgm source over a fake of DCGM's Python bindings (``tests/fake_dcgm``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from hfsampler import fields as F
from hfsampler.errors import DriverNotFoundError, SourceError
from hfsampler.sources.base import SourceSpec
from hfsampler.sources.dcgm import DcgmSource
from hfsampler.sources.registry import open_source

FAKE_PATH = str(Path(__file__).resolve().parents[1] / "support" / "fake_dcgm")
ACTIVITY = tuple(f for f in F.CATALOGUE if f.group == F.GPM)
SM = F.BY_NAME["DCGM_FI_PROF_SM_ACTIVE"]


def _value(gpu: int, field_id: int, ts_us: int) -> float:
    return field_id / 10_000 + gpu / 100 + (ts_us // 100_000) % 5 / 1000


@pytest.fixture
def pydcgm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("pydcgm", "dcgm_structs"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    sys.path.insert(0, FAKE_PATH)
    import pydcgm as module

    module.ENGINE = module.FakeEngine([0, 1], _value)
    yield module
    for name in ("pydcgm", "dcgm_structs"):
        sys.modules.pop(name, None)


def _read(s: DcgmSource, fields: tuple[F.Field, ...]) -> tuple[np.ndarray, np.ndarray]:
    values = np.zeros((2, len(fields)))
    ts = np.zeros((2, len(fields)), dtype=np.int64)
    s.read(fields, values, ts, 0)
    return values, ts


def test_watches_at_the_configured_frequency_and_delivers_every_value(pydcgm: ModuleType) -> None:
    source = open_source(SourceSpec("dcgm", dcgm_path=FAKE_PATH, dcgm_interval_s=0.1))
    assert isinstance(source, DcgmSource)
    inv = source.open((SM, *ACTIVITY[2:4]))
    engine = pydcgm.ENGINE
    assert [d.uuid for d in inv.devices] == ["GPU-dcgm-0", "GPU-dcgm-1"]
    assert inv.supported.all()
    assert engine.watched[SM.dcgm_field][0] == 100_000  # 100 ms, in microseconds
    for t in (1_000_000, 1_100_000, 1_200_000):  # three samples cached between two reads
        engine.tick(t)
    fields = (SM,)
    got = [_read(source, fields) for _ in range(4)]
    # every cached value comes out, oldest first, with DCGM's own timestamp; then nothing new
    assert [int(ts[0, 0]) for _, ts in got] == [1_000_000, 1_100_000, 1_200_000, 0]
    assert got[1][0][1, 0] == pytest.approx(_value(1, 1002, 1_100_000))
    assert np.isnan(got[3][0]).all()
    source.close()
    assert engine.shutdown
    assert engine.groups == 0
    assert engine.watched == {}


def test_values_are_dcgm_units_unscaled(pydcgm: ModuleType) -> None:
    source = DcgmSource(FAKE_PATH)
    source.open(ACTIVITY)
    pydcgm.ENGINE.tick(5_000_000)
    values, _ = _read(source, ACTIVITY)
    for j, f in enumerate(ACTIVITY):
        assert values[0, j] == pytest.approx(_value(0, f.dcgm_field or 0, 5_000_000))
    source.close()


def test_fields_without_dcgm_id_are_unsupported(pydcgm: ModuleType) -> None:
    power = F.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]
    source = DcgmSource(FAKE_PATH)
    inv = source.open((power, SM))
    assert inv.supported.tolist() == [[False, True], [False, True]]
    with pytest.raises(SourceError, match="not opened"):
        _read(source, (F.BY_NAME["DCGM_FI_DEV_GPU_TEMP"],))
    source.close()


def test_engine_unreachable_is_a_source_error(pydcgm: ModuleType) -> None:
    pydcgm.ENGINE.fail_connect = True
    with pytest.raises(SourceError, match="DCGM at localhost"):
        DcgmSource(FAKE_PATH).open(ACTIVITY)


def test_missing_bindings_say_how_to_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "fake_dcgm" not in p])
    monkeypatch.delitem(sys.modules, "pydcgm", raising=False)
    with pytest.raises(DriverNotFoundError, match=r"dcgm\.path"):
        DcgmSource(str(tmp_path)).open(ACTIVITY)


def test_config_dcgm_block_reaches_the_source_spec() -> None:
    from hfsampler.config.loader import from_mapping
    from hfsampler.errors import ConfigError
    from hfsampler.sampling.resolve import resolve_source

    config = from_mapping(
        {"source": "dcgm", "dcgm": {"path": FAKE_PATH, "host": "engine:5555", "interval": "50ms"}}
    )
    spec = resolve_source(config)
    assert (spec.kind, spec.dcgm_path, spec.dcgm_host) == ("dcgm", FAKE_PATH, "engine:5555")
    assert spec.dcgm_interval_s == pytest.approx(0.05)
    with pytest.raises(ConfigError, match=r"^dcgm\.intervl.*'interval'"):
        from_mapping({"dcgm": {"intervl": "1s"}})

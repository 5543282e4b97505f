"""The catalogue: one table that every stage reads, with no name spelled twice."""

from __future__ import annotations

import pytest

from hfsampler import fields
from hfsampler.errors import ConfigError
from hfsampler.fields import CATALOGUE, Kind
from hfsampler.sampling.window import exported_names

DCGM_EXPORTER_DEFAULTS = {
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_POWER_USAGE_INSTANT",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL",
    "DCGM_FI_DEV_DEC_UTIL",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
}


def test_catalogue_covers_dcgm_exporter_defaults() -> None:
    assert {f.name for f in CATALOGUE} >= DCGM_EXPORTER_DEFAULTS


def test_names_unique_and_every_field_readable() -> None:
    import pynvml

    names = [f.name for f in CATALOGUE]
    assert len(names) == len(set(names))
    for f in CATALOGUE:
        assert f.nvml_readable or f.jetson, f.name
        if f.nvml_field and "{link}" in f.nvml_field:  # one id per link: NVML has links 0-11
            for link in (0, 11):
                constant = f.nvml_field.format(link=link)
                assert isinstance(getattr(pynvml, constant), int), constant
        elif f.nvml_field:
            assert isinstance(getattr(pynvml, f.nvml_field), int), f.nvml_field
        assert f.group in fields.DEFAULT_GROUP_INTERVALS_S
        assert f.help.endswith(".")


def test_counters_are_counters_and_only_gauges_have_siblings() -> None:
    energy = fields.BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert energy.kind is Kind.COUNTER
    assert energy.prometheus_type == "counter"
    assert exported_names(energy) == (energy.name,)
    power = fields.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]
    assert exported_names(power) == (
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_POWER_USAGE_min",
        "DCGM_FI_DEV_POWER_USAGE_max",
        "DCGM_FI_DEV_POWER_USAGE_p99",
    )


def test_default_groups_follow_the_issue() -> None:
    fast = {f.name for f in CATALOGUE if f.group == fields.FAST}
    assert {
        "DCGM_FI_DEV_POWER_USAGE_INSTANT",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
    } <= fast
    slow = {f.name for f in CATALOGUE if f.group == fields.SLOW}
    assert {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"} <= slow


def test_select_by_name_short_name_and_group() -> None:
    chosen = fields.select(["power_usage", "DCGM_FI_DEV_GPU_TEMP", "slow"])
    names = {f.name for f in chosen}
    assert "DCGM_FI_DEV_POWER_USAGE" in names
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" in names
    assert "DCGM_FI_DEV_GPU_UTIL" not in names
    assert fields.select(["all"]) == CATALOGUE


def test_per_link_fields_are_opt_in() -> None:
    """Not by default nor with their group: by name or ``all``, beside what was chosen."""
    per_link = {f.name for f in CATALOGUE if f.per == "link"}
    assert len(per_link) == 6
    assert {f.name for f in CATALOGUE if f.opt_in} == per_link
    default = {f.name for f in fields.select(None)}
    assert default == {f.name for f in CATALOGUE} - per_link
    assert not per_link & {f.name for f in fields.select(["fast", "slow", "gpm"])}
    chosen = {f.name for f in fields.select(["slow", "NVLINK_REPLAY_ERROR_PER_LINK_TOTAL"])}
    assert chosen & per_link == {"DCGM_FI_DEV_NVLINK_REPLAY_ERROR_PER_LINK_TOTAL"}
    assert per_link <= {f.name for f in fields.select(["all"])}


def test_select_unknown_names_the_key_and_fix() -> None:
    with pytest.raises(ConfigError, match=r"fields: unknown field 'powr'.*hfsampler fields"):
        fields.select(["powr"])


def test_regroup_moves_a_field() -> None:
    moved = fields.regroup(CATALOGUE, {"DCGM_FI_DEV_GPU_TEMP": "fast"})
    assert next(f for f in moved if f.name == "DCGM_FI_DEV_GPU_TEMP").group == "fast"
    with pytest.raises(ConfigError, match="field_groups"):
        fields.regroup(CATALOGUE, {"NOPE": "fast"})


def test_jetson_fields_follow_the_naming_and_expand_per_instance() -> None:
    jetson_only = [f for f in CATALOGUE if f.jetson and not f.nvml_readable]
    assert jetson_only
    for f in jetson_only:
        assert f.name.startswith("hfsampler_jetson_"), f.name
        assert not f.labels  # the catalogue holds templates; sources add the instance's label
    per = {f.name: f.per for f in CATALOGUE if f.per and f.per != "link"}
    assert per == {
        "hfsampler_jetson_rail_power_watts": "rail",
        "hfsampler_jetson_rail_voltage_volts": "rail",
        "hfsampler_jetson_rail_current_amperes": "rail",
        "hfsampler_jetson_temp_celsius": "zone",
    }
    # the dcgm-exporter names a Jetson fills too
    read_on_jetson = {f.name for f in CATALOGUE if f.jetson and f.nvml_readable}
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_TEMP",
            "DCGM_FI_DEV_POWER_USAGE_INSTANT", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"} <= read_on_jetson  # fmt: skip
    temp = fields.BY_NAME["hfsampler_jetson_temp_celsius"].instance("GPU-therm")
    assert temp.labels == (("zone", "GPU-therm"),)
    assert temp.name == "hfsampler_jetson_temp_celsius"
    with pytest.raises(ValueError, match="not a per-instance field"):
        fields.BY_NAME["DCGM_FI_DEV_GPU_TEMP"].instance("x")


def test_roles_pick_the_best_field_recorded() -> None:
    power = fields.BY_NAME["DCGM_FI_DEV_POWER_USAGE"]
    instant = fields.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"]
    fb = fields.BY_NAME["DCGM_FI_DEV_FB_USED"]
    assert fields.pick(fields.POWER, [power, instant]) is instant  # instant power first
    assert fields.pick(fields.POWER, [fb, power]) is power  # else the 1 s average
    assert fields.pick(fields.POWER, [fb]) is None
    assert fields.locate(fields.POWER, [(fb,), (power,)]) == (1, 0)
    assert fields.locate(fields.GPU_TEMP, [(fb,), (power,)]) is None
    with pytest.raises(ValueError, match="catalogue"):
        fields.Role(("DCGM_FI_DEV_NO_SUCH_FIELD",))

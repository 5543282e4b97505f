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
        assert f.nvml_readable or f.jetson or f.counted, f.name
        assert all(r in fields.BY_NAME for r in f.requires), f.name
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
    opt_in = {f.name for f in CATALOGUE if f.opt_in}
    assert per_link <= opt_in
    default = {f.name for f in fields.select(None)}
    assert default == {f.name for f in CATALOGUE} - opt_in
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


# What dcgm-exporter's counters files leave commented out (opt-in) and hfsampler reads or counts:
# etc/default-counters.csv at NVIDIA/dcgm-exporter 8dc9e11b (4.8.4; docs/dcgm-exporter-parity.md).
DCGM_EXPORTER_OPT_IN = {
    "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_FI_DEV_THERMAL_VIOLATION",
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
    "DCGM_FI_DEV_RELIABILITY_VIOLATION",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "DCGM_FI_DEV_RETIRED_SBE",
    "DCGM_FI_DEV_RETIRED_DBE",
    "DCGM_FI_DEV_RETIRED_PENDING",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_TOTAL",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT",
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
    "DCGM_EXP_XID_ERRORS_COUNT",
    "DCGM_EXP_CLOCK_EVENTS_COUNT",
    "DCGM_EXP_XID_ERRORS_TOTAL",
    "DCGM_EXP_CLOCK_EVENTS_TOTAL",
}


def test_catalogue_has_dcgm_exporter_opt_in_rows_and_new_ones_stay_opt_in() -> None:
    """Every opt-in row hfsampler can serve is there; the ones hfsampler did not have before
    are opt-in here too (the older ones stay in the defaults: a series more breaks no query)."""
    assert fields.BY_NAME.keys() >= DCGM_EXPORTER_OPT_IN
    default = {f.name for f in fields.select(None)}
    assert "DCGM_FI_DEV_ENFORCED_POWER_LIMIT" not in default
    assert not {f.name for f in CATALOGUE if f.counted} & default
    assert "DCGM_FI_DEV_POWER_MGMT_LIMIT" in default  # the shipped alerts read it


def test_violation_time_is_in_ns_as_nvml_counts_it() -> None:
    for name in ("POWER", "THERMAL", "SYNC_BOOST", "BOARD_LIMIT", "LOW_UTIL", "RELIABILITY"):
        f = fields.BY_NAME[f"DCGM_FI_DEV_{name}_VIOLATION"]
        assert (f.unit, f.scale, f.kind) == ("ns", 1.0, Kind.COUNTER), f.name
        assert "(in ns)" in f.help


def test_a_counted_field_brings_the_fields_it_counts() -> None:
    chosen = {f.name for f in fields.select(["DCGM_EXP_XID_ERRORS_COUNT"])}
    assert chosen == {
        "DCGM_EXP_XID_ERRORS_COUNT",
        "DCGM_FI_DEV_XID_ERRORS",
        "hfsampler_xid_events_total",
    }
    clock = {f.name for f in fields.select(["dcgm_exp_clock_events_count"])}
    assert clock == {"DCGM_EXP_CLOCK_EVENTS_COUNT", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"}


def test_power_limit_role_prefers_the_enforced_limit() -> None:
    both = fields.select(["POWER_MGMT_LIMIT", "ENFORCED_POWER_LIMIT"])
    found = fields.pick(fields.POWER_LIMIT, both)
    assert found is not None
    assert found.name == "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"
    found = fields.pick(fields.POWER_LIMIT, fields.select(None))
    assert found is not None
    assert found.name == "DCGM_FI_DEV_POWER_MGMT_LIMIT"

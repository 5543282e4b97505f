"""`fields_csv`: dcgm-exporter's counters files select what they select there, read by its rules.

The shipped files are copies in tests/support/dcgm_exporter/ (README there: commits and the rows
each leaves active, which the tests below name one by one).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import aiohttp
import pytest
from inprocess import free_port, run_plan, start_ns

from hfsampler import fields as catalogue
from hfsampler.cli.main import main
from hfsampler.config.counters_csv import parse_rows, read_counters_file
from hfsampler.config.loader import from_mapping, load_file
from hfsampler.config.reload import plan_reload
from hfsampler.errors import ConfigError
from hfsampler.export.service import Service
from hfsampler.sampling.stepping import VirtualClock

SHIPPED = Path(__file__).resolve().parents[1] / "support" / "dcgm_exporter"
S = 10**9

# The rows both 7ad58324 files leave active, in file order (README there).
ACTIVE_7AD5832 = (
    *(f"DCGM_FI_DEV_{n}" for n in (
        "SM_CLOCK", "MEM_CLOCK", "MEMORY_TEMP", "GPU_TEMP", "POWER_USAGE",
        "TOTAL_ENERGY_CONSUMPTION", "PCIE_REPLAY_COUNTER", "GPU_UTIL", "MEM_COPY_UTIL",
        "ENC_UTIL", "DEC_UTIL", "XID_ERRORS", "FB_FREE", "FB_USED", "FB_RESERVED",
        "NVLINK_BANDWIDTH_TOTAL", "VGPU_LICENSE_STATUS", "UNCORRECTABLE_REMAPPED_ROWS",
        "CORRECTABLE_REMAPPED_ROWS", "ROW_REMAP_FAILURE")),
    "DCGM_FI_DRIVER_VERSION",
    *(f"DCGM_FI_PROF_{n}" for n in (
        "GR_ENGINE_ACTIVE", "PIPE_TENSOR_ACTIVE", "DRAM_ACTIVE", "PCIE_TX_BYTES",
        "PCIE_RX_BYTES")),
)  # fmt: skip
# The older default file: the PCIe throughputs, no FB_RESERVED, no label, no profiling row.
ACTIVE_B54068A = tuple(f"DCGM_FI_DEV_{n}" for n in (
    "SM_CLOCK", "MEM_CLOCK", "MEMORY_TEMP", "GPU_TEMP", "POWER_USAGE", "TOTAL_ENERGY_CONSUMPTION",
    "PCIE_TX_THROUGHPUT", "PCIE_RX_THROUGHPUT", "PCIE_REPLAY_COUNTER", "GPU_UTIL",
    "MEM_COPY_UTIL", "ENC_UTIL", "DEC_UTIL", "XID_ERRORS", "FB_FREE", "FB_USED",
    "NVLINK_BANDWIDTH_TOTAL", "VGPU_LICENSE_STATUS", "UNCORRECTABLE_REMAPPED_ROWS",
    "CORRECTABLE_REMAPPED_ROWS", "ROW_REMAP_FAILURE"))  # fmt: skip
SHIPPED_FILES = {
    "default-counters.csv": ACTIVE_7AD5832,
    "dcp-metrics-included.csv": ACTIVE_7AD5832,
    "default-counters-b54068a.csv": ACTIVE_B54068A,
}


def _write(tmp_path: Path, text: str, name: str = "counters.csv") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return str(path)


def _left_out_line(warnings: list[str]) -> str:
    lines = [w for w in warnings if "left out" in w]
    assert len(lines) == 1, warnings  # every name hfsampler lacks, in one line
    return lines[0]


@pytest.mark.parametrize("name", sorted(SHIPPED_FILES))
def test_a_shipped_file_selects_every_active_row_hfsampler_has_and_names_the_rest(
    name: str,
) -> None:
    config = from_mapping({"fields_csv": str(SHIPPED / name)})
    active = SHIPPED_FILES[name]
    assert config.fields_csv is not None
    assert [r.name for r in config.fields_csv.rows] == list(active)  # no comment read as a row
    selected = [f.name for f in config.selected_fields()]
    warned = _left_out_line(config.warnings()).split("left out: ", 1)[1].split(", ")
    for row in active:
        if row == "DCGM_FI_DRIVER_VERSION":  # a label hfsampler sets on every series anyway
            assert row not in selected
            assert row not in warned
            continue
        assert (row in selected) != (row in warned), row  # one or the other, never both
        assert (row in selected) == (row in catalogue.BY_NAME), row
    assert set(selected) <= set(active)  # nothing the file does not name
    for known in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED",
                  "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"):  # fmt: skip
        assert known in selected
    # in hfsampler's default selection, not in the file: not sampled
    assert "DCGM_FI_DEV_POWER_USAGE_INSTANT" not in selected
    assert "DCGM_FI_DEV_POWER_VIOLATION" not in selected  # a commented row
    assert "DCGM_FI_DEV_VGPU_LICENSE_STATUS" in warned  # a DCGM field hfsampler does not read


def test_the_profiling_rows_select_the_gpm_fields_and_the_label_is_set_anyway() -> None:
    config = from_mapping({"fields_csv": str(SHIPPED / "dcp-metrics-included.csv")})
    selected = [f.name for f in config.selected_fields()]
    assert "DCGM_FI_PROF_DRAM_ACTIVE" in selected
    assert "DCGM_FI_PROF_SM_ACTIVE" not in selected  # commented out there
    assert config.fields_csv is not None
    assert "labels hfsampler sets on every series: DCGM_FI_DRIVER_VERSION" in "\n".join(
        config.fields_csv.describe()
    )


def test_the_file_help_is_exported_and_a_contradicting_type_or_unit_is_not(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        "DCGM_FI_DEV_GPU_TEMP, untyped, Die temperature (in C).\n"
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, gauge, Energy (in mJ).\n"
        "DCGM_FI_DEV_FB_USED, gauge, Memory used (in GB).\n"
        "DCGM_FI_DEV_SM_CLOCK, gauge,\n",
    )
    config = from_mapping({"fields_csv": path})
    by_name = {f.name: f for f in config.selected_fields()}
    assert by_name["DCGM_FI_DEV_GPU_TEMP"].help == "Die temperature (in C)."
    energy = by_name["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert energy.help == "Energy (in mJ)."
    assert energy.prometheus_type == "counter"
    fb = catalogue.BY_NAME["DCGM_FI_DEV_FB_USED"]
    assert by_name[fb.name].help == fb.help  # hfsampler exports MiB, not GB
    assert by_name["DCGM_FI_DEV_SM_CLOCK"].help == catalogue.BY_NAME["DCGM_FI_DEV_SM_CLOCK"].help
    types = [w for w in config.warnings() if "catalogue's type" in w]
    assert types == [
        f"fields_csv: {path}: a window reduces a counter and a gauge differently, so these keep "
        "the catalogue's type: DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (gauge on line 2, counter "
        "here)"
    ]
    assert config.fields_csv is not None
    assert any("DCGM_FI_DEV_FB_USED (the file's help says in GB, hfsampler exports MiB)" in line
               for line in config.fields_csv.describe())  # fmt: skip


def test_every_unknown_name_in_one_warning_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "DCGM_FI_DEV_GPU_TEMP, gauge, t\n"
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS, gauge, v\n"
        "DCGM_EXP_GPU_HEALTH_STATUS, gauge, h\n"
        "DCGM_FI_NVML_VERSION, label, v\n"
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0, counter, l0\n"
        "dcgm_gpu_temp, gauge, a 1.x name\n",
    )
    config = from_mapping({"fields_csv": path})
    assert [f.name for f in config.selected_fields()] == ["DCGM_FI_DEV_GPU_TEMP"]
    assert _left_out_line(config.warnings()) == (
        f"fields_csv: {path}: hfsampler has no field for these, left out: "
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS, DCGM_EXP_GPU_HEALTH_STATUS, "
        "DCGM_FI_NVML_VERSION (a label), "
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0, dcgm_gpu_temp"
    )


def test_names_are_taken_as_written_and_given_twice_the_first_row_counts(tmp_path: Path) -> None:
    """As dcgm-exporter looks them up: no prefix left out, no case folded (unlike `fields`)."""
    path = _write(
        tmp_path,
        "GPU_TEMP, gauge, t\n"
        "dcgm_fi_dev_fb_used, gauge, f\n"
        "DCGM_FI_DEV_SM_CLOCK, gauge, first (in MHz)\n"
        "DCGM_FI_DEV_SM_CLOCK, counter, second\n",
    )
    config = from_mapping({"fields_csv": path})
    assert [(f.name, f.help) for f in config.selected_fields()] == [
        ("DCGM_FI_DEV_SM_CLOCK", "first (in MHz)")
    ]
    assert "GPU_TEMP, dcgm_fi_dev_fb_used" in _left_out_line(config.warnings())


def test_comments_blank_lines_quotes_and_spaces_as_gos_csv_reader(tmp_path: Path) -> None:
    text = (
        "# a comment, with, commas\r\n"
        "\r\n"
        'DCGM_FI_DEV_GPU_TEMP,gauge,"Temperature, ""die"" (in C)"\r\n'
        'DCGM_FI_DEV_FB_USED , gauge ,"two\r\nlines"\r\n'
        "DCGM_FI_DEV_SM_CLOCK,  gauge  ,   spaced   \n"
        "#DCGM_FI_DEV_MEM_CLOCK, gauge, off\n"
    )
    rows = parse_rows(text, "f.csv")
    assert [(r.line, r.name, r.type, r.help) for r in rows] == [
        (3, "DCGM_FI_DEV_GPU_TEMP", "gauge", 'Temperature, "die" (in C)'),
        (4, "DCGM_FI_DEV_FB_USED", "gauge", "two\nlines"),
        (6, "DCGM_FI_DEV_SM_CLOCK", "gauge", "spaced"),
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("DCGM_FI_DEV_GPU_TEMP, gauge, t\n  # indented\n", "line 2: 1 fields"),
        ("DCGM_FI_DEV_GPU_TEMP, gauge, t\n   \n", "line 2: 1 fields"),
        ("DCGM_FI_DEV_GPU_TEMP, gauge\n", "line 1: 2 fields"),
        ("DCGM_FI_DEV_GPU_TEMP, gauge, t, extra\n", "line 1: 4 fields"),
        ("\nDCGM_FI_DEV_GPU_TEMP, histogram, t\n", "line 2: DCGM_FI_DEV_GPU_TEMP: unknown type"),
        ("DCGM_FI_DEV_GPU_TEMP, Gauge, t\n", "unknown type 'Gauge'"),
        ("DCGM_FI_DEV_GPU_TEMP,\tgauge, t\n", "unknown type '\\tgauge'"),  # spaces only trimmed
        ('DCGM_FI_DEV_GPU_TEMP, gauge, "quoted"\n', "line 1: a quote inside an unquoted"),
        ('DCGM_FI_DEV_GPU_TEMP, gauge,"a"b\n', "line 1: text after a closing quote"),
        ('# c\nDCGM_FI_DEV_GPU_TEMP, gauge,"open\n\n', "line 2: a quoted field is never closed"),
        (", gauge, t\n", "line 1: no field name"),
        ("\ufeffDCGM_FI_DEV_GPU_TEMP, gauge, t\n", "starts with a byte-order mark"),
    ],
)
def test_a_row_dcgm_exporter_refuses_is_refused_naming_key_file_and_line(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        from_mapping({"fields_csv": path})
    assert err.value.key == "fields_csv"
    assert path in str(err.value)
    assert problem in str(err.value)


def test_a_missing_file_or_one_selecting_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"fields_csv: cannot read .*nope\.csv"):
        from_mapping({"fields_csv": str(tmp_path / "nope.csv")})
    path = _write(tmp_path, "# only comments\nDCGM_FI_DEV_VGPU_LICENSE_STATUS, gauge, v\n")
    with pytest.raises(ConfigError, match="selects no field hfsampler has"):
        from_mapping({"fields_csv": path})
    # with `fields` besides, the file may select nothing of its own
    assert [f.name for f in from_mapping({"fields_csv": path, "fields": ["gpu_temp"]})
            .selected_fields()] == ["DCGM_FI_DEV_GPU_TEMP"]  # fmt: skip


def test_fields_adds_to_the_file_and_empty_turns_it_off(tmp_path: Path) -> None:
    path = _write(tmp_path, "DCGM_FI_DEV_GPU_TEMP, gauge, t (in C)\n")
    config = from_mapping({"fields_csv": path, "fields": ["DCGM_FI_DEV_POWER_USAGE_INSTANT"]})
    assert [(f.name, f.help) for f in config.selected_fields()] == [
        ("DCGM_FI_DEV_GPU_TEMP", "t (in C)"),
        ("DCGM_FI_DEV_POWER_USAGE_INSTANT",
         catalogue.BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"].help),
    ]  # fmt: skip
    assert from_mapping({"fields_csv": ""}).fields_csv is None


def test_a_changed_file_needs_a_restart_as_fields_does(tmp_path: Path) -> None:
    path = _write(tmp_path, "DCGM_FI_DEV_GPU_TEMP, gauge, t\n")
    old = from_mapping({"fields_csv": path})
    assert plan_reload(old, from_mapping({"fields_csv": path})).needs_restart == ()
    _write(tmp_path, "DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_FB_USED, gauge, f\n")
    plan = plan_reload(old, from_mapping({"fields_csv": path}))
    assert plan.needs_restart == ("fields_csv",)
    assert plan.config.fields_csv == old.fields_csv  # the running selection stays


def test_check_config_with_the_flag_alone_or_over_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shipped = str(SHIPPED / "default-counters.csv")
    assert main(["check-config", "--fields-csv", shipped]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{shipped}: OK\n")
    assert re.search(r"^  warning: fields_csv: .*left out: DCGM_FI_DEV_VGPU_LICENSE_STATUS$", out,
                     re.M)  # fmt: skip
    assert "24 fields selected, 1 left out" in out
    assert re.search(
        r"^    selected: DCGM_FI_DEV_SM_CLOCK, .*DCGM_FI_PROF_PCIE_RX_BYTES$", out, re.M
    )
    config = tmp_path / "hfsampler.yml"
    config.write_text(f"fields_csv: {shipped}\nfields: [DCGM_FI_DEV_POWER_USAGE_INSTANT]\n")
    assert main(["check-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "24 fields selected" in out
    assert "group fast:" in out
    # the flag over the file's key
    old = _write(tmp_path, (SHIPPED / "default-counters-b54068a.csv").read_text(), "old.csv")
    assert main(["check-config", str(config), "--fields-csv", old]) == 0
    assert "20 fields selected" in capsys.readouterr().out


def test_a_bad_file_through_the_cli_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_FB_USED, summary, f\n")
    assert main(["check-config", "--fields-csv", path]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"hfsampler: error: --fields-csv: {path}, line 2: DCGM_FI_DEV_FB_USED: unknown type "
        "'summary' (dcgm-exporter takes counter, gauge, untyped, label)\n"
    )
    config = tmp_path / "hfsampler.yml"
    config.write_text(f"fields_csv: {tmp_path / 'missing.csv'}\n")
    assert main(["check-config", str(config)]) == 2
    assert "hfsampler: error: fields_csv: cannot read" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="fields_csv"):
        load_file(config)
    assert main(["check-config"]) == 2


def test_read_counters_file_names_the_flag_it_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        read_counters_file(str(tmp_path / "x.csv"), "--fields-csv")
    assert err.value.key == "--fields-csv"


async def test_run_on_the_sim_serves_what_the_shipped_file_selects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`hfsampler run --source sim --fields-csv default-counters.csv`: its fields on /metrics
    with its help, none of hfsampler's defaults it leaves out, the warning said at start."""
    caplog.set_level(logging.INFO)
    port = free_port()
    shipped = str(SHIPPED / "default-counters.csv")
    plan = run_plan("--source", "sim", "--gpus", "1", "--duration", "3s", "--listen",
                    f"127.0.0.1:{port}", "--fields-csv", shipped)  # fmt: skip
    started = start_ns()
    clock = VirtualClock(started)
    pages: list[str] = []

    async def scrape() -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            pages.append(await resp.text())

    clock.at(started + 2 * S + S // 2, scrape)
    assert await Service(plan, clock=clock).run() == 0
    page = pages[-1]
    assert re.search(r"^# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature \(in C\); ", page, re.M)
    assert re.search(r"^# HELP DCGM_FI_DEV_POWER_USAGE Power draw \(in W\); ", page, re.M)
    assert re.search(r'^DCGM_FI_DEV_FB_USED_max\{.*gpu="0"', page, re.M)
    # declared a gauge in the file, as DCGM's rate is: a gauge here too
    assert "# TYPE DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL gauge" in page
    for absent in ("DCGM_FI_DEV_POWER_USAGE_INSTANT", "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
                   "hfsampler_xid_events_total", "DCGM_FI_DEV_POWER_VIOLATION"):  # fmt: skip
        assert not re.search(rf"^{absent}[{{_ ]", page, re.M), absent
    assert "left out: DCGM_FI_DEV_VGPU_LICENSE_STATUS" in caplog.text


def test_a_counted_row_brings_the_fields_it_counts(tmp_path: Path) -> None:
    """dcgm-exporter's DCGM_EXP_* rows are counted from other fields the file need not name."""
    path = _write(tmp_path, "DCGM_EXP_CLOCK_EVENTS_COUNT, gauge, clock events\n")
    config = from_mapping({"fields_csv": path})
    assert [f.name for f in config.counted_fields()] == ["DCGM_EXP_CLOCK_EVENTS_COUNT"]
    assert [f.name for f in config.selected_fields()] == ["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]


def test_an_empty_fields_beside_the_file_adds_none_and_a_file_of_strangers_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `fields: []` (a Helm value left empty) means none besides the file, not a mistake
    path = _write(tmp_path, "DCGM_FI_DEV_GPU_TEMP, gauge, t\n")
    config = tmp_path / "hfsampler.yml"
    config.write_text(f"fields: []\nfields_csv: {path}\n")
    assert main(["check-config", str(config)]) == 0
    assert "1 fields selected" in capsys.readouterr().out
    # a file whose every name is unknown (written in lower case, say) says which they are
    path = _write(tmp_path, "dcgm_fi_dev_gpu_temp, gauge, t\nDCGM_FI_FOO, gauge, f\n")
    assert main(["check-config", "--fields-csv", path]) == 2
    assert capsys.readouterr().err == (
        f"hfsampler: error: fields_csv: {path} selects no field hfsampler has (only "
        "dcgm_fi_dev_gpu_temp, DCGM_FI_FOO) (`hfsampler fields` lists them; name some in the "
        "file or in fields)\n"
    )

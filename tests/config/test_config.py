"""The config file and flags: durations, labels, and every mistake named with its fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hfsampler import fields as catalogue
from hfsampler.cli.main import build_parser, main
from hfsampler.config.flags import config_from_args
from hfsampler.config.labels import parse_label
from hfsampler.config.loader import from_mapping, load_file
from hfsampler.config.settings import Config
from hfsampler.durations import parse_duration
from hfsampler.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250us", 250e-6),
        ("1ms", 1e-3),
        ("1s", 1.0),
        ("1.5s", 1.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "k") == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "1", 1, "1 s", "s", "1sec", "-1s", True, None, [1]])
def test_bad_durations_name_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^window: "):
        parse_duration(bad, "window")


def test_label_parsing() -> None:
    assert parse_label("cluster=eu-1") == ("cluster", "eu-1")
    for bad in ("cluster", "=x", "1a=b", "__name__=x", "a="):
        with pytest.raises(ConfigError, match="--label"):
            parse_label(bad)


def test_full_file(tmp_path: Path) -> None:
    path = tmp_path / "hfsampler.yml"
    path.write_text(
        """
source: sim
gpus: 4
window: 2s
intervals: {fast: 2ms, slow: 200ms, medium: 10ms}
field_groups: {DCGM_FI_DEV_GPU_TEMP: medium}
fields: [fast, DCGM_FI_DEV_GPU_TEMP]
listen: 127.0.0.1:9500
global:
  external_labels: {datacenter: fra}
external_labels: {cluster: c1}
log_format: json
remote_write:
  - url: http://127.0.0.1:9090/api/v1/write
    name: local
"""
    )
    config = load_file(path)
    assert config.sim_gpus == 4
    assert config.window_s == 2.0
    assert config.intervals_s["medium"] == 0.01
    assert config.external_labels == {"datacenter": "fra", "cluster": "c1"}
    temp = next(f for f in config.selected_fields() if f.name == "DCGM_FI_DEV_GPU_TEMP")
    assert temp.group == "medium"
    assert len(config.remote_write) == 1


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("windw: 1s", r"^windw: unknown key \(did you mean 'window'\?\)"),
        ("window: 1", r"^window: '1' has no unit \(write 1s or 1ms\)"),
        ("gpus: two", r"^gpus: expected a whole number, got 'two' \(e\.g\. gpus: 2\)"),
        ("window: 0", r"^window: '0' has no unit \(write it like 1ms, 1s or 5m\)"),
        ("external_labels: [a, b]", r"external_labels: expected a mapping.*cluster: train-a"),
        (
            "source: cuda",
            r"^source: unknown source 'cuda' \(one of auto, nvml, sim, dcgm, jetson\)",
        ),
        ("intervals: {fast: 5s}", r"^intervals.fast: 5.0s is longer than the window"),
        ("intervals: {fast: 10us}", r"^intervals.fast: shorter than 100us"),
        ("field_groups: {DCGM_FI_DEV_GPU_TEMP: medium}", r"^field_groups.DCGM_FI_DEV_GPU_TEMP"),
        ("fields: [powr]", r"^fields: unknown field 'powr'"),
        ("listen: 9400", r"^listen: expected a string, got 9400 \(e\.g\. listen: :9400\)"),
        ("listen: 'localhost'", r"^listen: 'localhost' is not HOST:PORT"),
        ("external_labels: {'bad-name': x}", r"^external_labels.bad-name: invalid label name"),
        # a pasted Prometheus global block: scrape_interval is accepted (test_pasted_prometheus_*)
        ("global: {scrape_intervl: 15s}", r"^global.scrape_intervl: unknown key \(did you mean"),
        ("- a\n- b", r"must be a YAML mapping"),
        ("log_level: loud", r"^log_level: unknown level 'loud'"),
    ],
)
def test_mistakes_name_key_and_fix(tmp_path: Path, yaml_text: str, message: str) -> None:
    path = tmp_path / "c.yml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_file(path)


def test_yaml_syntax_error_gives_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("window: 1s\nfields: [fast\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+"):
        load_file(path)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="--config: cannot read"):
        load_file("/nonexistent/hfsampler.yml")


def test_empty_file_is_the_default(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("")
    assert load_file(path) == Config()


def test_from_mapping_keeps_base() -> None:
    base = Config(sim_gpus=3)
    assert from_mapping({"window": "2s"}, base).sim_gpus == 3


def test_instance_and_host_label_keys() -> None:
    assert from_mapping({}).instance is None
    assert from_mapping({}).instance_port == 9400
    assert from_mapping({"listen": ":9500"}).instance_port == 9500
    assert from_mapping({"listen": None}).instance_port == 9400
    assert from_mapping({"instance": False}).instance == ""
    assert from_mapping({"instance": "n1:1"}).instance == "n1:1"
    assert from_mapping({"host_label": "hostname"}).host_label == "hostname"
    for bad in ({"host_label": "host-name"}, {"host_label": "__host"}, {"host_label": "instance"}):
        with pytest.raises(ConfigError, match="host_label"):
            from_mapping(bad)
    with pytest.raises(ConfigError, match="instance"):
        from_mapping({"instance": 5})


def test_host_label_cannot_take_a_label_hfsampler_sets() -> None:
    for name in ("gpu", "UUID", "device", "group", "field", "pod"):
        with pytest.raises(ConfigError, match=r"host_label: .* is a label hfsampler sets itself"):
            from_mapping({"host_label": name})


def test_label_values_must_be_utf8() -> None:
    bad = "node\udcff"  # what Python makes of a non-UTF-8 byte in argv
    with pytest.raises(ConfigError, match="instance: is not valid UTF-8"):
        from_mapping({"instance": bad})
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        parse_label(f"site={bad}")
    with pytest.raises(ConfigError, match="instance"):
        from_mapping({"instance": "a\rb"})


def test_label_warnings_name_mimirs_limits() -> None:
    assert from_mapping({"external_labels": {"cluster": "a"}}).label_warnings() == []
    many = {f"l{i}": "x" for i in range(22)}
    (warning,) = from_mapping({"external_labels": many}).label_warnings()
    assert "Mimir refuses more than 30" in warning
    assert "max_label_names_per_series" in warning
    long = from_mapping({"external_labels": {"note": "x" * 3000}}).label_warnings()
    assert long == [
        "external_labels.note is 3000 bytes; Mimir refuses values over 2048 "
        "(max_label_value_length)"
    ]


def test_check_config_warns_of_an_external_label_hfsampler_sets_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``external_labels: {gpu: x}`` passed as OK; the series' own label wins, so say so."""
    path = tmp_path / "c.yml"
    path.write_text("external_labels: {gpu: x, hostname: h, GPU_I_ID: '1', cluster: eu1}\n")
    assert main(["check-config", str(path)]) == 0
    warnings = [x for x in capsys.readouterr().out.splitlines() if "warning:" in x]
    assert [w.split(":")[1].strip() for w in warnings] == [
        "external_labels.GPU_I_ID",
        "external_labels.gpu",
        "external_labels.hostname",
    ]
    assert "a series' own label wins over an external one" in warnings[1]
    assert "hostname, host_label and instance" in warnings[2]
    own = from_mapping({"host_label": "node", "external_labels": {"node": "n"}})
    assert "external_labels.node" in own.label_warnings()[0]


def test_max_ring_bytes() -> None:
    assert Config().max_ring_bytes == 256 << 20
    assert from_mapping({"max_ring_bytes": "64MiB"}).max_ring_bytes == 64 << 20
    assert from_mapping({"max_ring_bytes": 2_000_000}).max_ring_bytes == 2_000_000
    with pytest.raises(ConfigError, match=r"^max_ring_bytes: 'lots' is not a size"):
        from_mapping({"max_ring_bytes": "lots"})
    with pytest.raises(ConfigError, match=r"^max_ring_bytes: 4096 bytes is too small"):
        from_mapping({"max_ring_bytes": "4KiB"})
    with pytest.raises(ConfigError, match=r"^max_ring_bytes: "):
        from_mapping({"max_ring_bytes": True})


@pytest.mark.parametrize("text", ["100us", "100µs", "0.1ms", "0.0001s"])
def test_the_shortest_interval_is_accepted_however_written(text: str) -> None:
    """100 * 1e-6 is a hair under 1e-4 in floating point: '100us' was refused, '0.1ms' not."""
    assert parse_duration("100us", "k") == 1e-4
    config = from_mapping({"intervals": {"fast": text}, "dcgm": {"interval": text}})
    assert config.intervals_s["fast"] == pytest.approx(1e-4)
    assert config.dcgm_interval_s == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match=r"^intervals.fast: shorter than 100us"):
        from_mapping({"intervals": {"fast": "99us"}})


def test_interval_flag_takes_100us() -> None:
    parser, _ = build_parser()
    args = parser.parse_args(["run", "--interval", "100us"])
    assert config_from_args(args).intervals_s["fast"] == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("window: 1s\nlisten: ':9400'\nwindow: 2s\n", r"window: given twice, at lines 1 and 3"),
        (
            "remote_write:\n  - url: http://a/api/v1/write\n    name: a\n    name: b\n",
            r"name: given twice, at lines 3 and 4",
        ),
        ("external_labels: {cluster: a, cluster: b}\n", r"cluster: given twice, on line 1"),
    ],
)
def test_duplicate_keys_are_refused(tmp_path: Path, yaml_text: str, message: str) -> None:
    """Prometheus refuses a repeated key; YAML loaders keep the last one without a word."""
    path = tmp_path / "c.yml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message} \(keep one\)$"):
        load_file(path)


def test_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("base: &b {cluster: a, site: x}\nexternal_labels: {<<: *b, cluster: c}\n")
    with pytest.raises(ConfigError, match=r"^base: unknown key"):  # not a duplicate
        load_file(path)
    path.write_text("external_labels: {<<: {cluster: a, site: x}, cluster: c}\n")
    assert load_file(path).external_labels == {"cluster": "c", "site": "x"}


def _endpoint(**keys: object) -> dict[str, object]:
    return {"remote_write": [{"url": "https://rx:9090/api/v1/write", **keys}]}


_SECRET_KEYS = [
    ("basic_auth.password_file", lambda f: {"basic_auth": {"username": "u", "password_file": f}}),
    ("authorization.credentials_file", lambda f: {"authorization": {"credentials_file": f}}),
    ("bearer_token_file", lambda f: {"bearer_token_file": f}),
    ("tls_config.ca_file", lambda f: {"tls_config": {"ca_file": f}}),
    ("tls_config.cert_file", lambda f: {"tls_config": {"cert_file": f, "key_file": f}}),
]


@pytest.mark.parametrize(("key", "block"), _SECRET_KEYS)
def test_files_named_by_remote_write_are_checked_at_load(
    tmp_path: Path, key: str, block: Any
) -> None:
    """A missing secret file passed check-config, then failed every send for good."""
    prefix = re.escape(f"remote_write[0].{key}: ")
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=rf"^{prefix}cannot read {missing}: No such file"):
        from_mapping(_endpoint(**block(str(missing))))
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ConfigError, match=rf"^{prefix}{empty} is empty \("):
        from_mapping(_endpoint(**block(str(empty))))
    with pytest.raises(ConfigError, match=rf"^{prefix}{tmp_path} is not a regular file \("):
        from_mapping(_endpoint(**block(str(tmp_path))))


@pytest.mark.parametrize(("key", "block"), _SECRET_KEYS[:3])
def test_a_secret_file_is_never_shown(tmp_path: Path, key: str, block: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cr3t-\xff\n")
    with pytest.raises(ConfigError) as caught:
        from_mapping(_endpoint(**block(str(secret))))
    assert str(caught.value).startswith(f"remote_write[0].{key}: {secret} is not UTF-8 text")
    assert "s3cr3t" not in str(caught.value)
    secret.write_text("s3cr3t\n")
    (endpoint,) = from_mapping(_endpoint(**block(str(secret)))).remote_write
    assert endpoint.auth is not None
    assert endpoint.auth.secret_file == str(secret)


def test_check_config_names_a_missing_password_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yml"
    path.write_text(
        "remote_write:\n  - url: https://rx/api/v1/write\n"
        "    basic_auth: {username: u, password_file: /nonexistent/pw}\n"
    )
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hfsampler: error: remote_write[0].basic_auth.password_file: cannot read "
        "/nonexistent/pw: No such file or directory (check the path and permissions)"
    ]


def test_a_field_group_without_an_interval_is_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``field_groups`` naming a group that ``intervals`` lacks: exit 2 in every command."""
    path = tmp_path / "c.yml"
    path.write_text("field_groups: {DCGM_FI_DEV_GPU_TEMP: medium}\n")
    message = "field_groups.DCGM_FI_DEV_GPU_TEMP: unknown group 'medium' (one of fast, slow, gpm)"
    for argv in (
        ["check-config", str(path)],
        ["run", "--config", str(path), "--source", "sim"],
        ["record", "--config", str(path), "--source", "sim", "--", "true"],
        ["probe", "--config", str(path), "--source", "sim"],
    ):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip() == f"hfsampler: error: {message}", argv
    path.write_text("intervals: {medium: 10ms}\nfield_groups: {DCGM_FI_DEV_GPU_TEMP: medium}\n")
    assert load_file(path).intervals_s["medium"] == pytest.approx(0.01)


@pytest.mark.parametrize("fields", [None, ("gpm",), ("DCGM_FI_PROF_SM_ACTIVE", "gpu_temp")])
def test_a_selected_field_whose_group_has_no_interval_is_refused(
    fields: tuple[str, ...] | None,
) -> None:
    """Intervals without the gpm group (record's own, before): refused naming field, group and
    fix, never the gpm fields dropped in silence."""
    with pytest.raises(ConfigError) as caught:
        Config(intervals_s={"fast": 0.001, "slow": 0.1}, fields=fields)
    text = str(caught.value)
    assert text.startswith("intervals.gpm: not given, yet DCGM_FI_PROF_")
    assert "(group gpm) is selected" in text
    assert text.endswith("(add intervals.gpm, move the field with field_groups, or leave it out "
                         "of fields)")  # fmt: skip
    # fine: a selection of only the groups that have intervals, or the fields moved to one
    Config(intervals_s={"fast": 0.001, "slow": 0.1}, fields=("fast", "slow"))
    Config(
        intervals_s={"fast": 0.001, "slow": 0.1},
        fields=fields,
        field_groups={f.name: "slow" for f in catalogue.CATALOGUE if f.group == "gpm"},
    )


def test_plan_groups_refuses_a_field_without_an_interval() -> None:
    from hfsampler.sampling.groups import plan_groups

    temp = catalogue.BY_NAME["DCGM_FI_DEV_GPU_TEMP"]
    with pytest.raises(ConfigError, match=r"^intervals.slow: not given, yet DCGM_FI_DEV_GPU_TEMP"):
        plan_groups([temp], {"fast": 0.001})
    assert [g.name for g in plan_groups([temp], {"fast": 0.001, "slow": 0.1})] == ["slow"]


def test_a_per_link_nvlink_field_is_refused_on_the_fastest_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fastest group is the real-time lane's: a per-link field (which asks each link's state
    once a second) moved there is a one-line error naming it; a group between is fine."""
    name = "DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"
    path = tmp_path / "c.yml"
    path.write_text(f"fields: [all]\nfield_groups: {{{name}: fast}}\n")
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hfsampler: error: field_groups.{name}: group fast is the fastest, the real-time lane's "
        "(leave per-link NVLink fields in slow, or a group slower than the fastest)"
    )
    path.write_text(f"intervals: {{fast: 1ms, mid: 10ms, slow: 100ms, gpm: 100ms}}\n"
                    f"fields: [all]\nfield_groups: {{{name}: mid}}\n")  # fmt: skip
    assert next(f for f in load_file(path).selected_fields() if f.name == name).group == "mid"


def test_a_group_as_fast_as_the_lane_but_not_on_it_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the fastest group has the real-time lane: a 1 ms slow group is said at check."""
    path = tmp_path / "c.yml"
    path.write_text("intervals: {fast: 1ms, slow: 1ms, gpm: 100ms}\n")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "warning:" in x]
    assert "intervals.slow: 1 ms runs on the sampler's second thread" in line
    assert "fastest group, fast" in line
    assert from_mapping({"intervals": {"fast": "1ms", "slow": "10ms"}}).lane_warnings() == []
    assert from_mapping({"intervals": {"fast": "100ms", "slow": "100ms"}}).lane_warnings() == []


def test_dcgm_exporter_defaults_host_label_and_count_windows() -> None:
    """The host label as dcgm-exporter 4.8.3 and newer spell it; its 5 m count windows."""
    c = from_mapping({})
    assert c.host_label == "hostname"
    assert (c.xid_count_window_s, c.clock_events_count_window_s) == (300.0, 300.0)
    assert from_mapping({"host_label": "Hostname"}).host_label == "Hostname"
    assert from_mapping({"clock_events_count_window": "30s"}).clock_events_count_window_s == 30.0
    with pytest.raises(ConfigError, match=r"xid_count_window: 0s is out of range"):
        from_mapping({"xid_count_window": "0s"})
    counted = from_mapping({"fields": ["DCGM_EXP_XID_ERRORS_COUNT"]})
    assert [f.name for f in counted.counted_fields()] == ["DCGM_EXP_XID_ERRORS_COUNT"]
    assert {f.name for f in counted.selected_fields()} == {
        "DCGM_FI_DEV_XID_ERRORS",
        "hfsampler_xid_events_total",
    }


@pytest.mark.parametrize(("value", "seconds"), [("100us", "0.0001"), ("1500us", "0.0015"),
                                                 ("0s", "0"), ("25h", "90000")])  # fmt: skip
def test_a_count_window_its_label_cannot_say_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, seconds: str
) -> None:
    # the series carry the window as window_size_in_ms, whole milliseconds: 100us would read 0
    config = tmp_path / "hfsampler.yml"
    config.write_text(f"clock_events_count_window: {value}\n")
    assert main(["check-config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f"hfsampler: error: clock_events_count_window: {seconds}s is out of range (use whole ms "
        "from 1ms to 24h; dcgm-exporter's is 5m)\n"
    )
    config.write_text("xid_count_window: 1ms\n")
    assert main(["check-config", str(config)]) == 0

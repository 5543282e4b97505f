"""One declaration per key: the loader, flags, reload and reference all read it; the file's
harder cases (nesting, sizes, raw label values, a pasted Prometheus config) as one line each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hfsampler import fields as catalogue
from hfsampler.cli.main import main
from hfsampler.config.flags import FLAGGED
from hfsampler.config.loader import PASTED_KEYS, from_mapping, load_file
from hfsampler.config.reference import reference_markdown
from hfsampler.config.reload import RESTART_KEYS
from hfsampler.config.settings import KEYS, Config
from hfsampler.errors import ConfigError
from hfsampler.remote_write.config import parse_size
from hfsampler.remote_write.keys import ENDPOINT_KEYS, QUEUE_KEYS
from hfsampler.sampling.groups import plan_groups


def test_every_config_field_is_a_declared_key() -> None:
    assert [k.field for k in KEYS] == [f.name for f in dataclasses.fields(Config)]
    yaml_names = [n for k in KEYS for n in (k.yaml, *k.also) if n]
    assert len(yaml_names) == len(set(yaml_names))
    assert all(k.doc and "\n" not in k.doc for k in KEYS)


def test_the_defaults_are_the_declarations() -> None:
    config = Config()
    assert all(getattr(config, k.field) == k.default for k in KEYS)


def test_flags_and_reload_come_from_the_declarations() -> None:
    assert {k.field: f.name for f, k in FLAGGED}["sim_gpus"] == "--gpus"
    assert "window_s" in RESTART_KEYS
    assert "log_level" not in RESTART_KEYS


def test_the_reference_names_every_key_with_its_flag_and_default() -> None:
    text = reference_markdown()
    lines = text.splitlines()
    assert lines[0] == "| Key | Type | Default | Flag | Meaning |"
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[2:])
    for k in (*KEYS, *PASTED_KEYS):
        assert k.yaml is None or f"`{k.yaml}`" in text
    for name in (*ENDPOINT_KEYS, *QUEUE_KEYS):
        assert name in text
    assert "| `window` | duration | 1s | `--window` |" in text
    assert "| `max_ring_bytes` | size | 256MiB |  |" in text
    assert "`remote_write[].follow_redirects`" in text
    assert "`dcgm.interval`" in text
    assert "`jetson.sysfs_root`" in text


def test_yaml_nested_a_thousand_deep_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep.yml"
    path.write_text("fields: " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_file(path)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("10TiB", 10 << 40),
        ("10Ti", 10 << 40),
        ("2Gi", 2 << 30),
        ("512Mi", 512 << 20),
        ("64Ki", 64 << 10),
        ("64KiB", 64 << 10),
        ("1T", 10**12),
        ("1TB", 10**12),
        ("2G", 2 * 10**9),
        ("3M", 3 * 10**6),
        ("5K", 5000),
        ("5k", 5000),
        ("5KB", 5000),
        ("1.5GiB", 3 << 29),
        ("100", 100),
        ("100B", 100),
    ],
)
def test_sizes_as_prometheus_and_kubernetes_users_write_them(text: str, size: int) -> None:
    assert parse_size(text, "max_ring_bytes") == size


def test_max_ring_bytes_takes_tib_and_refuses_past_the_maximum_naming_it() -> None:
    assert from_mapping({"max_ring_bytes": "10TiB"}).max_ring_bytes == 10 << 40
    with pytest.raises(
        ConfigError, match=r"^max_ring_bytes: '2048TiB' is more than the most, 1PiB"
    ):
        from_mapping({"max_ring_bytes": "2048TiB"})


def test_check_config_escapes_a_label_value_with_a_newline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yml"
    path.write_text('external_labels: {cluster: "eu1\\nforged: line"}\n')
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  external labels: cluster=eu1\\nforged: line\n" in out
    assert "\nforged" not in out


def test_a_pasted_prometheus_config_with_global_timing_loads() -> None:
    config = from_mapping(
        {
            "global": {
                "scrape_interval": "15s",
                "evaluation_interval": "1m",
                "external_labels": {"cluster": "eu1"},
            },
            "remote_write": [{"url": "http://a/", "send_exemplars": False}],
        }
    )
    assert config.external_labels == {"cluster": "eu1"}
    assert config.window_s == Config().window_s  # Prometheus's timing sets none of hfsampler's
    with pytest.raises(ConfigError, match=r"^global.scrape_interval: '15' is not a duration"):
        from_mapping({"global": {"scrape_interval": "15"}})


def test_unknown_keys_of_the_file_and_its_remote_write_in_one_message() -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(
            {"windw": "1s", "dcgm": {"hots": "x"}, "remote_write": [{"url": "http://a/", "x": 1}]}
        )
    text = str(info.value)
    assert text.startswith("3 keys to fix: windw: unknown key (did you mean 'window'?); ")
    assert "dcgm.hots: unknown key (did you mean 'host'?)" in text
    assert "remote_write[0].x: is not a known key" in text


# -- the lane rule, once ----------------------------------------------------------------------


FB_USED = catalogue.BY_NAME["DCGM_FI_DEV_FB_USED"]


def test_a_mig_twin_leaves_the_real_time_lane_whichever_group_has_it() -> None:
    """With an unused faster group, the lane is the fastest group that has fields: its twins
    go to the slow lane, as plan_groups and the config's checks see it."""
    intervals = {"fast": 0.0005, "medium": 0.001, "slow": 0.1}
    medium = dataclasses.replace(FB_USED, group="medium")
    twin = catalogue.expand_mig([medium], intervals)[-1]
    assert twin.mig_instance
    assert twin.group == "slow"
    assert plan_groups([medium, twin], intervals)[0].name == "medium"


def test_the_lane_is_the_first_of_equally_fast_groups_everywhere() -> None:
    intervals = {"a": 0.001, "b": 0.001, "slow": 0.1}
    fa = dataclasses.replace(FB_USED, group="a")
    fb = dataclasses.replace(FB_USED, group="b", name="DCGM_FI_DEV_FB_FREE")
    assert catalogue.realtime_group([fb, fa], intervals) == "a"
    assert [g.name for g in plan_groups([fb, fa], intervals)] == ["a", "b"]
    twins = catalogue.expand_mig([fa, fb], intervals)[2:]
    assert [t.group for t in twins] == ["slow", "b"]  # b is on the slow lane already


def test_the_source_settings_are_the_keys_that_declare_them() -> None:
    from hfsampler.sampling.resolve import resolve_source
    from hfsampler.sources.base import SourceSpec

    spec = resolve_source(Config(source="sim", sim_gpus=3, seed=7, devices=(1,), dcgm_host="h"))
    assert (spec.kind, spec.gpus, spec.seed, spec.indices, spec.dcgm_host) == (
        "sim", 3, 7, (1,), "h"
    )  # fmt: skip
    own = {"kind", "jetson_root", "reopened", "sim_read_cost_s"}  # not a key's value as it is
    spec_fields = {f.name for f in dataclasses.fields(SourceSpec)}
    assert {k.spec for k in KEYS if k.spec} == spec_fields - own

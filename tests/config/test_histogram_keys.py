"""``histograms`` and ``histogram_relative_error``: what they select, and every mistake one line,
exit 2, naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import hfsampler

from hfsampler.config.reload import plan_reload
from hfsampler.config.settings import Config
from hfsampler.errors import ConfigError


def _check(tmp_path: Path, text: str) -> tuple[int, str, str]:
    path = tmp_path / "c.yml"
    path.write_text("source: sim\n" + text)
    done = hfsampler("check-config", str(path))
    return done.returncode, done.stdout, done.stderr


def test_none_by_default_and_a_name_as_fields_takes_it() -> None:
    assert Config().histogram_fields() == ()
    picked = Config(histograms=("power_usage", "DCGM_FI_DEV_GPU_TEMP"))
    assert {f.name for f in picked.histogram_fields()} == {
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP",
    }


def test_a_group_is_its_sampled_gauges() -> None:
    fast = Config(histograms=("fast",)).histogram_fields()
    assert "DCGM_FI_DEV_POWER_USAGE_INSTANT" in {f.name for f in fast}
    assert all(f.kind.value == "gauge" for f in fast)  # its counters are left out, not refused
    narrow = Config(fields=("POWER_USAGE", "TOTAL_ENERGY_CONSUMPTION"), histograms=("all",))
    assert [f.name for f in narrow.histogram_fields()] == ["DCGM_FI_DEV_POWER_USAGE"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("histograms: [TOTAL_ENERGY_CONSUMPTION]\n", "is a counter"),
        ("histograms: [nope]\n", "unknown field 'nope'"),
        # the field named, not the first of those it requires
        ("histograms: [DCGM_EXP_XID_ERRORS_TOTAL]\n", "DCGM_EXP_XID_ERRORS_TOTAL is a counter"),
        ("fields: [POWER_USAGE]\nhistograms: [GPU_TEMP]\n", "DCGM_FI_DEV_GPU_TEMP is not sampled"),
        ("histograms: [POWER_USAGE]\nhistogram_relative_error: 0\n", "out of range"),
        ("histograms: [POWER_USAGE]\nhistogram_relative_error: 5%\n", "expected a number"),
        # finer than schema 8 can count: refused, not quietly given 0.135% instead
        ("histograms: [POWER_USAGE]\nhistogram_relative_error: 1.0e-9\n", "give 0.00136 or more"),
        ("histograms: [POWER_USAGE]\nhistogram_relative_error: 0.001\n", "finer than"),
        ("histograms: [POWER_USAGE]\nhistogram_relative_error: 1e308\n", "out of range"),
        ("histograms: [POWER_USAGE]\nhistogram_relative_error: .nan\n", "out of range"),
    ],
)
def test_a_mistake_is_one_line_naming_the_key_exit_2(tmp_path: Path, text: str, says: str) -> None:
    status, _, err = _check(tmp_path, text)
    assert status == 2
    assert err.count("\n") == 1
    assert "histogram" in err.split(":")[2]  # "hfsampler: error: histograms...: ..."
    assert says in err


def test_check_config_says_the_schema_the_error_gives(tmp_path: Path) -> None:
    status, out, _ = _check(tmp_path, "histograms: [POWER_USAGE]\n")
    assert status == 0
    assert (
        "histograms: DCGM_FI_DEV_POWER_USAGE; schema 3: buckets 9.05% wide, a bucket's centre "
        "within 4.33% of its values" in out
    )
    _, fine, _ = _check(tmp_path, "histograms: [POWER_USAGE]\nhistogram_relative_error: 0.01\n")
    assert "schema 6: buckets 1.09% wide" in fine
    _, none, _ = _check(tmp_path, "")
    assert "histograms" not in none


def test_a_reload_takes_them_and_rebuilds_the_model() -> None:
    old = Config(histograms=("POWER_USAGE",))
    plan = plan_reload(old, Config(histograms=("POWER_USAGE", "GPU_TEMP")))
    assert plan.labels_changed
    assert not plan.needs_restart
    assert plan.config.histograms == ("POWER_USAGE", "GPU_TEMP")
    with pytest.raises(ConfigError, match="histogram_relative_error"):
        Config(histogram_relative_error=1.5)


@pytest.mark.parametrize(("written", "schema"), [("1e-2", 6), ("5e-2", 3), ("2e-1", 1)])
def test_an_error_in_exponent_form_is_a_number_as_prometheus_reads_it(
    tmp_path: Path, written: str, schema: int
) -> None:
    """PyYAML reads ``1e-2`` as text (YAML 1.1 wants a dot and a signed exponent); Go's YAML,
    Prometheus's, reads a number, and so does this key."""
    status, out, err = _check(
        tmp_path, f"histograms: [POWER_USAGE]\nhistogram_relative_error: {written}\n"
    )
    assert (status, err) == (0, "")
    assert f"schema {schema}:" in out


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # asked to send histograms, none counted: the operator sees no histogram and no word
        (
            "remote_write:\n  - url: http://127.0.0.1:9/api/v1/write\n"
            "    send_native_histograms: true\n",
            "warning: remote_write[0].send_native_histograms is not used",
        ),
        # counted every window for nothing: no /metrics, no endpoint taking them
        (
            'listen: ""\nhistograms: [POWER_USAGE]\n'
            "remote_write:\n  - url: http://127.0.0.1:9/api/v1/write\n",
            "warning: histograms are counted but go nowhere",
        ),
    ],
)
def test_histogram_keys_that_would_do_nothing_are_said(
    tmp_path: Path, text: str, says: str
) -> None:
    status, out, _ = _check(tmp_path, text)
    assert status == 0
    assert says in out


def test_histograms_that_go_somewhere_are_not_warned_of(tmp_path: Path) -> None:
    served = _check(tmp_path, "histograms: [POWER_USAGE]\n")[1]  # /metrics on the default listen
    sent = _check(
        tmp_path,
        'listen: ""\nhistograms: [POWER_USAGE]\nremote_write:\n'
        "  - url: http://127.0.0.1:9/api/v1/write\n    send_native_histograms: true\n",
    )[1]
    assert "warning" not in served + sent

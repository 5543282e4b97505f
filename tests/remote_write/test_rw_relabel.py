"""write_relabel_configs: Prometheus's actions, defaults, anchoring and Go template expansion."""

from __future__ import annotations

import pytest
import yaml

from hfsampler.errors import ConfigError
from hfsampler.remote_write.config import parse_remote_write
from hfsampler.remote_write.relabel import apply, parse_rules

LABELS = {
    "__name__": "DCGM_FI_DEV_POWER_USAGE_max",
    "gpu": "3",
    "UUID": "GPU-abc",
    "Hostname": "n1",
}


def run(rules_yaml: str, labels: dict[str, str] | None = None) -> dict[str, str] | None:
    rules = parse_rules(yaml.safe_load(rules_yaml), "write_relabel_configs")
    return apply(rules, dict(labels or LABELS))


def test_keep_and_drop_are_anchored() -> None:
    assert run("[{source_labels: [__name__], regex: '.*_max', action: keep}]") == LABELS
    # Anchored: '_max' alone does not match the whole name.
    assert run("[{source_labels: [__name__], regex: '_max', action: keep}]") is None
    assert run("[{source_labels: [__name__], regex: 'DCGM.*', action: drop}]") is None
    assert run("[{source_labels: [gpu], regex: '3|4', action: drop}]") is None
    assert run("[{source_labels: [gpu], regex: '3|4', action: keep}]") == LABELS


def test_replace_defaults_and_templates() -> None:
    out = run("[{source_labels: [UUID, gpu], regex: 'GPU-(\\w+);(.*)', target_label: id, "
              "replacement: '${1}_$2'}]")  # fmt: skip
    assert out is not None
    assert out["id"] == "abc_3"
    # Default regex (.*) and replacement $1: copies the joined source labels.
    out = run("[{source_labels: [gpu, Hostname], target_label: where}]")
    assert out is not None
    assert out["where"] == "3;n1"
    # No match: nothing changes. An empty result deletes the target.
    assert run("[{source_labels: [gpu], regex: 'x', target_label: gpu, replacement: y}]") == LABELS
    out = run("[{source_labels: [nope], target_label: Hostname}]")
    assert out is not None
    assert "Hostname" not in out
    # Go's $1x is the group named '1x' (unknown: empty), not $1 followed by x.
    out = run("[{source_labels: [gpu], regex: '(.*)', target_label: t, replacement: '$1x-$$'}]")
    assert out is not None
    assert out["t"] == "-$"


def test_label_actions() -> None:
    out = run("[{regex: 'UUID|Hostname', action: labeldrop}]")
    assert out == {"__name__": LABELS["__name__"], "gpu": "3"}
    out = run("[{regex: '__name__|gpu', action: labelkeep}]")
    assert out == {"__name__": LABELS["__name__"], "gpu": "3"}
    out = run("[{regex: 'U(.*)', action: labelmap, replacement: 'gpu_${1}'}]")
    assert out is not None
    assert out["gpu_UID"] == "GPU-abc"
    assert out["UUID"] == "GPU-abc"


def test_renaming_the_metric_and_losing_it() -> None:
    out = run("[{source_labels: [__name__], regex: '(.*)_max', target_label: __name__, "
              "replacement: 'peak_$1'}]")  # fmt: skip
    assert out is not None
    assert out["__name__"] == "peak_DCGM_FI_DEV_POWER_USAGE"
    assert run("[{regex: '__name__', action: labeldrop}]") is None


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("{action: hashmod, modulus: 2}", "must be a label name for action hashmod"),
        ("{action: hashmod, target_label: s}", "is required for hashmod"),
        ("{action: hashmod, target_label: s, modulus: 0}", "is required for hashmod"),
        ("{action: hashmod, target_label: s, modulus: '4'}", "must be a whole number"),
        ("{action: keep, source_labels: [a], modulus: 4}", "applies to hashmod only"),
        ("{action: keep, source_labels: [a], modulo: 4}", "not a known key"),
        ("{action: explode}", "unknown action"),
        ("{source_labels: [a], regex: '(?=x)', action: keep}", "RE2"),
        ("{source_labels: [a], regex: '(a)\\1', action: keep}", "RE2"),
        ("{source_labels: [a], regex: '(', action: keep}", "not a valid regex"),
        ("{action: replace}", "target_label: is required"),
        ("{action: keep}", "source_labels: is required"),
        ("{action: labeldrop, regex: x, target_label: y}", "takes only regex"),
        ("{source_labels: ['1bad'], action: keep}", "not a valid label name"),
        ("[not, a, mapping]", "must be a mapping"),
    ],
)
def test_bad_rules_name_the_key(rule: str, message: str) -> None:
    text = f"- url: http://a/\n  write_relabel_configs: [{rule}]\n"
    with pytest.raises(ConfigError, match=r"remote_write\[0\]\.write_relabel_configs\[0\]") as e:
        parse_remote_write(yaml.safe_load(text))
    assert message in str(e.value)


def test_hashmod_shards_series_by_source_labels() -> None:
    rule = "[{source_labels: [Hostname, gpu], target_label: shard, modulus: 4, action: hashmod}]"
    out = run(rule)
    assert out is not None
    assert out["shard"] in {"0", "1", "2", "3"}
    assert run(rule) == out  # deterministic
    # Every label set keeps its shard; sets spread over all of them.
    shards = set()
    for host in range(64):
        got = run(rule, {**LABELS, "Hostname": f"node{host}"})
        assert got is not None
        shards.add(got["shard"])
    assert shards == {"0", "1", "2", "3"}
    # Keep one shard: the fleet pattern, each receiver taking series whose shard is its own.
    keep = rule[:-1] + ", {source_labels: [shard], regex: '2', action: keep}]"
    kept = [run(keep, {**LABELS, "Hostname": f"node{h}"}) for h in range(64)]
    assert 0 < sum(k is not None for k in kept) < 64


def test_relabeller_forgets_ended_series() -> None:
    """Pod churn: each ended series' cache entry goes with its stale marker."""
    from hfsampler.remote_write.relabel import Relabeller
    from hfsampler.series import SeriesRegistry

    relabeller = Relabeller(
        parse_rules(yaml.safe_load("[{target_label: dc, replacement: x}]"), "r")
    )
    reg = SeriesRegistry()
    for pod in range(100):
        s = reg.series("DCGM_FI_DEV_FB_USED", {"gpu": "0", "pod": f"p{pod}"})
        out = relabeller.series(s)
        assert out is not None
        assert dict(out.labels)["dc"] == "x"
        relabeller.forget(s)
    assert len(relabeller) == 0

"""The consumer keys: `consumers` (a mode, or a block whose `enabled` is the same key),
`procfs`, `container_runtime_socket` and the `consumers.*` block; each mistake one line naming
the key and the fix, exit 2; what a reload does with each."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfsampler.cli.main import main
from hfsampler.config.consumer_keys import enabled
from hfsampler.config.loader import from_mapping
from hfsampler.config.reload import plan_reload


@pytest.mark.parametrize(
    ("data", "mode", "max_per_gpu"),
    [
        ({}, "auto", 16),
        ({"consumers": False}, "off", 16),
        ({"consumers": True}, "on", 16),
        ({"consumers": "auto"}, "auto", 16),
        ({"consumers": {"enabled": False, "max_per_gpu": 4}}, "off", 4),
        ({"consumers": {"max_per_gpu": 8}}, "auto", 8),
    ],
)
def test_consumers_is_a_mode_or_a_block(
    data: dict[str, object], mode: str, max_per_gpu: int
) -> None:
    config = from_mapping(data)
    assert config.consumers == mode
    assert config.consumers_max_per_gpu == max_per_gpu


def test_auto_reads_consumers_where_nvml_lists_processes() -> None:
    assert enabled("auto", "nvml")
    assert not enabled("auto", "sim")
    assert not enabled("auto", "jetson")
    assert enabled("on", "sim")
    assert not enabled("off", "nvml")


def test_a_procfs_that_is_a_file_is_one_line_naming_it_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "hfsampler.yml"
    config.write_text(f"procfs: {config}\n")
    assert main(["check-config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f"hfsampler: error: procfs: '{config}' is not a directory (e.g. /proc, or /host/proc in "
        "a pod)\n"
    )
    config.write_text(f"procfs: {tmp_path / 'not-mounted-here'}\n")  # a DaemonSet's, checked here
    assert main(["check-config", str(config)]) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("consumers: 3\n", "consumers: expected auto, true or false, got 3 (e.g. consumers: auto)"),
        ("consumers: {max_per_gpu: 0}\n",
         "consumers.max_per_gpu: 0 is out of range (give 1 to 1024)"),
        ("consumers: {max_per_gpu: 5000}\n",
         "consumers.max_per_gpu: 5000 is out of range (give 1 to 1024)"),
        ("consumers: {pod_label_allowlist: 'team['}\n",
         "consumers.pod_label_allowlist: 'team[' is not a regex: unterminated character set at "
         "position 4 (a Python regex over label keys)"),
        # a tenant's label key of 63 "a" and a "-" would hold the GIL for days
        ("consumers: {pod_label_allowlist: '(a+)+$'}\n",
         "consumers.pod_label_allowlist: '(a+)+$' could take far too long on a pod's label key: "
         "a repeat of a repeat or of alternatives (e.g. (a+)+ or (a|b)*) (list keys or prefixes "
         "without nested repeats, e.g. team|app|example\\.com/.*)"),
        ("procfs: host/proc\n",
         "procfs: 'host/proc' is not an absolute path (e.g. /proc, or /host/proc in a pod)"),
        ("container_runtime_socket: containerd.sock\n",
         "container_runtime_socket: 'containerd.sock' is not an absolute path (e.g. "
         "/run/containerd/containerd.sock)"),
        ("consumers: {max_per_gpu: 4, bogus: 1}\n",
         "consumers.bogus: unknown key (known keys: enabled, max_per_gpu, pod_label_allowlist, "
         "dcgm_exporter_virtual_gpus)"),
    ],
)  # fmt: skip
def test_a_bad_consumer_key_is_one_line_naming_it_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    config = tmp_path / "hfsampler.yml"
    config.write_text(text)
    assert main(["check-config", str(config)]) == 2
    assert capsys.readouterr().err == f"hfsampler: error: {message}\n"


def test_pod_keys_without_the_runtime_s_socket_are_said_to_do_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "hfsampler.yml"
    config.write_text("consumers: {pod_label_allowlist: team, dcgm_exporter_virtual_gpus: true}\n")
    assert main(["check-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "warning: consumers.pod_label_allowlist is not used: container_runtime_socket" in out
    assert "warning: consumers.dcgm_exporter_virtual_gpus is not used" in out
    config.write_text(
        "consumers: {pod_label_allowlist: team, dcgm_exporter_virtual_gpus: true}\n"
        "container_runtime_socket: /run/containerd/containerd.sock\n"
    )
    assert main(["check-config", str(config)]) == 0
    assert "is not used" not in capsys.readouterr().out


def test_a_reload_rebuilds_the_consumer_series_and_restarts_for_the_reading() -> None:
    old = from_mapping({})
    plan = plan_reload(old, from_mapping({"consumers": {"max_per_gpu": 4}}))
    assert plan.labels_changed
    assert plan.config.consumers_max_per_gpu == 4
    assert not plan.needs_restart
    plan = plan_reload(old, from_mapping({"consumers": False, "procfs": "/host/proc"}))
    assert set(plan.needs_restart) == {"consumers", "procfs"}
    assert plan.config.consumers == "auto"  # the running value stays until a restart

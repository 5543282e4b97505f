"""Pod, namespace and container names from a fake container runtime's CRI socket: cached, bounded
in time, failures said once with the last names kept; pod labels through an allowlist."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import procfs_trees as t
import pytest

grpc = pytest.importorskip("grpc", reason="pip install 'hfsampler[k8s]' for the CRI client")

from fake_cri import FakeContainer, FakeRuntime, FakeSandbox, fake_runtime  # noqa: E402

from hfsampler.consumers import cri  # noqa: E402
from hfsampler.consumers.cri import CriNames  # noqa: E402
from hfsampler.consumers.cri_pb import cri_pb2 as pb  # noqa: E402
from hfsampler.consumers.identity import (  # noqa: E402
    MAX_VALUE_CHARS,
    Consumer,
    Kind,
    label_value,
    sanitize_label_name,
)
from hfsampler.errors import ConfigError  # noqa: E402

__all__ = ["fake_runtime"]  # fixtures

ROOT = Path(__file__).resolve().parents[2]
POD = Consumer(Kind.POD, pod_uid=t.POD_UID, container_id=t.CONTAINER_ID)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _node(runtime: FakeRuntime) -> None:
    runtime.sandboxes = [
        FakeSandbox("sb-old", t.POD_UID, "trainer-0", "ml", ready=False, attempt=0),
        FakeSandbox("sb-1", t.POD_UID, "trainer-0", "ml", attempt=1, labels={
            "app.kubernetes.io/name": "trainer", "team": "vision", "pod-template-hash": "abc",
            "io.kubernetes.pod.uid": t.POD_UID, "9lives": "cat", "pod": "clash"}),
        FakeSandbox("sb-2", t.POD_UID_2, "infer-7", "serving"),
    ]  # fmt: skip
    runtime.containers = [
        FakeContainer(t.CONTAINER_ID, "sb-1", "train"),
        FakeContainer(t.CONTAINER_ID_2, "sb-2", "server"),
    ]


def test_names_and_allowed_pod_labels(fake_runtime: FakeRuntime) -> None:
    _node(fake_runtime)
    names = CriNames(str(fake_runtime.path), r"app\.kubernetes\.io/.*|team|9lives|pod")
    try:
        assert names.refresh_if_due()
        assert names.labels(POD) == {
            "pod_uid": t.POD_UID, "container_id": t.CONTAINER_ID,
            "pod": "trainer-0", "namespace": "ml", "container": "train",
            "app_kubernetes_io_name": "trainer", "team": "vision", "_9lives": "cat",
        }  # fmt: skip
        # a container the cgroup named without its pod: the runtime says which pod
        bare = Consumer(Kind.CONTAINER, container_id=t.CONTAINER_ID_2)
        assert names.labels(bare)["pod"] == "infer-7"
        assert names.labels(bare)["container"] == "server"
        # other consumers are as they are
        job = Consumer(Kind.HPC_JOB, hpc_job="9")
        assert names.labels(job) == {"hpc_job": "9"}
    finally:
        names.close()


def test_no_allowlist_no_pod_labels(fake_runtime: FakeRuntime) -> None:
    _node(fake_runtime)
    names = CriNames(str(fake_runtime.path))
    try:
        names.refresh_if_due()
        assert set(names.labels(POD)) == {"pod_uid", "container_id", "pod", "namespace",
                                          "container"}  # fmt: skip
    finally:
        names.close()


def test_refreshed_at_most_every_refresh_s(fake_runtime: FakeRuntime) -> None:
    _node(fake_runtime)
    clock = Clock()
    names = CriNames(str(fake_runtime.path), refresh_s=5.0, clock=clock)
    try:
        assert names.refresh_if_due()
        fake_runtime.sandboxes[2].name = "infer-8"
        clock.now += 4.9
        assert not names.refresh_if_due()
        assert fake_runtime.calls["ListPodSandbox"] == 1
        other = Consumer(Kind.POD, pod_uid=t.POD_UID_2, container_id=t.CONTAINER_ID_2)
        assert names.labels(other)["pod"] == "infer-7"
        clock.now += 0.2
        assert names.refresh_if_due()
        assert names.labels(other)["pod"] == "infer-8"
    finally:
        names.close()


def test_runtime_refusing_keeps_the_last_names_and_says_once(
    fake_runtime: FakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    _node(fake_runtime)
    clock = Clock()
    names = CriNames(str(fake_runtime.path), refresh_s=1.0, clock=clock)
    try:
        names.refresh_if_due()
        fake_runtime.fail_with = grpc.StatusCode.PERMISSION_DENIED
        with caplog.at_level(logging.INFO, "hfsampler.consumers.cri"):
            for _ in range(3):
                clock.now += 1.0
                assert not names.refresh_if_due()
            assert names.labels(POD)["pod"] == "trainer-0"
            fake_runtime.fail_with = None
            clock.now += 1.0
            assert names.refresh_if_due()
        said = [r.getMessage() for r in caplog.records]
        assert sum("keeping the names last known" in m for m in said) == 1
        assert sum("answers again" in m for m in said) == 1
    finally:
        names.close()


def test_slow_runtime_costs_at_most_the_timeout(fake_runtime: FakeRuntime) -> None:
    _node(fake_runtime)
    fake_runtime.delay_s = 5.0
    names = CriNames(str(fake_runtime.path), timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert not names.refresh_if_due()
        assert time.monotonic() - t0 < 1.5
        assert names.labels(POD) == POD.labels()
    finally:
        names.close()


def test_an_answer_larger_than_the_kubelet_takes_is_refused_keeping_the_last_names(
    fake_runtime: FakeRuntime,
) -> None:
    # the kubelet refuses a CRI answer over 16 MiB; one that large is no runtime's to trust, and
    # would cost memory and seconds of the GIL to read
    _node(fake_runtime)
    clock = Clock()
    names = CriNames(str(fake_runtime.path), refresh_s=1.0, clock=clock, timeout_s=10.0)
    try:
        assert names.refresh_if_due()
        fake_runtime.sandboxes[1].labels["huge"] = "x" * (cri.MAX_MESSAGE_BYTES + 1)
        clock.now += 1.0
        assert not names.refresh_if_due()
        assert names.labels(POD)["pod"] == "trainer-0"
    finally:
        names.close()


class _Counted(str):
    """A str that counts the characters a reader iterated over."""

    read = 0

    def __iter__(self) -> Any:
        for c in super().__iter__():
            _Counted.read += 1
            yield c


def test_a_label_value_is_cut_before_it_is_escaped() -> None:
    # a runtime's pod label value of megabytes: only what the label keeps is read
    value = _Counted("\n" * 1_000_000)
    assert label_value(value) == "\\n" * 64
    assert _Counted.read <= MAX_VALUE_CHARS


def test_missing_socket(sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "hfsampler.consumers.cri"):
        names = CriNames(str(sock_dir / "nothing.sock"), timeout_s=0.5)
        try:
            t0 = time.monotonic()
            assert not names.refresh_if_due()
            assert time.monotonic() - t0 < 1.5
        finally:
            names.close()
    assert sum("does not exist" in r.getMessage() for r in caplog.records) == 1


def test_an_allowlist_that_is_not_a_regex() -> None:
    with pytest.raises(ConfigError, match="not a regex"):
        cri.allowlist("team(")


@pytest.mark.parametrize("pattern", ["(a+)+$", "(a|aa)*x", "(?:x*y)+", ".*a.*b.*c", "(ab|a)" * 20])
def test_an_allowlist_a_label_key_could_make_backtrack_for_ever_is_refused(pattern: str) -> None:
    with pytest.raises(ConfigError, match="could take far too long"):
        cri.allowlist(pattern)


@pytest.mark.parametrize(
    "pattern", ["team|app", r"app\.kubernetes\.io/.*", ".*team.*", "(team|owner)-[a-z]*", "x{2,9}"]
)
def test_allowlists_people_write_are_taken(pattern: str) -> None:
    assert cri.allowlist(pattern) is not None


def test_a_label_key_longer_than_kubernetes_allows_is_not_matched() -> None:
    allow = cri.allowlist("a.*")
    long_key = "a" * (cri.MAX_KEY_CHARS + 1)
    assert cri.pod_labels({long_key: "x", "ab": "y"}, allow) == (("ab", "y"),)


@pytest.mark.parametrize(
    ("key", "name"),
    [("app.kubernetes.io/name", "app_kubernetes_io_name"), ("team", "team"),
     ("9x", "_9x"), ("__meta", None), ("hpc_job", None), ("", None),
     # a GPU's labels: GPU_I_ID on a whole GPU's consumer would pass it off as a MIG instance's
     ("GPU_I_ID", None), ("MIG.UUID", None), ("UUID", None), ("gpu", None), ("instance", None),
     ("__name__", None)],
)  # fmt: skip
def test_sanitised_label_names(key: str, name: str | None) -> None:
    assert sanitize_label_name(key) == name


def test_method_paths_and_field_numbers_match_the_runtime() -> None:
    svc = pb.DESCRIPTOR.services_by_name["RuntimeService"]
    for method, path in (("ListPodSandbox", cri.LIST_SANDBOXES),
                         ("ListContainers", cri.LIST_CONTAINERS)):  # fmt: skip
        assert f"/{svc.full_name}/{svc.methods_by_name[method].name}" == path

    def numbers(msg: Any) -> dict[str, int]:
        return {f.name: f.number for f in msg.DESCRIPTOR.fields}

    assert numbers(pb.PodSandboxMetadata) == {"name": 1, "uid": 2, "namespace": 3, "attempt": 4}
    sandbox = {"id": 1, "metadata": 2, "state": 3, "created_at": 4, "labels": 5,
               "annotations": 6, "runtime_handler": 7}  # fmt: skip
    assert numbers(pb.PodSandbox) == sandbox
    assert numbers(pb.ListPodSandboxResponse) == {"items": 1}
    assert numbers(pb.Container) == {"id": 1, "pod_sandbox_id": 2, "metadata": 3, "state": 6,
                                     "created_at": 7, "labels": 8, "annotations": 9}  # fmt: skip
    assert numbers(pb.ContainerMetadata) == {"name": 1, "attempt": 2}
    assert numbers(pb.ListContainersResponse) == {"containers": 1}

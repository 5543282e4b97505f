"""A fake container runtime: a real gRPC server on a Unix socket answering the CRI's
``runtime.v1.RuntimeService`` ``ListPodSandbox`` and ``ListContainers`` from lists a test sets,
optionally slow (``delay_s``) or refusing (``fail_with``), counting its calls.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from hfsampler.consumers.cri_pb import cri_pb2 as pb


@dataclass
class FakeSandbox:
    id: str
    uid: str
    name: str
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    ready: bool = True
    attempt: int = 0


@dataclass
class FakeContainer:
    id: str
    sandbox_id: str
    name: str


class FakeRuntime:
    """The CRI RuntimeService on ``path``; change ``sandboxes`` / ``containers`` at any time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sandboxes: list[FakeSandbox] = []
        self.containers: list[FakeContainer] = []
        self.calls: dict[str, int] = {"ListPodSandbox": 0, "ListContainers": 0}
        self.delay_s = 0.0
        self.fail_with: grpc.StatusCode | None = None
        self._release = threading.Event()  # set at stop: a slow answer ends at once
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler(
            "runtime.v1.RuntimeService",
            {
                "ListPodSandbox": grpc.unary_unary_rpc_method_handler(
                    self._sandboxes,
                    request_deserializer=pb.ListPodSandboxRequest.FromString,
                    response_serializer=pb.ListPodSandboxResponse.SerializeToString,
                ),
                "ListContainers": grpc.unary_unary_rpc_method_handler(
                    self._containers,
                    request_deserializer=pb.ListContainersRequest.FromString,
                    response_serializer=pb.ListContainersResponse.SerializeToString,
                ),
            },
        )
        self._server.add_generic_rpc_handlers((handler,))
        assert self._server.add_insecure_port(f"unix://{path}") != 0

    def _answer(self, name: str, context: Any) -> None:
        self.calls[name] += 1
        if self.delay_s:
            self._release.wait(self.delay_s)
        if self.fail_with is not None:
            context.abort(self.fail_with, "fake runtime refuses")

    def _sandboxes(self, request: Any, context: Any) -> Any:
        self._answer("ListPodSandbox", context)
        resp = pb.ListPodSandboxResponse()
        for s in self.sandboxes:
            item = resp.items.add(id=s.id, state=0 if s.ready else 1)
            item.metadata.name, item.metadata.uid = s.name, s.uid
            item.metadata.namespace, item.metadata.attempt = s.namespace, s.attempt
            item.labels.update(s.labels)
        return resp

    def _containers(self, request: Any, context: Any) -> Any:
        self._answer("ListContainers", context)
        resp = pb.ListContainersResponse()
        for c in self.containers:
            item = resp.containers.add(id=c.id, pod_sandbox_id=c.sandbox_id, state=1)
            item.metadata.name = c.name
        return resp

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._release.set()
        self._server.stop(grace=None).wait()


@pytest.fixture
def fake_runtime(sock_dir: Path) -> Iterator[FakeRuntime]:  # sock_dir: conftest's
    runtime = FakeRuntime(sock_dir / "containerd.sock")
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()

"""Pod, namespace and container names for consumers, from the container runtime's CRI socket.

A pod's cgroup names it by uid and its containers by id; the runtime (containerd, CRI-O) knows
their names through its CRI API, ``runtime.v1.RuntimeService``: ``ListPodSandbox`` gives each
pod's name, namespace and Kubernetes labels, ``ListContainers`` each container's name and pod.
The pod's labels become metric labels where their key matches an allowlist regex, sanitised to
label names as dcgm-exporter's ``--kubernetes-enable-pod-labels`` does.

``refresh_if_due`` asks the runtime (gRPC over its Unix socket, ``grpcio`` from the ``k8s``
extra, imported only when a socket is configured) at most once per ``refresh_s``, within
``timeout_s`` for both calls together; it blocks, so a caller runs it off the event loop and off
the sampler's lanes. ``labels`` only reads what the last answer said and never blocks. A runtime
that fails (no socket, slow, refusing) is said once, and the names last known are kept.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hfsampler.consumers import regex_cost
from hfsampler.consumers.identity import Consumer, Kind, label_value, sanitize_label_name
from hfsampler.errors import ConfigError

log = logging.getLogger(__name__)

SERVICE = "runtime.v1.RuntimeService"
LIST_SANDBOXES = f"/{SERVICE}/ListPodSandbox"
LIST_CONTAINERS = f"/{SERVICE}/ListContainers"
POD_LABEL = "pod"
NAMESPACE_LABEL = "namespace"
CONTAINER_LABEL = "container"
ALLOWLIST_KEY = "consumers.pod_label_allowlist"  # the config key it will come from
MAX_MESSAGE_BYTES = 16 << 20  # the kubelet's own limit on a CRI answer (its maxMsgSize)
# A Kubernetes label key: a DNS-subdomain prefix (253), "/", a name (63). A longer key is none
# the API server lets through, and is not matched: the allowlist's cost is bounded over this.
MAX_KEY_CHARS = 317
MAX_ALLOWLIST_PATHS = 200_000  # ".*team.*" over MAX_KEY_CHARS: about 100 000; a millisecond
_SANDBOX_READY = 0


@dataclass(frozen=True, slots=True)
class PodNames:
    name: str
    namespace: str
    labels: tuple[tuple[str, str], ...]  # allowed pod labels, sanitised names, sorted


@dataclass(frozen=True, slots=True)
class RuntimeNames:
    """What one answer of the runtime said: pods by uid, containers by id."""

    pods: Mapping[str, PodNames]
    containers: Mapping[str, tuple[str, str]]  # container id -> (name, pod uid)


def allowlist(pattern: str | None) -> re.Pattern[str] | None:
    """The pod-label allowlist compiled; a pattern that is not a regex, or one that a pod's
    label key could make backtrack for hours (``regex_cost``), is the user's mistake."""
    if not pattern:
        return None
    try:
        compiled = re.compile(pattern)
        regex_cost.check(pattern, MAX_KEY_CHARS, MAX_ALLOWLIST_PATHS)
    except re.error as exc:
        raise ConfigError(
            ALLOWLIST_KEY, f"{pattern!r} is not a regex: {exc}", "a Python regex over label keys"
        ) from None
    except regex_cost.TooCostly as exc:
        raise ConfigError(
            ALLOWLIST_KEY,
            f"{pattern!r} could take far too long on a pod's label key: {exc}",
            "list keys or prefixes without nested repeats, e.g. team|app|example\\.com/.*",
        ) from None
    return compiled


def pod_labels(
    labels: Mapping[str, str], allow: re.Pattern[str] | None
) -> tuple[tuple[str, str], ...]:
    """The pod's labels the allowlist takes (the whole key must match), as label names; of two
    keys that sanitise to one name, the first in key order wins."""
    if allow is None:
        return ()
    out: dict[str, str] = {}
    for key in sorted(labels):
        if len(key) > MAX_KEY_CHARS or not labels[key] or not allow.fullmatch(key):
            continue
        name = sanitize_label_name(key)
        if name is not None and name not in (POD_LABEL, NAMESPACE_LABEL, CONTAINER_LABEL):
            out.setdefault(name, label_value(labels[key]))
    return tuple(sorted(out.items()))


def names_from(sandboxes: Any, containers: Any, allow: re.Pattern[str] | None) -> RuntimeNames:
    """``RuntimeNames`` from a ``ListPodSandboxResponse`` and a ``ListContainersResponse``. Of
    several sandboxes of one pod (a restarted sandbox leaves the old one behind, not ready), the
    ready one, then the latest attempt, names it."""
    best: dict[str, tuple[tuple[bool, int, int], PodNames]] = {}
    uid_of_sandbox: dict[str, str] = {}
    for s in sandboxes.items:
        meta = s.metadata
        if not meta.uid:
            continue
        uid_of_sandbox[s.id] = meta.uid
        rank = (s.state == _SANDBOX_READY, int(meta.attempt), int(s.created_at))
        names = PodNames(label_value(meta.name), label_value(meta.namespace),
                         pod_labels(dict(s.labels), allow))  # fmt: skip
        if meta.uid not in best or rank > best[meta.uid][0]:
            best[meta.uid] = (rank, names)
    by_id = {
        c.id: (label_value(c.metadata.name), uid_of_sandbox.get(c.pod_sandbox_id, ""))
        for c in containers.containers
        if c.id
    }
    return RuntimeNames({uid: names for uid, (_, names) in best.items()}, by_id)


def named_labels(consumer: Consumer, names: RuntimeNames) -> dict[str, str]:
    """A consumer's labels with the runtime's names added: ``pod``, ``namespace``, ``container``
    and the allowed pod labels; none of them replaces a label the identity has."""
    out = consumer.labels()
    if consumer.kind not in (Kind.POD, Kind.CONTAINER):
        return out
    container = names.containers.get(consumer.container_id) if consumer.container_id else None
    uid = consumer.pod_uid or (container[1] if container else "")
    pod = names.pods.get(uid) if uid else None
    extra: dict[str, str] = {}
    if pod is not None:
        extra = {POD_LABEL: pod.name, NAMESPACE_LABEL: pod.namespace, **dict(pod.labels)}
    if container is not None:
        extra[CONTAINER_LABEL] = container[0]
    for key, value in extra.items():
        if value:
            out.setdefault(key, value)
    return out


class CriNames:
    """The container runtime's names for consumers, cached; see the module's docstring."""

    def __init__(
        self,
        socket_path: str,
        pod_label_allowlist: str | None = None,
        timeout_s: float = 1.0,
        refresh_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import grpc  # the `k8s` extra; imported only when a runtime socket is configured

        from hfsampler.consumers.cri_pb import cri_pb2 as pb

        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._clock = clock
        self._allow = allowlist(pod_label_allowlist)
        self._pb = pb
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.insecure_channel(f"unix://{os.path.abspath(socket_path)}", options)
        self._list_sandboxes = self._channel.unary_unary(
            LIST_SANDBOXES,
            request_serializer=pb.ListPodSandboxRequest.SerializeToString,
            response_deserializer=pb.ListPodSandboxResponse.FromString,
        )
        self._list_containers = self._channel.unary_unary(
            LIST_CONTAINERS,
            request_serializer=pb.ListContainersRequest.SerializeToString,
            response_deserializer=pb.ListContainersResponse.FromString,
        )
        self._rpc_error: type[Exception] = grpc.RpcError
        self._names = RuntimeNames({}, {})
        self._answer: tuple[Any, Any] | None = None  # the last answer, for a new allowlist
        self._asked_at: float | None = None
        self._failing = False
        self._lock = threading.Lock()  # one refresh at a time
        self._names_lock = threading.Lock()  # the allowlist and the names made with it
        if not os.path.exists(socket_path):
            log.warning("container runtime socket %s does not exist (yet): pod and container "
                        "names appear once it does; mount the runtime's socket into the pod",
                        label_value(socket_path))  # fmt: skip

    @property
    def names(self) -> RuntimeNames:
        return self._names

    def labels(self, consumer: Consumer) -> dict[str, str]:
        """The consumer's labels with the names last known; never blocks."""
        return named_labels(consumer, self._names)

    def refresh_if_due(self) -> bool:
        """Ask the runtime if ``refresh_s`` has passed since the last ask (answered or not);
        blocks for at most ``timeout_s``. True if the names were renewed."""
        with self._lock:
            now = self._clock()
            if self._asked_at is not None and now - self._asked_at < self.refresh_s:
                return False
            self._asked_at = now
            deadline = time.monotonic() + self.timeout_s
            try:
                sandboxes = self._list_sandboxes(
                    self._pb.ListPodSandboxRequest(), timeout=self.timeout_s
                )
                left = max(deadline - time.monotonic(), 0.001)
                containers = self._list_containers(self._pb.ListContainersRequest(), timeout=left)
            except self._rpc_error as exc:
                if not self._failing:
                    self._failing = True
                    detail = exc.details() if hasattr(exc, "details") else str(exc)
                    log.warning(
                        "container runtime %s: %s; keeping the names last known",
                        label_value(self.socket_path),
                        label_value(str(detail)),
                    )
                return False
            with self._names_lock:
                self._answer = (sandboxes, containers)
                self._names = names_from(sandboxes, containers, self._allow)
            if self._failing:
                self._failing = False
                log.info("container runtime %s answers again", label_value(self.socket_path))
            return True

    def set_allowlist(self, pattern: str | None) -> None:
        """A reload's allowlist: the names last known take it at once (no ask of the runtime),
        so the consumers' series the reload starts carry the new pod labels from the first."""
        allow = allowlist(pattern)
        with self._names_lock:
            self._allow = allow
            if self._answer is not None:
                self._names = names_from(*self._answer, allow)

    def close(self) -> None:
        self._channel.close()

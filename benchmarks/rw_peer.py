"""The Python Remote-Write peer that ``encode.py`` measures hfsampler against.

``prometheus-remote-writer`` (PyPI) encodes 1.0 the way most Python writers do: a protobuf
message object per series and per sample (the upb runtime), serialized per batch, then snappy.
It is a benchmark's peer only, never a dependency of the service: ``load_peer`` imports it from
the environment or from a cache folder (``PEER_PATH``, installed there with ``PEER_INSTALL``),
appended to ``sys.path`` so that the project's own protobuf and snappy are the ones used.

The package has no 2.0 encoder, so ``PeerV2`` is its ``send`` path written for 2.0 the same way:
message objects from hfsampler's generated ``writev2_pb2``, a symbol table per request, each
series' metadata; what a straightforward Python 2.0 writer costs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from hfsampler.remote_write.prompb import writev2_pb2
from hfsampler.remote_write.protowrite import METRIC_TYPES
from hfsampler.series import Family, Series

_CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
PEER_PATH = _CACHE_HOME / "hfsampler-bench" / "remote-writer"
PEER_VERSION = "1.1.3"
# --no-deps: its protobuf, grpcio-tools and python-snappy are the project's own; the rest is
# what requests needs.
PEER_INSTALL = (
    f"python -m pip install --no-deps --target {PEER_PATH}"
    f" prometheus-remote-writer=={PEER_VERSION} requests urllib3 certifi charset-normalizer idna"
)

Side = Callable[[int], list[bytes]]  # window -> its requests, compressed


def load_peer(path: Path) -> tuple[ModuleType | None, str]:
    """``prometheus_remote_writer`` from the environment or ``path``, and a line that says where
    it came from, or that it is missing and how to install it."""
    if path.is_dir() and str(path) not in sys.path:
        sys.path.append(str(path))
    try:
        peer = importlib.import_module("prometheus_remote_writer")
    except ImportError as exc:
        return None, (
            f"PEER SIDES LEFT OUT: prometheus-remote-writer is not importable ({exc});"
            f" install it with: {PEER_INSTALL}"
        )
    from google.protobuf.internal import api_implementation

    try:
        release = importlib.metadata.version("prometheus-remote-writer")
    except importlib.metadata.PackageNotFoundError:
        release = "?"
    where = Path(str(peer.__file__)).parent.parent
    return peer, (
        f"peer: prometheus-remote-writer {release} from {where}, protobuf runtime"
        f" {api_implementation.Type()}; peer 2.0: its send path written for 2.0 (it has none)"
    )


class PeerV2:
    """The peer's way of writing a request, for 2.0: a message object per series and per
    sample, a symbol table per request (``""`` first, each string once), labels sorted by
    name, each series' metadata from its family; serialized, then compressed."""

    def __init__(
        self, families: dict[str, Family], compress: Callable[[bytes], bytes], batch: int
    ) -> None:
        self._families = families
        self._compress = compress
        self._batch = batch

    def send(self, metrics: Sequence[dict[str, Any]]) -> list[bytes]:
        step = self._batch
        return [self._build_message(metrics[i : i + step]) for i in range(0, len(metrics), step)]

    def _build_message(self, batch: Sequence[dict[str, Any]]) -> bytes:
        symbols: dict[str, int] = {"": 0}

        def ref(text: str) -> int:
            at = symbols.get(text)
            if at is None:
                at = symbols[text] = len(symbols)
            return at

        timeseries = []
        for item in batch:
            ts = writev2_pb2.TimeSeries()
            for name, value in sorted((str(k), str(v)) for k, v in item["metric"].items()):
                ts.labels_refs.append(ref(name))
                ts.labels_refs.append(ref(value))
            for v, t in zip(item["values"], item["timestamps"], strict=True):
                ts.samples.append(writev2_pb2.Sample(value=float(v), timestamp=int(t)))
            family = self._families.get(item["metric"]["__name__"])
            if family is not None:
                ts.metadata.type = METRIC_TYPES.get(family.type, 0)
                if family.help:
                    ts.metadata.help_ref = ref(family.help)
                if family.unit:
                    ts.metadata.unit_ref = ref(family.unit)
            timeseries.append(ts)
        request = writev2_pb2.Request(symbols=list(symbols))
        request.timeseries.extend(timeseries)
        return self._compress(request.SerializeToString())


def peer_sides(
    peer: ModuleType,
    series: list[Series],
    values: list[list[float]],
    stamps: list[int],
    families: dict[str, Family],
    batch: int,
) -> dict[str, Side]:
    """``peer 1.0`` and ``peer 2.0``: each window's requests as the peer writes them, from its
    own input (a dict per series, as its users hand it over, built here, outside the timing)."""
    items = [
        [
            {"metric": dict(s.all_labels()), "values": [v], "timestamps": [stamps[w]]}
            for s, v in zip(series, values[w], strict=True)
        ]
        for w in range(len(stamps))
    ]

    class Captured(peer.RemoteWriter):  # type: ignore[name-defined, misc]
        """The peer's ``send`` with each request kept instead of posted."""

        sent: list[bytes] = []

        def _send_message(self, message: bytes) -> None:
            self.sent.append(message)

    # batches of at most ``batch`` series, one sample each: the requests hfsampler cuts; labels
    # sorted by name, as the spec wants and hfsampler sends them
    writer = Captured("http://127.0.0.1:9/w", max_series_per_request=batch, sort_labels=True)
    v2 = PeerV2(families, peer.snappy.compress, batch)

    def peer_v1(w: int) -> list[bytes]:
        writer.sent = []
        writer.send(items[w])
        return writer.sent  # type: ignore[no-any-return]

    def peer_v2(w: int) -> list[bytes]:
        return v2.send(items[w])

    return {"peer 1.0": peer_v1, "peer 2.0": peer_v2}

"""Remote-Write 1.0 push: encode snapshots, queue (and spool) them per endpoint, send them."""

from hfsampler.remote_write.config import (
    EndpointConfig,
    QueueConfig,
    endpoint_from_url,
    parse_remote_write,
    redact_url,
)
from hfsampler.remote_write.encoder import Encoder, QueuedSample, compress, encode_metadata
from hfsampler.remote_write.queue import Batch, MemoryQueue, ShardQueue
from hfsampler.remote_write.sender import RemoteWriter, define_metrics
from hfsampler.remote_write.spool import SpoolQueue

__all__ = [
    "Batch",
    "Encoder",
    "EndpointConfig",
    "MemoryQueue",
    "QueueConfig",
    "QueuedSample",
    "RemoteWriter",
    "ShardQueue",
    "SpoolQueue",
    "compress",
    "define_metrics",
    "encode_metadata",
    "endpoint_from_url",
    "parse_remote_write",
    "redact_url",
]
